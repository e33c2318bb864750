"""`bottleneck`: LightXML's discriminator. The representation goes through a low-rank hidden layer
(D -> h); each candidate label has a learnable embedding (h,); logit = embedding . hidden."""

import torch
from torch import nn

from xmcbench.interfaces import Ranker


# Score through the unique candidates while that costs at most this many times the multiply-adds of scoring
# each (document, candidate) pair: matrix products beat gathers by far more than that, but a large prediction
# batch (few shared candidates, U close to B*C) is cheaper pair by pair.
UNIQUE_SCORING_FACTOR = 16


class BottleneckRanker(Ranker):
    """(B, D) representation, (B, C) candidate label ids -> (B, C) logits."""

    def __init__(self, in_dim: int, num_labels: int, hidden_size: int, sparse: bool = True) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_dim, hidden_size)
        # sparse=True: a step's gradient holds only the rows of its candidates, so the optimizer touches
        # B*C rows instead of the whole (L, h) table (250M parameters at Wiki-500K).
        self.label_embedding = nn.Embedding(num_labels, hidden_size, sparse=sparse)
        nn.init.xavier_uniform_(self.label_embedding.weight)

    def forward(self, representation: torch.Tensor, candidate_labels: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden(representation)                      # (B, h)
        unique, inverse = torch.unique(candidate_labels, return_inverse=True)   # (U,), (B, C)
        if unique.numel() <= UNIQUE_SCORING_FACTOR * candidate_labels.shape[1]:
            # Documents of a batch share many candidates: read each label's embedding once and score all of
            # them against every document in one matrix product, (B, h) x (h, U). The gradient then holds U
            # rows instead of B*C, and no (B, C, h) tensor is built (44M floats at the amazon670k preset).
            scores = hidden @ self.label_embedding(unique).T     # (B, U)
            return scores.gather(1, inverse)
        embeddings = self.label_embedding(candidate_labels)       # (B, C, h)
        return torch.bmm(embeddings, hidden.unsqueeze(-1)).squeeze(-1)


def build_bottleneck(config, in_dim: int, num_labels: int) -> BottleneckRanker:
    return BottleneckRanker(in_dim, num_labels, config.hidden_size, sparse=config.sparse_label_embeddings)
