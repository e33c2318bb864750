"""The rows a run trains and validates on, and the labels it trains on: seeded, the test set never looked at."""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from xmcbench.config import MethodSpec, TrainConfig
from xmcbench.data import Dataset
from xmcbench.errors import XmcError


def training_pool(dataset: Dataset, config: TrainConfig) -> np.ndarray:
    """The training rows a run draws from, in a seeded order: all, or a subset of max_train_docs."""
    rows = np.random.default_rng(config.seed).permutation(dataset.train_labels.shape[0])   # texts may be absent
    return rows[:config.max_train_docs] if config.max_train_docs else rows


# Two training documents whose TF-IDF cosine is at least this are near-copies (a source package's binaries that
# share their long description): validation_split=grouped keeps them on one side of the split.
NEAR_COPY_COSINE = 0.9
# Entries of one (chunk, R) block of cosines: common terms make the block dense, so this bounds its memory
# (about 8 bytes an entry) whatever R is. The work grows as R squared: 16-18 s for 24,218 rows on 2 cores.
_NEAR_COPY_BLOCK = 20_000_000


def near_copy_groups(dataset: Dataset, rows: np.ndarray, cosine: float = NEAR_COPY_COSINE) -> np.ndarray:
    """(R,) a group id per row of `rows` (training-set indices): rows joined by a chain of near-copies
    (TF-IDF cosine >= `cosine` over these rows' texts, or the dataset's own features when it has no texts) share
    one id. Labels are never read."""
    from xmcbench.features import tfidf_features, unit_rows   # scikit-learn: only when a grouped split is asked for

    if dataset.train_texts:
        features = tfidf_features([dataset.train_texts[i] for i in rows], min_df=1)    # (R, F), unit rows
    elif dataset.train_features is not None:
        features = unit_rows(dataset.train_features[rows])
    else:
        raise XmcError(f"validation_split=grouped finds near-copies by their texts or features, and {dataset.name} "
                       "has neither; use validation_split=random")
    reference = features.T.tocsc()
    blocks = []
    chunk = max(1, _NEAR_COPY_BLOCK // max(1, len(rows)))
    for start in range(0, len(rows), chunk):
        block = (features[start:start + chunk] @ reference).tocsr()                  # (chunk, R) cosines
        block.data = (block.data >= cosine).astype(np.int8)
        block.eliminate_zeros()
        blocks.append(block)
    _, groups = connected_components(sp.vstack(blocks, format="csr"), directed=False)
    return groups


def grouped_validation(dataset: Dataset, rows: np.ndarray, size: int, cosine: float = NEAR_COPY_COSINE) -> np.ndarray:
    """(size,) validation rows drawn from `rows` (a seeded order) by whole near-copy groups: groups are taken in
    the order of their first row, each only if it still fits, so no validation row has a near-copy among the
    rows left for training. Fewer than `size` rows come back only when no group left is small enough to fill
    the rows still missing."""
    groups = near_copy_groups(dataset, rows, cosine)
    group_sizes = np.bincount(groups)
    chosen = np.zeros(len(group_sizes), dtype=bool)
    taken = 0
    for group in groups:   # in the seeded order of the rows: the group of each row's first appearance
        if taken == size:
            break
        if not chosen[group] and taken + group_sizes[group] <= size:
            chosen[group] = True
            taken += group_sizes[group]
    return rows[chosen[groups]]


def split_train_rows(dataset: Dataset, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (training rows, validation rows) of the training set; the test set is never looked at.

    validation_split=random: the first validation_size rows of the seeded pool. grouped: as many rows, drawn by
    whole groups of near-copies (grouped_validation), as a test split that keeps related documents together
    stands to its training rows."""
    rows = training_pool(dataset, config)
    if config.validation_size >= len(rows):
        raise XmcError(f"validation_size={config.validation_size} leaves no training documents "
                       f"(the training set has {len(rows)})")
    if config.validation_split == "grouped" and config.validation_size:
        validation = grouped_validation(dataset, rows, config.validation_size)
        training = np.setdiff1d(rows, validation)
    else:
        validation, training = rows[:config.validation_size], rows[config.validation_size:]
    return np.sort(training), np.sort(validation)


def training_view(dataset: Dataset, config: TrainConfig, spec: MethodSpec, log=print) -> tuple[Dataset, list[str]]:
    """The dataset as a run trains on it, and the names of the labels held out of training.

    zero_shot_labels = s > 0: a seeded share s of the training labels that the test set has are held out: their
    positives are removed from every training document (validation rows included), and they stay in the test
    set, where only a method that reads label texts can find them. A method that scores unseen labels
    (MethodSpec.scores_unseen_labels) on a dataset with label texts gets every label in its vocabulary (num_labels
    = all of label_names), test-only labels included. Propensities stay the dataset's (all its training documents,
    before any hold-out), as for max_train_docs: one dataset, one set of weights."""
    held_out: list[str] = []
    if config.zero_shot_labels > 0:
        in_test = np.flatnonzero(np.asarray(dataset.test_labels[:, :dataset.num_labels].sum(axis=0)).ravel() > 0)
        count = int(round(config.zero_shot_labels * len(in_test)))
        chosen = np.sort(np.random.default_rng(config.seed).permutation(in_test)[:count])
        keep = np.ones(dataset.train_labels.shape[1], dtype=np.float32)
        keep[chosen] = 0.0
        train_labels = (dataset.train_labels @ sp.diags(keep)).tocsr()
        train_labels.eliminate_zeros()
        train_labels.sort_indices()   # the product leaves rows unsorted; readers may expect the canonical form
        dataset = dataclasses.replace(dataset, train_labels=train_labels)
        held_out = [dataset.label_names[i] for i in chosen]
        log(f"zero-shot split: {count} of the {len(in_test)} training labels the test set has held out of training "
            f"(zero_shot_labels={config.zero_shot_labels:g}, seed {config.seed})")
    if spec.scores_unseen_labels and dataset.label_texts is not None and dataset.num_labels < len(dataset.label_names):
        dataset = dataclasses.replace(dataset, num_labels=len(dataset.label_names))
    return dataset, held_out
