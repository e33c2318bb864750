"""`node-linear`: one weight vector and bias per node (or label) of a level, read from the level's own
representation, with no bottleneck (CascadeXML's per-level classifiers)."""

from __future__ import annotations

import torch
from torch import nn

from xmcbench.interfaces import Ranker

# As the bottleneck ranker: score through the unique candidates of a batch while that costs at most this many
# times the multiply-adds of scoring each (document, candidate) pair.
UNIQUE_SCORING_FACTOR = 16


class NodeLinearRanker(Ranker):
    """(B, D) representation, (B, C) candidate node ids -> (B, C) logits = <w_c, x> + b_c."""

    def __init__(self, in_dim: int, num_items: int, sparse: bool = True) -> None:
        super().__init__()
        # sparse=True: a step's gradient holds only the rows of its candidates (RowAdam updates those)
        self.weight = nn.Embedding(num_items, in_dim, sparse=sparse)
        self.bias = nn.Embedding(num_items, 1, sparse=sparse)
        nn.init.xavier_uniform_(self.weight.weight)
        nn.init.zeros_(self.bias.weight)

    def forward(self, representation: torch.Tensor, candidate_labels: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(candidate_labels, return_inverse=True)   # (U,), (B, C)
        if unique.numel() <= UNIQUE_SCORING_FACTOR * candidate_labels.shape[1]:
            scores = representation @ self.weight(unique).T + self.bias(unique).T   # (B, U)
            return scores.gather(1, inverse)
        weights = self.weight(candidate_labels)                                  # (B, C, D)
        return torch.bmm(weights, representation.unsqueeze(-1)).squeeze(-1) + self.bias(candidate_labels)[..., 0]


def build_node_linear(config, in_dim: int, num_labels: int) -> NodeLinearRanker:
    return NodeLinearRanker(in_dim, num_labels, sparse=config.sparse_label_embeddings)
