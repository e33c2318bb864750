"""Label clusters: how many, and which labels share one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from xmcbench import clustering
from xmcbench.config import TrainConfig
from xmcbench.data import Dataset
from xmcbench.errors import XmcError
from xmcbench.interfaces import LabelClusters
from xmcbench.storage import atomic_write, cache_dir, fingerprint


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
    return clustering.num_clusters_for(num_labels, size)


def label_clusters(dataset: Dataset, config: TrainConfig, train_rows: np.ndarray) -> LabelClusters:
    """Balanced clusters of the training labels from their TF-IDF (or provided sparse) features, cached on
    disk per (dataset version, training rows, K, seed)."""
    num_labels = dataset.num_labels
    num_clusters = resolve_num_clusters(config, num_labels)
    if num_clusters == num_labels:
        return LabelClusters.from_assignment(torch.arange(num_labels), num_labels)
    key = fingerprint(dataset.version, train_rows.tolist() if len(train_rows) < len(dataset.train_texts) else "all",
                      num_clusters, config.seed, str(dataset.feature_file and dataset.feature_file.name),
                      clustering.ALGORITHM_VERSION,
                      *([f"zero-shot {config.zero_shot_labels}"] if config.zero_shot_labels else []))
    path = cache_dir() / "clusters" / f"{key}.npy"
    if path.exists():
        assignment = np.load(path, allow_pickle=False)
    else:
        if dataset.feature_file is not None:
            features = clustering.read_sparse_features(dataset.feature_file, len(dataset.train_texts))[train_rows]
        else:
            features = clustering.tfidf_features([dataset.train_texts[i] for i in train_rows])
        labels = dataset.train_labels[train_rows][:, :num_labels]
        assignment = clustering.balanced_clusters(clustering.label_features(features, labels), num_clusters,
                                                  seed=config.seed)

        def write(temporary: Path) -> None:
            with open(temporary, "wb") as file:
                np.save(file, assignment)

        atomic_write(path, write)
    return LabelClusters.from_assignment(torch.from_numpy(assignment), num_clusters)
