"""The one place a run's `xmcbench.interfaces.LabelInfo` is built: what a method may know of its labels.

Everything that hands label information to plugin code — a component's early `check(config, label_info)`
(`Registry.add_component`), a factory or a whole method that asks for it, the model folder that keeps it —
builds it here, so all of them see the same names, texts, counts and propensities in the same order.
"""

from __future__ import annotations

import numpy as np

from xmcbench.config import TrainConfig
from xmcbench.data import Dataset
from xmcbench.interfaces import LabelInfo


def label_info(dataset: Dataset, config: TrainConfig, train_rows: np.ndarray, propensities=None) -> LabelInfo:
    """The LabelInfo of a run on `dataset`, in label-id order: the L = dataset.num_labels training labels
    (the model's vocabulary; test-only labels come after them in the dataset and are left out).

    dataset: the run's dataset. config: the run's settings (its propensity_a / propensity_b choose the
    propensity model when `propensities` is not given). train_rows: (N_train,) int, the rows of the training
    set the run trains on, as `runner.split_train_rows(dataset, config)[0]` returns them (validation rows and
    the rows max_train_docs leaves out are not counted). propensities: the run's `runner.Propensities`, when
    the caller has computed them already (`runner.propensities(dataset, config)`); None computes them.

    Returns LabelInfo with
        names: (L,) dataset.label_names[:L];
        texts: (L,) dataset.label_texts[:L] (a label without a text carries its name), or None when the
               dataset has no label texts;
        counts: (L,) int64, training documents per label among `train_rows` (runner.label_document_counts);
        inverse_propensities: (L,) float64, 1 / p_l of the run's propensity model, counted on every training
               document of the dataset as PSP@k is (runner.propensities).
    """
    from xmcbench import runner

    num_labels = dataset.num_labels
    weights = propensities if propensities is not None else runner.propensities(dataset, config)
    counts = runner.label_document_counts(dataset.train_labels[np.asarray(train_rows)][:, :num_labels])
    texts = None if dataset.label_texts is None else tuple(dataset.label_texts[:num_labels])
    return LabelInfo(names=tuple(dataset.label_names[:num_labels]), texts=texts, counts=counts,
                     inverse_propensities=np.asarray(weights.inverse[:num_labels], dtype=np.float64))
