"""Candidate-label arithmetic shared by samplers (training) and the pipeline (prediction).

All of it works on (B, ·) index tensors: no dense (B, L) label vector is ever built.
"""

from __future__ import annotations

import torch

from xmcbench.interfaces import Candidates, LabelClusters

_SENTINEL = torch.iinfo(torch.long).max


def unique_per_row(ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, M) ids with a validity mask -> the ids sorted per row, repeats and invalid slots masked out.

    Returns (ids (B, M) with masked slots set to 0, keep (B, M) bool)."""
    ordered = torch.where(valid, ids, _SENTINEL).sort(dim=1).values
    keep = ordered != _SENTINEL
    keep[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    return torch.where(keep, ordered, 0), keep


def expand_clusters(cluster_ids: torch.Tensor, cluster_valid: torch.Tensor,
                    clusters: LabelClusters) -> Candidates:
    """(B, M) cluster ids and their validity -> the labels of those clusters as Candidates (B, M*S),
    targets left empty. Each label belongs to one cluster, so distinct clusters give distinct labels."""
    labels = clusters.cluster_labels[cluster_ids]                         # (B, M, S)
    mask = (labels >= 0) & cluster_valid.unsqueeze(-1)
    source = cluster_ids.unsqueeze(-1).expand_as(labels)
    batch = labels.shape[0]
    return Candidates(labels=labels.clamp_min(0).reshape(batch, -1), mask=mask.reshape(batch, -1),
                      clusters=source.reshape(batch, -1))


def positive_targets(candidate_labels: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """(B, C) candidate ids, (B, P) positive ids padded with -1 -> (B, C) float 1 where the candidate is
    positive, found by binary search in each row's sorted positives."""
    sorted_positives = torch.where(positives < 0, _SENTINEL, positives).sort(dim=1).values.contiguous()
    index = torch.searchsorted(sorted_positives, candidate_labels.contiguous())
    index = index.clamp_max(positives.shape[1] - 1)
    return (sorted_positives.gather(1, index) == candidate_labels).float()


def candidates_with_positives(cluster_ids: torch.Tensor, positives: torch.Tensor,
                              clusters: LabelClusters) -> Candidates:
    """The training candidates of a sampler that picked `cluster_ids` (B, M): those clusters plus the
    clusters of every positive label (B, P, padded with -1), without repeats, with 0/1 targets."""
    positive_clusters = clusters.label_cluster[positives.clamp_min(0)]
    ids = torch.cat([cluster_ids, positive_clusters], dim=1)
    valid = torch.cat([torch.ones_like(cluster_ids, dtype=torch.bool), positives >= 0], dim=1)
    ids, keep = unique_per_row(ids, valid)
    candidates = expand_clusters(ids, keep, clusters)
    candidates.targets = positive_targets(candidates.labels, positives) * candidates.mask
    return candidates
