"""A run's LabelInfo (xmcbench.interfaces.LabelInfo): built once from the dataset and the run's training rows,
saved in the model folder (model/label_info.json) so that prediction needs no dataset, and read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmcbench.data import Dataset
from xmcbench.errors import XmcError
from xmcbench.interfaces import LabelInfo
from xmcbench.storage import read_json, write_json

LABEL_INFO_FILE = "label_info.json"


def label_info(dataset: Dataset, train_rows: np.ndarray, inverse_propensities: np.ndarray) -> LabelInfo:
    """The LabelInfo of a run's model vocabulary (the dataset's num_labels training labels): names, texts
    (dataset.label_texts, or None), training-document counts among `train_rows` (the rows the model trains
    on: validation rows and rows left out by max_train_docs do not count) and inverse propensities ((>= L,)
    the run's, counted on every training document of the dataset: xmcbench.runner.propensities)."""
    num_labels = dataset.num_labels
    counts = np.bincount(dataset.train_labels[np.asarray(train_rows)].tocsr().indices,
                         minlength=len(dataset.label_names))[:num_labels].astype(np.int64)
    texts = None if dataset.label_texts is None else tuple(dataset.label_texts[:num_labels])
    return LabelInfo(tuple(dataset.label_names[:num_labels]), texts, counts,
                     np.asarray(inverse_propensities, dtype=np.float64)[:num_labels])


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
        raise XmcError(f"{path} does not describe the model's {size} labels (texts, counts, inverse_propensities): "
                       f"the label information is damaged; {remedy}")
    return LabelInfo(tuple(names), None if texts is None else tuple(texts), counts, inverse)
