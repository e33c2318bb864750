"""The rows a run trains and validates on, and the labels it trains on: seeded, the test set never looked at."""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from xmcbench.config import MethodSpec, TrainConfig
from xmcbench.data import Dataset
from xmcbench.errors import XmcError


def training_pool(dataset: Dataset, config: TrainConfig) -> np.ndarray:
    """The training rows a run draws from, in a seeded order: all, or a subset of max_train_docs."""
    rows = np.random.default_rng(config.seed).permutation(dataset.train_labels.shape[0])   # texts may be absent
    return rows[:config.max_train_docs] if config.max_train_docs else rows


def split_train_rows(dataset: Dataset, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (training rows, validation rows) of the training set; the test set is never looked at."""
    rows = training_pool(dataset, config)
    if config.validation_size >= len(rows):
        raise XmcError(f"validation_size={config.validation_size} leaves no training documents "
                       f"(the training set has {len(rows)})")
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
