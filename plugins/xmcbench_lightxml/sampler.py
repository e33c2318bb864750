"""`dynamic`: LightXML's dynamic negative sampling. Each step the *current* recaller's top-b clusters
give the negatives, so they get harder as the recaller improves; the clusters of all positive labels
are added, so every positive is a candidate (the original code could drop positives that overflowed
its fixed budget, and padded with duplicate labels)."""

import torch

from xmcbench.candidates import candidates_with_positives
from xmcbench.interfaces import Candidates, LabelClusters, Sampler


class DynamicSampler(Sampler):
    def __init__(self, top_clusters: int) -> None:
        super().__init__()
        self.top_clusters = top_clusters

    def forward(self, recall_logits: torch.Tensor, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        top = recall_logits.topk(min(self.top_clusters, recall_logits.shape[1]), dim=1).indices   # (B, b)
        return candidates_with_positives(top, positives, clusters)


def build_dynamic(config) -> DynamicSampler:
    return DynamicSampler(config.top_clusters)
