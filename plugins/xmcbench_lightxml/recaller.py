"""`cluster-linear`: LightXML's generator, one linear layer from the representation to cluster logits."""

import torch
from torch import nn

from xmcbench.interfaces import Recaller


class ClusterLinearRecaller(Recaller):
    """(B, D) -> (B, K) cluster logits."""

    def __init__(self, in_dim: int, num_clusters: int) -> None:
        super().__init__()
        self.num_clusters = num_clusters
        self.linear = nn.Linear(in_dim, num_clusters)

    def forward(self, representation: torch.Tensor) -> torch.Tensor:
        return self.linear(representation)


def build_cluster_linear(config, in_dim: int, num_clusters: int) -> ClusterLinearRecaller:
    return ClusterLinearRecaller(in_dim, num_clusters)
