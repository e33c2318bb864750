"""Calibrating a flat model's label logits per bin of training documents, on documents training never saw.

A flat model trained one-vs-all scores its labels on scales that drift apart with their frequency: it grows
confident on the frequent labels, whose positives it sees thousands of times, and stays timid on the rare ones,
whose few positives it has fitted and whose every other document is a negative. Ranking by the logits then
ranks by that drift too. Ranking by each label's calibrated probability of being relevant is what maximises
expected P@k, so the fit below, sigmoid(a_b z + c_b) per group b of frequency bins by binary cross-entropy on
the validation rows, corrects the ranking between the bins and keeps it within each one.

Bins are metrics.FREQUENCY_BINS; adjacent bins share one fit until they hold fusion.MIN_BIN_POSITIVES
validation positives (fusion.weight_bin_groups), so two parameters never rest on a handful of positives.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from xmcbench.fusion import weight_bin_groups
from xmcbench.metrics import FREQUENCY_BINS, frequency_bin_of

__all__ = ["fit_bin_calibration", "fit_platt"]

LBFGS_ITERATIONS = 100


def fit_bin_calibration(logits: torch.Tensor, truth: sp.csr_matrix, counts: np.ndarray
                        ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Platt scaling per group of frequency bins, fitted on the validation rows.

    logits: (V, L) float32 of the validation documents; truth: (V, L) 0/1 csr; counts: (L,) training documents
    per label. Returns scales (L,) and offsets (L,) such that sigmoid(scales * logits + offsets) estimates each
    label's probability, and one line per group for the log. When all bins together hold fewer than
    MIN_BIN_POSITIVES validation positives there is no group, and every label keeps scale 1 and offset 0."""
    bins = frequency_bin_of(counts)
    truth = sp.csr_matrix(truth)
    positives_per_label = np.asarray(truth.sum(axis=0)).ravel()
    positives = [int(positives_per_label[bins == index].sum()) for index in range(len(FREQUENCY_BINS))]
    scales, offsets, lines = torch.ones(len(counts)), torch.zeros(len(counts)), []
    for group in weight_bin_groups(positives):
        columns = np.flatnonzero(np.isin(bins, group))
        if not len(columns):
            continue
        scale, offset = fit_platt(logits[:, torch.from_numpy(columns)], truth[:, columns])
        scales[columns], offsets[columns] = scale, offset
        low, high = FREQUENCY_BINS[group[0]][0], FREQUENCY_BINS[group[-1]][1]
        span = (f"labels of {low}-{high} training documents" if high is not None
                else f"labels of >{low - 1} training documents" if low else "all labels")
        lines.append(f"{span} ({sum(positives[index] for index in group)} validation positives): "
                     f"a {scale:.3f}, c {offset:.3f}")
    return scales, offsets, lines


def fit_platt(logits: torch.Tensor, truth: sp.csr_matrix) -> tuple[float, float]:
    """The one scale a and offset c for which sigmoid(a z + c) fits (V, C) logits z to their (V, C) 0/1 truth
    best by binary cross-entropy."""
    z = logits.float().reshape(-1)
    y = torch.from_numpy(sp.csr_matrix(truth).toarray().astype(np.float32).reshape(-1))
    scale, offset = torch.ones((), requires_grad=True), torch.zeros((), requires_grad=True)
    optimiser = torch.optim.LBFGS([scale, offset], max_iter=LBFGS_ITERATIONS, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimiser.zero_grad()
        value = nn.functional.binary_cross_entropy_with_logits(scale * z + offset, y)
        value.backward()
        return value

    with torch.enable_grad():
        optimiser.step(loss)
    return scale.item(), offset.item()
