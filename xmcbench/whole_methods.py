"""Whole methods (`xmcbench.interfaces.WholeMethod`): what they read, their predictions, their saved models.

Their runs are xmcbench.runs.whole. Their model folder:

    model/model.json    schema, "whole_method" (the method's name), the config, num_labels, the size and
                        sha256 of every other file of the folder ("files"), and a checksum of itself
    model/labels.json   the label names, in label-id order
    model/label_info.json  the labels' texts, training counts and inverse propensities (xmcbench.labels)
    model/method/       what WholeMethod.save wrote (pickle-free, by the contract)

Loading checks the folder as `xmcbench.modelio` does for component models: a missing, damaged or edited
file, or a method no installed plugin provides, ends in one XmcError line.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import xmcbench
from xmcbench.config import TrainConfig
from xmcbench.data import Dataset
from xmcbench.device import pick_device
from xmcbench.errors import XmcError, joined_line
from xmcbench.inference import Predictions
from xmcbench.interfaces import LabelInfo, WholeMethod, call_factory, declared_keywords
from xmcbench.labels import load_label_info, save_label_info
from xmcbench.modelio import REDO, file_digest, read_labels, read_signed_description, signed_description, \
    verify_files
from xmcbench.registry import Registry
from xmcbench.storage import read_json, write_json

SCHEMA_VERSION = 1
METHOD_FOLDER = "method"
REQUIRED_KEYS = ("schema", "whole_method", "config", "num_labels", "files")


# -- predictions ------------------------------------------------------------------------------------

def predict(model: WholeMethod, documents: list[str] | sp.csr_matrix, top_k: int) -> Predictions:
    """`model.predict` (texts) or `model.predict_features` ((N, D) CSR features, see documents_of) as the
    model's Predictions: labels (N, top_k) int64, scores (N, top_k) float32, no recalled clusters. A result
    of another shape is a bug of the plugin, not a user's mistake."""
    if sp.issparse(documents):
        count = documents.shape[0]
        if count == 0:
            return Predictions(np.full((0, top_k), -1, dtype=np.int64), np.full((0, top_k), -1.0, np.float32), None)
        labels, scores = model.predict_features(documents.tocsr(), top_k)
    else:
        count = len(documents)
        labels, scores = model.predict(list(documents), top_k)
    labels, scores = np.asarray(labels), np.asarray(scores)
    if labels.shape != (count, top_k) or scores.shape != labels.shape:
        raise ValueError(f"{type(model).__qualname__}.predict returned labels {labels.shape} and scores "
                         f"{scores.shape} for {count} documents and top_k={top_k}; the contract is ({count}, "
                         f"{top_k}) each (xmcbench.interfaces.WholeMethod)")
    return Predictions(labels.astype(np.int64, copy=False), scores.astype(np.float32, copy=False), None)


def reads_features(method: type[WholeMethod], dataset: Dataset) -> bool:
    """Whether a run of `method` on `dataset` fits on the dataset's own sparse features rather than its texts:
    when the method reads them (WholeMethod.reads_features) and the dataset has them for both splits. The
    raw-text layout's features file covers the training documents only, so such a dataset is read as texts
    (and its file is not read: the test split is asked first)."""
    return method.reads_features and dataset.test_features is not None and dataset.train_features is not None


def documents_of(dataset: Dataset, split: str, rows: np.ndarray | None, features: bool) -> list[str] | sp.csr_matrix:
    """What a whole method reads of a split ("train" or "test"): the texts, or the (N, D) CSR features,
    of `rows` (None: all)."""
    if features:
        matrix = dataset.train_features if split == "train" else dataset.test_features
        return matrix if rows is None else matrix[rows]
    texts = dataset.train_texts if split == "train" else dataset.test_texts
    return texts if rows is None else [texts[i] for i in rows]


def check_inputs(method_name: str, method: type[WholeMethod] | None, dataset: Dataset, registry: Registry) -> None:
    """Refuse, in one line, a run that has nothing to read: a dataset of sparse features only (no texts)
    given to a method that reads texts (every component method, and whole methods without reads_features)."""
    if dataset.train_texts or (method is not None and reads_features(method, dataset)):
        return
    readers = sorted(name for name in registry.methods
                     if getattr(registry.method(name).whole_method, "reads_features", False))
    raise XmcError(f"{dataset.name} has sparse features but no texts, and {method_name} reads texts; use a method "
                   f"that reads features ({', '.join(readers) or 'none is installed, e.g. plt from xmcbench-linear'}),"
                   " or a copy of the dataset with its texts")


# -- the method and the machine -----------------------------------------------------------------


def keeps_checkpoints(method: type[WholeMethod]) -> bool:
    """Whether the method's fit continues from its own checkpoints (it declares `checkpoint_dir`)."""
    return "checkpoint_dir" in declared_keywords(method.fit)


def method_device(name: str, method: type[WholeMethod], config: TrainConfig) -> torch.device:
    """The device a whole method computes on: config.device when it is one of the method's `devices` (a
    one-line refusal otherwise); for "auto", the first of them the machine has."""
    if config.device == "auto":
        for kind in method.devices:
            if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
                return torch.device(kind)
        raise XmcError(f"{name} computes on {', '.join(method.devices)} only, and this machine has none of them")
    device = pick_device(config)
    if device.type not in method.devices:
        raise XmcError(f"{name} computes on {', '.join(method.devices)} only; drop --set device={config.device}")
    return device


# -- the model folder -------------------------------------------------------------------------------

def save_model_dir(directory: Path, model: WholeMethod, method_name: str, config: TrainConfig,
                   label_names: list[str], label_info: LabelInfo | None = None) -> None:
    """model/: the method's own files in method/, labels.json, label_info.json, and model.json (last, with
    every file's size and sha256, so an interrupted save is never taken for a complete model)."""
    directory = Path(directory)
    if directory.exists():   # an unfinished run's, continued by --resume: model.json goes first
        (directory / "model.json").unlink(missing_ok=True)
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    model.save(directory / METHOD_FOLDER)
    write_json(directory / "labels.json", label_names)
    files = ["labels.json"]
    if label_info is not None:
        files.append(save_label_info(directory, label_info).name)
    files += sorted(path.relative_to(directory).as_posix()
                    for path in (directory / METHOD_FOLDER).rglob("*") if path.is_file())
    write_json(directory / "model.json", signed_description({
        "schema": SCHEMA_VERSION,
        "xmcbench_version": xmcbench.__version__,
        "whole_method": method_name,
        "config": config.to_dict(),
        "num_labels": len(label_names),
        "files": {name: file_digest(directory / name) for name in files},
    }))


def _model_folder(directory: Path) -> Path:
    directory = Path(directory)
    return directory / "model" if (directory / "model").is_dir() else directory


def is_whole_method_model(directory: Path) -> bool:
    """Whether `directory` (a run directory or its model/ folder) holds a whole method's model."""
    path = _model_folder(directory) / "model.json"
    try:
        meta = read_json(path, "the model description", REDO) if path.is_file() else None
    except XmcError:
        return False   # damaged: the component loader reports it
    return isinstance(meta, dict) and "whole_method" in meta


def load_model_dir(directory: Path, registry: Registry) -> tuple[WholeMethod, TrainConfig, list[str]]:
    """A whole method's saved model, its config (threads and device for this machine) and label names.
    Every problem with its files ends in one XmcError line naming the file and what to do."""
    directory = _model_folder(directory)
    path = directory / "model.json"
    meta = read_signed_description(path, SCHEMA_VERSION, REQUIRED_KEYS)
    label_names = read_labels(directory, meta["num_labels"])
    verify_files(directory, meta)
    name = meta["whole_method"]
    spec = registry.methods.get(name)
    if spec is None or spec.value.whole_method is None:
        failed = registry.failed and "; plugins that failed to load: " + ", ".join(f.name for f in registry.failed)
        raise XmcError(f"{path}: the model was made by method {name!r}, which no installed plugin provides as a "
                       f"whole method{failed or ''}; install the plugin that registers it (`xmcbench plugins` lists "
                       "the loaded ones)")
    try:
        config = TrainConfig.from_dict(meta["config"])
    except XmcError as error:
        raise XmcError(f"{path}: {joined_line(error)}: the model was written by another xmcbench "
                       f"({meta.get('xmcbench_version')}) or its description is damaged; {REDO}") from None
    method = spec.value.whole_method
    # the machine it runs on is this one, not the one that trained it
    config = dataclasses.replace(config, device="auto", threads=0)
    config = dataclasses.replace(config, device=str(method_device(name, method, config)))
    saved_labels = load_label_info(directory, label_names, REDO)
    if saved_labels is None and "label_info" in declared_keywords(method.load):
        raise XmcError(f"{path}: {name} reads the labels' information, which this model folder predates; {REDO}")
    try:
        model = call_factory(method.load, directory / METHOD_FOLDER, config, label_info=saved_labels)
    except XmcError:
        raise
    except Exception as error:   # a backend's own reader failing on a damaged file
        raise XmcError(f"cannot load {directory / METHOD_FOLDER} with {name}: {type(error).__name__}: "
                       f"{joined_line(error)}; {REDO}") from None
    return model, config, label_names
