"""Training batches: the shuffled, length-bucketed order of an epoch and each batch's positive labels."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch


def padded_positives(labels: sp.csr_matrix, rows: np.ndarray) -> torch.Tensor:
    """Rows of a (N, L) 0/1 csr -> (B, P) long label ids padded with -1, P = most labels in the batch."""
    block = labels[rows]
    counts = np.diff(block.indptr)
    positives = np.full((len(rows), max(int(counts.max(initial=0)), 1)), -1, dtype=np.int64)
    slot = np.arange(block.nnz) - np.repeat(block.indptr[:-1], counts)
    positives[np.repeat(np.arange(len(rows)), counts), slot] = block.indices
    return torch.from_numpy(positives)


def epoch_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, bucketing: bool,
                  bucket_batches: int = 50) -> list[np.ndarray]:
    """A shuffled epoch. With bucketing, each window of `bucket_batches` batches is sorted by length before
    it is cut, so a batch pads to a similar length; the batch order is then shuffled."""
    order = rng.permutation(len(lengths))
    if bucketing:
        window = batch_size * bucket_batches
        order = np.concatenate([chunk[np.argsort(lengths[chunk], kind="stable")]
                                for chunk in np.array_split(order, max(1, -(-len(order) // window)))])
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if bucketing:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches
