"""The whole-method contract (`WholeMethod`), in a module that imports no torch: a plugin of whole methods (the
linear ones) registers its classes without loading it, so `xmcbench plugins` stays fast. xmcbench.interfaces
imports it, with the component contracts. Shapes: N texts, L labels, D features, k labels kept per text."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import scipy.sparse as sp

if TYPE_CHECKING:
    from xmcbench.config import TrainConfig


class WholeMethod(ABC):
    """A method that fits, saves, loads and predicts on its own (e.g. TF-IDF + a linear label tree).

    A plugin registers the subclass itself as `MethodSpec(name, description, whole_method=TheClass)`. The
    run gives it its training rows (the validation split held out exactly as for a component
    method), times `fit`, predicts the test and validation texts, scores them with the same code, and saves
    the model in `model/method/` of the run directory; `xmcbench predict`, `evaluate` and `ensemble` call
    `load` and `predict`. `xmcbench.testing.check_whole_method` checks this contract.

    Rules: settings come from the run's `TrainConfig` (your own as `config.options`); `fit` is seeded by
    `config.seed` and uses `config.threads` CPU threads (0: every core available); what `save` writes is
    free of pickle (JSON, numpy/scipy `.npz` without object arrays, safetensors, or a backend's own
    non-pickle format) and refers to nothing outside its folder; mistakes a user can make (a missing
    backend, an option out of range) raise `xmcbench.errors.XmcError` with one line.

    Optional keyword-only parameters of `fit` / `fit_features` (the run passes those declared):
    `label_info` (the run's LabelInfo: names, texts, training counts, propensities; `load` may declare it too,
    and receives the saved one) and `checkpoint_dir` (a folder that survives an interruption: a method that
    declares it saves its progress there and continues from what it finds, so `xmcbench run --resume`
    continues it; a method that does not is refused --resume in one line instead of being fitted again).
    `config.device` is the device the run resolved for it (a type of `devices`), recorded in config.json.
    """

    #: distributions (pip names) whose versions a run records in environment.json, e.g. ("napkinxc",)
    packages: tuple[str, ...] = ()
    #: the torch device types the method can compute on; a run takes the first the machine has ("auto"), or
    #: the one --set device names, which must be among them
    devices: tuple[str, ...] = ("cpu",)
    #: False when the backend cannot be seeded, so that the same seed need not give the same model (a run
    #: records it in config.json, and the conformance suite then skips its determinism check)
    deterministic: bool = True
    #: True when the method can also fit on a dataset's own sparse features (fit_features, predict_features):
    #: then a dataset that has them for both splits (bag-of-words files, PECOS X.npz) is fitted on them rather
    #: than on texts, and a dataset with features but no texts can be run at all
    reads_features: bool = False

    @classmethod
    def check(cls, config: "TrainConfig", num_labels: int) -> None:
        """Refuse a run that cannot work, in one XmcError line (a backend not installed, an option out of
        range, too many labels), before the run folder is touched. Default: accept."""

    @classmethod
    @abstractmethod
    def fit(cls, train_texts: list[str], train_labels: sp.csr_matrix, num_labels: int, config: "TrainConfig",
            log: Callable[[str], None]) -> "WholeMethod":
        """train_texts: N raw texts; train_labels: (N, num_labels) 0/1 CSR (a label may have no positive
        document); log: one line per call, for progress. Returns the fitted model."""

    @abstractmethod
    def save(self, folder: Path) -> None:
        """Write everything `load` needs into `folder`, which does not exist yet."""

    @classmethod
    @abstractmethod
    def load(cls, folder: Path, config: "TrainConfig") -> "WholeMethod":
        """Rebuild what `save` wrote in `folder`; `config` is the run's, with `threads` for this machine."""

    @abstractmethod
    def predict(self, texts: list[str], top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """N raw texts (any string, the empty one included) -> labels (N, top_k) int64 and scores (N, top_k)
        float32. Each row holds distinct label ids in [0, num_labels), best first with non-increasing finite
        scores, then -1 (score -1.0) in the slots left empty; the same texts always give the same result."""

    @classmethod
    def fit_features(cls, train_features: sp.csr_matrix, train_labels: sp.csr_matrix, num_labels: int,
                     config: "TrainConfig", log: Callable[[str], None]) -> "WholeMethod":
        """As fit, on the dataset's own features: train_features (N, D) float32 CSR, row i the document of
        train_labels' row i. Implement it (with predict_features) and set reads_features = True."""
        raise NotImplementedError(f"{cls.__qualname__} does not read sparse features (reads_features is False)")

    def predict_features(self, features: sp.csr_matrix, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """As predict, for (N, D) CSR features of the width fit_features saw, N >= 1."""
        raise NotImplementedError(f"{type(self).__qualname__} does not read sparse features")
