"""The one place a run's `xmcbench.interfaces.LabelInfo` is built, and where the model folder keeps it.

Everything that hands label information to plugin code — a component's early `check(config, label_info)`
(`Registry.add_component`), a factory or a whole method that asks for it, the model folder that keeps it
(model/label_info.json, so prediction needs no dataset) — builds it here, so all of them see the same names,
texts, counts and propensities in the same order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmcbench import scoring
from xmcbench.config import TrainConfig
from xmcbench.data import Dataset
from xmcbench.errors import DamagedModel
from xmcbench.interfaces import LabelInfo
from xmcbench.storage import read_json, write_json

LABEL_INFO_FILE = "label_info.json"


def label_info(dataset: Dataset, config: TrainConfig, train_rows: np.ndarray, propensities=None) -> LabelInfo:
    """The LabelInfo of a run on `dataset`, in label-id order: the L = dataset.num_labels training labels
    (the model's vocabulary; test-only labels come after them in the dataset and are left out).

    dataset: the run's dataset. config: the run's settings (its propensity_a / propensity_b choose the
    propensity model when `propensities` is not given). train_rows: (N_train,) int, the rows of the training
    set the run trains on, as `runs.splits.split_train_rows(dataset, config)[0]` returns them (validation rows and
    the rows max_train_docs leaves out are not counted). propensities: the run's `scoring.Propensities`, when
    the caller has computed them already (`scoring.propensities(dataset, config)`); None computes them.

    Returns LabelInfo with
        names: (L,) dataset.label_names[:L];
        texts: (L,) dataset.label_texts[:L] (a label without a text carries its name), or None when the
               dataset has no label texts;
        counts: (L,) int64, training documents per label among `train_rows` (scoring.label_document_counts);
        inverse_propensities: (L,) float64, 1 / p_l of the run's propensity model, counted on every training
               document of the dataset as PSP@k is (scoring.propensities).
    """
    num_labels = dataset.num_labels
    weights = propensities if propensities is not None else scoring.propensities(dataset, config)
    counts = scoring.label_document_counts(dataset.train_labels[np.asarray(train_rows)][:, :num_labels])
    texts = None if dataset.label_texts is None else tuple(dataset.label_texts[:num_labels])
    return LabelInfo(names=tuple(dataset.label_names[:num_labels]), texts=texts, counts=counts,
                     inverse_propensities=np.asarray(weights.inverse[:num_labels], dtype=np.float64))


def save_label_info(directory: Path, info: LabelInfo) -> Path:
    """model/label_info.json: texts (or null), counts and inverse propensities in label-id order (the names are
    labels.json's). Returns the file's path."""
    path = Path(directory) / LABEL_INFO_FILE
    write_json(path, {"texts": None if info.texts is None else list(info.texts),
                      "counts": info.counts.tolist(), "inverse_propensities": info.inverse_propensities.tolist()})
    return path


def load_label_info(directory: Path, names: list[str], remedy: str) -> LabelInfo | None:
    """The LabelInfo a model folder saved, with `names` from its labels.json; None for a folder saved before
    label information was kept. A damaged file ends in one XmcError line ending in `remedy`."""
    path = Path(directory) / LABEL_INFO_FILE
    if not path.is_file():
        return None
    saved = read_json(path, "the label information", remedy)
    size = len(names)
    try:
        texts, counts, inverse = saved["texts"], saved["counts"], saved["inverse_propensities"]
        valid = (texts is None or (isinstance(texts, list) and len(texts) == size
                                   and all(isinstance(text, str) for text in texts)))
        counts = np.asarray(counts, dtype=np.int64)
        inverse = np.asarray(inverse, dtype=np.float64)
        valid = valid and counts.shape == (size,) and inverse.shape == (size,) and bool((counts >= 0).all()) \
            and bool(np.isfinite(inverse).all())
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        raise DamagedModel(f"{path} does not describe the model's {size} labels (texts, counts, inverse_propensities): "
                           f"the label information is damaged; {remedy}")
    return LabelInfo(tuple(names), None if texts is None else tuple(texts), counts, inverse)
