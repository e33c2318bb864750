"""The contrastive losses of the dual encoders, over each document's candidates: (B, C) similarities (cosine), (B, C)
0/1 targets and a (B, C) mask of real candidates -> a scalar, the mean over the documents that have a positive.

- decoupled softmax (DEXML, Gupta et al., ICLR 2024): each positive against the document's negatives only (the
  other positives leave the denominator), similarities divided by a temperature tau; the document's loss is the mean
  over its positives of -log(exp(s_p) / (exp(s_p) + sum_n exp(s_n))).
- triplet margin with online hard negative mining (NGAME, Dahiya et al., WSDM 2023): each positive against the
  document's k most similar negatives, relu(s_n - s_p + margin), the violating negatives weighted by a softmax of
  their similarity at temperature tau ("aggressive" mining), summed over the k and averaged over the positives.
"""

from __future__ import annotations

import torch

NEGATIVE_FILL = -1e4   # a similarity no real candidate reaches (cosine is in [-1, 1])


def _document_mean(per_document: torch.Tensor, has_positive: torch.Tensor) -> torch.Tensor:
    """The mean over documents that have a positive (a document without one has nothing to learn)."""
    return (per_document * has_positive).sum() / has_positive.sum().clamp_min(1)


def decoupled_softmax(similarity: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """DEXML's loss; similarity (B, C), targets (B, C) 0/1, mask (B, C) bool -> scalar."""
    scaled = similarity.float() / tau
    positive = (targets > 0) & mask
    negative = ~positive & mask
    negatives = torch.logsumexp(scaled.masked_fill(~negative, NEGATIVE_FILL), dim=1, keepdim=True)   # (B, 1)
    log_probability = scaled - torch.logaddexp(scaled, negatives)                                  # (B, C)
    counts = positive.sum(dim=1)
    per_document = -(log_probability * positive).sum(dim=1) / counts.clamp_min(1)
    return _document_mean(per_document, counts > 0)


def triplet_margin(similarity: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, margin: float, k: int,
                   tau: float = 0.1) -> torch.Tensor:
    """NGAME's loss (TripletMarginLossOHNM with apply_softmax); similarity (B, C), targets (B, C), mask (B, C) ->
    scalar."""
    similarity = similarity.float()
    positive = (targets > 0) & mask
    negative = ~positive & mask
    k = min(k, similarity.shape[1])
    hardest, slots = similarity.masked_fill(~negative, NEGATIVE_FILL).topk(k, dim=1)   # (B, k)
    real = negative.gather(1, slots)                                                   # (B, k) a real negative there
    violation = torch.relu(hardest.unsqueeze(1) - similarity.unsqueeze(2) + margin)    # (B, C, k)
    violation = violation * real.unsqueeze(1)
    weights = torch.softmax((hardest / tau).unsqueeze(1).expand_as(violation).masked_fill(violation <= 0, NEGATIVE_FILL),
                            dim=2) * (violation > 0)
    per_positive = (violation * weights).sum(dim=2)                                   # (B, C)
    counts = positive.sum(dim=1)
    per_document = (per_positive * positive).sum(dim=1) / counts.clamp_min(1)
    return _document_mean(per_document, counts > 0)
