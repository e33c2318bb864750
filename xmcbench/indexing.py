"""Label indexing: the clusters a run groups its labels into, from the label indexer the settings name.

An indexer is registered by a plugin (`xmcbench_register_indexers`, `Registry.add_indexer`) and picked with
`--set indexer=NAME`; the built-in one, "balanced-2means", is xmcbench.clustering's balanced 2-means tree. It
is called as

    index(label_features, num_clusters, seed=seed, threads=threads) -> assignment

label_features: (L, F) float32 csr, the labels' PIFA features (xmcbench.features.label_features) with
    L2-normalised rows; a label without training documents has a zero row.
num_clusters: K, a power of two below L (K = L is a flat run, which needs no indexer).
seed: the run's seed (the same seed must give the same assignment); threads: the run's thread count, 0 for one
    per core.
assignment: (L,) int64, the cluster in [0, K) of each label. Every cluster holds floor(L/K) or ceil(L/K)
    labels (label_clusters refuses anything else), and the cluster ids follow a binary tree: the node of
    cluster c among n nodes (n a power of two <= K) is c // (K // n) (tree_level_clusters in
    xmcbench.interfaces builds the deeper tree levels and the recaller's nodes from it), so clusters that share
    a node should hold similar labels.

Shapes: N documents, F features, L labels, K clusters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from xmcbench import clustering
from xmcbench.config import TrainConfig
from xmcbench.data import Dataset
from xmcbench.errors import XmcError
from xmcbench.features import label_features, tfidf_features, unit_rows
from xmcbench.interfaces import LabelClusters
from xmcbench.registry import Registry, code_record
from xmcbench.storage import atomic_write, cache_dir, fingerprint

# What the clusters' cache key says of a dataset's features when it has none: the text of the key's part before
# datasets carried features (str(None)), so that the clusters of text datasets keep their keys.
NO_FEATURES = str(None)
OWN_FEATURES = "the dataset's sparse features"


def num_clusters_for(num_labels: int, cluster_size: int) -> int:
    """Number of clusters K for a target cluster size s.

    Smallest power of two K with ceil(num_labels / K) <= s (1 when num_labels <= s). s = 1 means a flat
    model with one label per cluster: returns num_labels (not necessarily a power of two); callers then use
    the identity label -> cluster mapping.
    """
    if cluster_size < 1:
        raise XmcError(f"cluster_size={cluster_size} must be >= 1 (1 means one label per cluster)")
    if num_labels < 1:
        raise XmcError(f"num_labels={num_labels}: the dataset has no labels; check the label files")
    if cluster_size == 1:
        return num_labels
    k = 1
    while -(-num_labels // k) > cluster_size:  # integer ceil, exact for huge label counts
        k *= 2
    return k


def cluster_members(label_to_cluster: np.ndarray, num_clusters: int) -> list[np.ndarray]:
    """Inverse of a label -> cluster mapping.

    label_to_cluster: (L,) ints in [0, K).
    Returns K int64 arrays of label ids, each sorted ascending (empty for clusters with no label).
    """
    l2c = np.asarray(label_to_cluster, dtype=np.int64)
    if l2c.size and (l2c.min() < 0 or l2c.max() >= num_clusters):
        raise ValueError(f"cluster ids must lie in [0, {num_clusters}), got [{l2c.min()}, {l2c.max()}]")
    # A stable sort keeps label ids ascending within each cluster, in O(L log L) rather than O(L K).
    order = np.argsort(l2c, kind="stable")
    counts = np.bincount(l2c, minlength=num_clusters)
    return np.split(order, np.cumsum(counts)[:-1])


def resolve_num_clusters(config: TrainConfig, num_labels: int) -> int:
    """Number of clusters K; K == num_labels means flat (one label per cluster)."""
    if config.num_clusters > 0:
        if config.num_clusters > num_labels:
            raise XmcError(f"num_clusters={config.num_clusters} exceeds the {num_labels} training labels")
        return config.num_clusters
    size = config.cluster_size
    if size == 0:
        size = 1 if num_labels < config.flat_below else config.auto_cluster_size
    if size == 1:
        return num_labels
    return num_clusters_for(num_labels, size)


def check_indexer(registry: Registry, config: TrainConfig) -> None:
    """Refuse, in one line naming the registered indexers, a config.indexer no loaded plugin registers."""
    registry.indexer(config.indexer)


def label_clusters(dataset: Dataset, config: TrainConfig, train_rows: np.ndarray, registry: Registry) -> LabelClusters:
    """The clusters of the training labels from the indexer config.indexer, over the labels' features from the
    dataset's own sparse training features when it has them (PECOS's X.trn.npz, an XC bag-of-words file, the
    raw-text layout's features file), else from TF-IDF of the training texts; train_rows: (N,) the rows
    trained on. Cached on disk per (dataset version, training rows, K, seed, features, indexer)."""
    num_labels = dataset.num_labels
    num_clusters = resolve_num_clusters(config, num_labels)
    if num_clusters == num_labels:
        return LabelClusters.from_assignment(torch.arange(num_labels), num_labels)
    spec = registry.indexer(config.indexer)
    # The built-in indexer's clusters keep the key they had before indexers were registered; another indexer's
    # key names it and its code, so that a new version of it clusters again.
    made_by = [clustering.ALGORITHM_VERSION] if spec.index is clustering.balanced_clusters \
        else [f"indexer {spec.name}", code_record(registry.indexers[spec.name])]
    rows = train_rows.tolist() if len(train_rows) < dataset.train_labels.shape[0] else "all"
    key = fingerprint(dataset.version, rows, num_clusters, config.seed,
                      OWN_FEATURES if dataset.has_train_features else NO_FEATURES, *made_by,
                      *([f"zero-shot {config.zero_shot_labels}"] if config.zero_shot_labels else []))
    path = cache_dir() / "clusters" / f"{key}.npy"
    if path.exists():
        assignment = np.load(path, allow_pickle=False)
    else:
        if dataset.has_train_features:
            # unit rows, as TF-IDF's are: a format's features come as stored, and a long document must not
            # outweigh the others in its labels' features (rows already unit keep their exact values)
            features = unit_rows(dataset.train_features[train_rows])
        else:
            features = tfidf_features([dataset.train_texts[i] for i in train_rows])
        labels = dataset.train_labels[train_rows][:, :num_labels]
        found = spec.index(label_features(features, labels, threads=config.threads), num_clusters,
                           seed=config.seed, threads=config.threads)
        assignment = checked_assignment(config.indexer, found, num_labels, num_clusters)

        def write(temporary: Path) -> None:
            with open(temporary, "wb") as file:
                np.save(file, assignment)

        atomic_write(path, write)
    return LabelClusters.from_assignment(torch.from_numpy(assignment), num_clusters)


def checked_assignment(name: str, assignment, num_labels: int, num_clusters: int) -> np.ndarray:
    """What the indexer `name` returned as the (L,) int64 assignment of the contract (module docstring); a
    result that breaks it is a bug of the plugin (ValueError), not a user's mistake."""
    found = np.asarray(assignment)
    if found.shape != (num_labels,) or not np.issubdtype(found.dtype, np.integer):
        raise ValueError(f"indexer {name!r} returned an array of shape {found.shape} and dtype {found.dtype} for "
                         f"{num_labels} labels; the contract is ({num_labels},) integers (xmcbench.indexing)")
    if found.min() < 0 or found.max() >= num_clusters:
        raise ValueError(f"indexer {name!r} returned cluster ids from {found.min()} to {found.max()}; they must lie "
                         f"in [0, {num_clusters})")
    sizes = np.bincount(found, minlength=num_clusters)
    smallest, largest = num_labels // num_clusters, -(-num_labels // num_clusters)
    if sizes.min() < smallest or sizes.max() > largest:
        balanced = str(smallest) if smallest == largest else f"{smallest} or {largest}"
        raise ValueError(f"indexer {name!r} returned clusters of {sizes.min()} to {sizes.max()} labels; each of the "
                         f"{num_clusters} clusters of {num_labels} labels must hold {balanced}")
    return found.astype(np.int64, copy=False)
