"""Micro-benchmark of one balanced 2-means split of a ~20,000-label block of label features (the size of a
node four levels below the root of Amazon-670K's tree), from synthetic amazon670k-shaped documents.

    python -m pytest benchmarks/micro/test_clustering_split.py --benchmark-enable --benchmark-only   # measure
    python -m pytest benchmarks/micro/test_clustering_split.py                                       # run once, tiny

With benchmarking disabled (the suite's default) the body runs once on a tiny block; nothing is timed or
asserted about time.
"""

from __future__ import annotations

import numpy as np
import pytest

from xmcbench import synthetic
from xmcbench.clustering import balanced_clusters
from xmcbench.features import label_features

MEASURED = {"docs": 60_000, "labels": 20_000}
TINY = {"docs": 2_000, "labels": 500}


@pytest.fixture
def block(benchmark):
    """(labels, F) label features of the most frequent labels (label id = frequency rank)."""
    sizes = TINY if benchmark.disabled else MEASURED
    features, labels = synthetic.generate_matrices(synthetic.get_shape("amazon670k"), sizes["docs"], seed=0)
    feats = label_features(features, labels)[: sizes["labels"]]
    return feats[np.flatnonzero(feats.getnnz(axis=1))]


def test_balanced_split(benchmark, block):
    """One split (K = 2) in this process: power iterations, 2-means rounds, the balanced cut."""
    assignment = benchmark(balanced_clusters, block, 2, threads=1)
    assert sorted(np.bincount(assignment).tolist()) == [block.shape[0] // 2, block.shape[0] - block.shape[0] // 2]
