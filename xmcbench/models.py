"""Any saved model, whichever kind made it: a model built from components (xmcbench.modelio) or a whole
method's (xmcbench.whole_methods). Load it, predict documents with it, and tell the labels it never saw in
training: what xmcbench.saved and ensemble building use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench import whole_methods
from xmcbench.config import TrainConfig
from xmcbench.data import Dataset
from xmcbench.device import pick_device, set_threads
from xmcbench.errors import XmcError
from xmcbench.fusion import with_tail_slots
from xmcbench.inference import Predictions, predict
from xmcbench.interfaces import WholeMethod
from xmcbench.labels import load_label_info
from xmcbench.model import XMCModel
from xmcbench.modelio import REDO, load_model_dir
from xmcbench.registry import Registry
from xmcbench.scoring import zero_shot_mask
from xmcbench.storage import read_json
from xmcbench.tokenization import tokenize


def load_model(run_dir: Path, registry: Registry) -> tuple[XMCModel | WholeMethod, TrainConfig, list[str]]:
    """The model of a run directory (or of its model/ folder), its config and label names, whichever kind it
    is: built from components (xmcbench.modelio) or a whole method's (xmcbench.whole_methods)."""
    if whole_methods.is_whole_method_model(run_dir):
        return whole_methods.load_model_dir(run_dir, registry)
    return load_model_dir(run_dir, registry)


def test_documents(model: XMCModel | WholeMethod, dataset: Dataset, registry: Registry) -> list[str] | sp.csr_matrix:
    """What a saved model reads of a dataset's test split: its texts, or its sparse features for a whole method
    that reads them (the choice its run made, whole_methods.reads_features)."""
    features = isinstance(model, WholeMethod) and whole_methods.reads_features(type(model), dataset)
    if not features and not dataset.test_texts:
        whole_methods.check_inputs("this model", None, dataset, registry)
    return whole_methods.documents_of(dataset, "test", None, features)


def predict_documents(model: XMCModel | WholeMethod, texts: list[str] | sp.csr_matrix, texts_key: str | None,
                      config: TrainConfig, *, model_dir: Path | None = None, description: str = "predicting",
                      tokenizing: str = "tokenizing") -> Predictions:
    """The top config.top_k labels of raw texts (or, for a whole method that reads them, (N, D) CSR sparse
    features) with a model from load_model, in the order its run scored them: with the run's tail slots
    (config.tail_alpha). model_dir: the run directory or model/ folder it was loaded from, whose label_info.json
    holds the propensities of the tail slots (needed only where config.tail_alpha > 0; read before predicting, so a
    missing file ends in one line without the wait); texts_key: the texts' key in the tokenization cache (None: not
    cached); description, tokenizing: the progress lines' names."""
    inverse_propensities = None if config.tail_alpha == 0 else _tail_slot_propensities(model_dir, config.tail_alpha)
    if isinstance(model, WholeMethod):
        found = whole_methods.predict(model, texts, config.top_k)
    else:
        set_threads(config)
        device = pick_device(config)
        tokens = tokenize(texts, model.encoder.tokenizer, model.encoder.tokens_to_read(config.max_length),
                          texts_key, description=tokenizing)
        found = predict(model, tokens, config, device, description=description)
    if inverse_propensities is None:
        return found
    return with_tail_slots(found, inverse_propensities, config.tail_alpha)


def _tail_slot_propensities(model_dir: Path | None, tail_alpha: float) -> np.ndarray:
    """(L,) 1 / p_l of a saved model's labels, from the label_info.json of model_dir (a run directory or its model/
    folder), for ranking with tail slots; a missing model_dir or file ends in one line."""
    if model_dir is None:
        raise XmcError(f"the model ranks with tail slots (tail_alpha={tail_alpha:g}): pass model_dir, the "
                       "run directory it was loaded from, whose label_info.json holds the propensities they need")
    folder = _model_folder(model_dir)
    info = load_label_info(folder, read_json(folder / "labels.json", "the label list", REDO), REDO)
    if info is None:
        raise XmcError(f"{folder} ranks with tail slots (tail_alpha={tail_alpha:g}) but keeps no "
                       f"label_info.json with its labels' propensities; {REDO}")
    return info.inverse_propensities


def saved_zero_shot_mask(model_dir: Path, label_names: list[str], total_labels: int) -> np.ndarray:
    """zero_shot_mask of a saved model (a run directory or its model/ folder), from the training counts its
    label_info.json kept (only the labels beyond its vocabulary for a model saved before that file existed)."""
    info = load_label_info(_model_folder(model_dir), label_names, REDO)
    return zero_shot_mask(None if info is None else info.counts, len(label_names), total_labels)


def _model_folder(model_dir: Path) -> Path:
    """The model/ folder of a run directory, or the folder itself when it is one."""
    return Path(model_dir) / "model" if (Path(model_dir) / "model").is_dir() else Path(model_dir)
