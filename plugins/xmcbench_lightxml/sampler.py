"""Negative samplers for the ranker.

`dynamic` (LightXML): each step the *current* recaller's top-b clusters give the negatives, so they get
harder as the recaller improves. `static` (the paper's S and BS ablations): the top-b clusters of every
training document are computed once, when the stage that trains the ranker begins, and stay fixed.
`random` (beyond the paper): b clusters drawn uniformly among each document's non-positive clusters at
every step, to show what recaller guidance buys. In all three the clusters of every positive label are
added, so every positive is a candidate (the original code could drop positives that overflowed its
fixed budget, and padded with duplicate labels).
"""

import torch

from xmcbench.candidates import candidates_with_positives
from xmcbench.errors import XmcError
from xmcbench.interfaces import Candidates, LabelClusters, Sampler, StageContext


class DynamicSampler(Sampler):
    def __init__(self, top_clusters: int) -> None:
        super().__init__()
        self.top_clusters = top_clusters

    def forward(self, recall_logits: torch.Tensor, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        top = recall_logits.topk(min(self.top_clusters, recall_logits.shape[1]), dim=1).indices   # (B, b)
        return candidates_with_positives(top, positives, clusters)


class StaticSampler(Sampler):
    """Negatives frozen per document: (N, b) clusters recalled when a stage begins (the first stage has
    none, and trains no ranker), read by document index afterwards."""

    def __init__(self, top_clusters: int) -> None:
        super().__init__()
        self.top_clusters = top_clusters
        self.fixed_clusters: torch.Tensor | None = None   # (N, b) long, on the CPU

    def start_stage(self, context: StageContext) -> None:
        if "rank" in context.stage.losses and self.fixed_clusters is None:
            self.fixed_clusters = context.recalled_clusters(self.top_clusters)

    def training_state(self) -> dict[str, torch.Tensor]:
        return {} if self.fixed_clusters is None else {"fixed_clusters": self.fixed_clusters}

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        self.fixed_clusters = state.get("fixed_clusters")

    def forward(self, recall_logits: torch.Tensor, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        if self.fixed_clusters is None:
            raise XmcError("the static sampler has no frozen candidates: use it in a method whose first stage "
                           "trains the recaller alone (e.g. lightxml-static)")
        top = self.fixed_clusters[doc_index.cpu()].to(positives.device)
        return candidates_with_positives(top, positives, clusters)


class RandomSampler(Sampler):
    def __init__(self, top_clusters: int) -> None:
        super().__init__()
        self.top_clusters = top_clusters

    def forward(self, recall_logits: torch.Tensor, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        # random keys with positive clusters pushed below every other: the top-b keys are a uniform sample
        # of b non-positive clusters without replacement
        keys = torch.rand(recall_logits.shape, device=recall_logits.device)
        valid = positives >= 0
        rows = torch.arange(len(positives), device=positives.device).unsqueeze(1).expand_as(positives)
        keys[rows[valid], clusters.label_cluster[positives[valid]]] = -1.0
        top = keys.topk(min(self.top_clusters, keys.shape[1]), dim=1).indices
        return candidates_with_positives(top, positives, clusters)


def build_dynamic(config) -> DynamicSampler:
    return DynamicSampler(config.top_clusters)


def build_static(config) -> StaticSampler:
    return StaticSampler(config.top_clusters)


def build_random(config) -> RandomSampler:
    return RandomSampler(config.top_clusters)
