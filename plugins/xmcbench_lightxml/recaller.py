"""`cluster-linear`: LightXML's generator, one linear layer from the representation to cluster logits."""

import torch
from torch import nn

from xmcbench.errors import RefusedSetting
from xmcbench.interfaces import EpochContext, LabelInfo, Recaller
from xmcbench_lightxml.options import POSITIVE_WEIGHT



class ClusterLinearRecaller(Recaller):
    """(B, D) -> (B, K) cluster logits."""

    def __init__(self, in_dim: int, num_clusters: int) -> None:
        super().__init__()
        self.num_clusters = num_clusters
        self.linear = nn.Linear(in_dim, num_clusters)

    def forward(self, representation: torch.Tensor) -> torch.Tensor:
        return self.linear(representation)


class PropensityWeightedRecaller(ClusterLinearRecaller):
    """A flat `cluster-linear` whose recall loss weighs each label's positives by its inverse propensity
    (options.positive_weight=propensity): a label seen once counts about ten times a frequent one where it is
    positive, against the negatives every document gives it. The (L,) weights come from the run's LabelInfo when
    an epoch starts and are kept as a buffer, so a run resumed inside an epoch has them."""

    def __init__(self, in_dim: int, num_clusters: int) -> None:
        super().__init__(in_dim, num_clusters)
        self.register_buffer("positive_weights", torch.ones(num_clusters))

    def start_epoch(self, context: EpochContext) -> None:
        weights = torch.as_tensor(context.label_info.inverse_propensities, dtype=torch.float32)
        self.positive_weights.copy_(weights.to(self.positive_weights.device))

    def loss(self, logits: torch.Tensor, cluster_targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), cluster_targets,
                                                              pos_weight=self.positive_weights)


def build_cluster_linear(config, in_dim: int, num_clusters: int) -> ClusterLinearRecaller:
    if POSITIVE_WEIGHT.value_of(config) == "propensity":
        return PropensityWeightedRecaller(in_dim, num_clusters)
    return ClusterLinearRecaller(in_dim, num_clusters)


def check_cluster_linear(config, label_info: LabelInfo) -> None:
    """Refuses, before a run starts, propensity weights where a cluster holds several labels (one weight would
    stand for labels of every frequency)."""
    flat = config.cluster_size == 1 or config.num_clusters == len(label_info.names)
    if POSITIVE_WEIGHT.value_of(config) == "propensity" and not flat:
        raise RefusedSetting("options.positive_weight=propensity weighs each label's positives, so it needs one label "
                             "per cluster (a flat run: --set cluster_size=1); drop it for a run with label clusters")
