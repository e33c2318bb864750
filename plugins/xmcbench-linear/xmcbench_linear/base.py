"""What every linear method of this package shares: TF-IDF features, declared options, the backend check,
the saved folder's layout and the top-k format of `xmcbench.interfaces.WholeMethod`.

A saved model (the run's model/method/ folder):

    linear.json     the method's class, num_labels and every option it was fitted with
    tfidf.json, tfidf_idf.npy    the TF-IDF features (xmcbench_linear.features)
    backend/        the backend's own files (see each method's module for their format)
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
from abc import abstractmethod
from pathlib import Path
from typing import Callable

import numpy as np
import scipy.sparse as sp

from xmcbench.config import TrainConfig, coerce_setting
from xmcbench.errors import XmcError
from xmcbench.whole_contract import WholeMethod
from xmcbench_linear.features import TfidfFeatures

PACKAGE = "xmcbench-linear"
MODEL_FILE = "linear.json"
BACKEND_FOLDER = "backend"
# the option prefixes this package owns: an unknown name with one of them is a typo, said in one line
PREFIXES = ("tfidf_", "plt_", "omikuji_", "ovr_")

TFIDF_OPTIONS = {
    "tfidf_ngram_max": 2,            # word n-grams of 1..n words
    "tfidf_min_df": 2,               # a term is kept when at least this many training documents hold it
    "tfidf_max_features": 1_000_000,  # at most this many terms, the most frequent (0: no limit)
    "tfidf_sublinear_tf": True,      # 1 + log(tf) instead of tf
}
# lowest allowed value of each numeric option (every one has a lower bound; none has an upper one)
MINIMUM = {"tfidf_ngram_max": 1, "tfidf_min_df": 1, "tfidf_max_features": 0}


def _typed(name: str, value, default):
    """An option's value in its default's type (--set gives strings), parsed as the core parses its settings."""
    return coerce_setting(f"options.{name}", value, type(default), "--set or --config")


def threads_of(config: TrainConfig) -> int:
    """config.threads, 0 meaning every core available to this process."""
    return config.threads or len(os.sched_getaffinity(0))


def top_k_arrays(rows: list[list[tuple[int, float]]], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per text, (label, score) pairs in any order -> labels (N, top_k) int64 and scores (N, top_k) float32:
    best first (ties: lower label id first), -1 and -1.0 in the slots left empty."""
    labels = np.full((len(rows), top_k), -1, dtype=np.int64)
    scores = np.full((len(rows), top_k), -1.0, dtype=np.float32)
    for row, pairs in enumerate(rows):
        best = sorted(((float(score), int(label)) for label, score in pairs), key=lambda p: (-p[0], p[1]))[:top_k]
        for slot, (score, label) in enumerate(best):
            labels[row, slot], scores[row, slot] = label, score
    return labels, scores


def label_matrix(labels: sp.spmatrix) -> sp.csr_matrix:
    """(N, L) 0/1 labels -> a float32 CSR copy in canonical form: each row's ids sorted, none twice (napkinXC's
    PLT crashes the process on a row whose ids are not sorted; a column-masked CSR comes out unsorted)."""
    matrix = sp.csr_matrix(labels, dtype=np.float32, copy=True)
    matrix.eliminate_zeros()
    matrix.sum_duplicates()
    matrix.data[:] = 1.0
    return matrix


def label_lists(labels: sp.csr_matrix) -> list[list[int]]:
    """(N, L) 0/1 CSR in canonical form (label_matrix) -> the label ids of each row, in increasing order."""
    return [labels.indices[labels.indptr[i]:labels.indptr[i + 1]].tolist() for i in range(labels.shape[0])]


class LinearMethod(WholeMethod):
    """TF-IDF features of the texts, or the dataset's own sparse features, then a backend fitted on them. A
    subclass names its backend (module and pip extra), declares its options with their defaults, and
    implements the four backend steps."""

    reads_features = True

    #: what the methods are called in messages, the module the backend is imported from, and the extra of
    #: this package that installs it
    TITLE: str
    BACKEND_MODULE: str
    EXTRA: str
    #: the options (config.options) the backend reads, with their defaults; TF-IDF's are added
    OPTIONS: dict = {}

    def __init__(self, features: TfidfFeatures | None, num_labels: int, settings: dict, threads: int,
                 num_features: int | None = None) -> None:
        self.features = features   # None: fitted on a dataset's own sparse features, of num_features columns
        self.num_labels = num_labels
        self.settings = settings   # every option, resolved
        self.threads = threads
        self.num_features = features.num_features if features is not None else num_features

    # -- settings and backend ---------------------------------------------------------------------
    @classmethod
    def declared_options(cls) -> dict:
        return {**TFIDF_OPTIONS, **cls.OPTIONS}

    @classmethod
    def settings_of(cls, config: TrainConfig) -> dict:
        """Every declared option, from config.options or its default, typed and range-checked; an unknown
        option with one of this package's prefixes ends in one line naming the closest."""
        declared = cls.declared_options()
        given = dict(config.options or {})
        for name in given:
            if name.startswith(PREFIXES) and name not in declared:
                close = difflib.get_close_matches(name, list(declared), n=1)
                hint = f"did you mean options.{close[0]}?" if close else \
                    "valid ones: " + ", ".join(f"options.{key}" for key in declared)
                raise XmcError(f"unknown setting options.{name} for {cls.TITLE}: {hint}")
        settings = {name: _typed(name, given.get(name, default), default) for name, default in declared.items()}
        for name, value in settings.items():
            low = cls.minimum().get(name)
            if low is not None and value < low:
                raise XmcError(f"options.{name}={value} is out of range; it must be at least {low}")
        cls.check_settings(settings)
        return settings

    @classmethod
    def minimum(cls) -> dict:
        """The lowest allowed value of each numeric option."""
        return MINIMUM

    @classmethod
    def check_settings(cls, settings: dict) -> None:
        """Rules between options, beyond their ranges; raise XmcError in one line. Default: none."""

    @classmethod
    def backend(cls):
        """The backend's module; not installed: one line saying which extra installs it."""
        try:
            return importlib.import_module(cls.BACKEND_MODULE)
        except ImportError:
            raise XmcError(f"{cls.TITLE} needs {cls.BACKEND_MODULE}, which is not installed: "
                           f"pip install '{PACKAGE}[{cls.EXTRA}]'") from None

    @classmethod
    def check(cls, config: TrainConfig, num_labels: int) -> None:
        cls.backend()
        cls.settings_of(config)

    # -- the WholeMethod contract ----------------------------------------------------------------------
    @classmethod
    def fit(cls, train_texts: list[str], train_labels: sp.csr_matrix, num_labels: int, config: TrainConfig,
            log: Callable[[str], None]) -> "LinearMethod":
        cls.check(config, num_labels)
        settings = cls.settings_of(config)
        features, matrix = TfidfFeatures.fit(train_texts, {k: v for k, v in settings.items()
                                                           if k in TFIDF_OPTIONS})
        log(f"TF-IDF: {matrix.shape[0]} documents x {matrix.shape[1]} terms, "
            f"{matrix.nnz / max(1, matrix.shape[0]):.0f} per document")
        model = cls(features, num_labels, settings, threads_of(config))
        model.fit_backend(matrix, label_matrix(train_labels), config.seed, log)
        return model

    @classmethod
    def fit_features(cls, train_features: sp.csr_matrix, train_labels: sp.csr_matrix, num_labels: int,
                     config: TrainConfig, log: Callable[[str], None]) -> "LinearMethod":
        cls.check(config, num_labels)
        matrix = sp.csr_matrix(train_features, dtype=np.float32)
        matrix.sort_indices()
        log(f"the dataset's features: {matrix.shape[0]} documents x {matrix.shape[1]} columns, "
            f"{matrix.nnz / max(1, matrix.shape[0]):.0f} per document (no TF-IDF)")
        model = cls(None, num_labels, cls.settings_of(config), threads_of(config), num_features=matrix.shape[1])
        model.fit_backend(matrix, label_matrix(train_labels), config.seed, log)
        return model

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True)
        if self.features is not None:
            self.features.save(folder)
        inputs = "texts" if self.features is not None else "features"
        (folder / MODEL_FILE).write_text(json.dumps({"method": type(self).__name__, "num_labels": self.num_labels,
                                                     "settings": self.settings, "inputs": inputs,
                                                     "num_features": self.num_features}, indent=2) + "\n",
                                         encoding="utf-8")
        (folder / BACKEND_FOLDER).mkdir()
        self.save_backend(folder / BACKEND_FOLDER)

    @classmethod
    def load(cls, folder: Path, config: TrainConfig) -> "LinearMethod":
        folder = Path(folder)
        cls.backend()
        saved = json.loads((folder / MODEL_FILE).read_text(encoding="utf-8"))
        if saved.get("method") != cls.__name__:
            raise XmcError(f"{folder / MODEL_FILE} holds a {saved.get('method')!r} model, not {cls.__name__}: the "
                           "model folder is damaged; re-run training")
        features = TfidfFeatures.load(folder) if saved.get("inputs", "texts") == "texts" else None
        model = cls(features, int(saved["num_labels"]), saved["settings"], threads_of(config),
                    num_features=saved.get("num_features"))
        model.load_backend(folder / BACKEND_FOLDER)
        return model

    def predict(self, texts: list[str], top_k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.features is None:
            raise XmcError(f"this {self.TITLE} model was fitted on a dataset's sparse features ({self.num_features} "
                           "columns), not on texts: score it on such a dataset with `xmcbench evaluate`")
        if not texts:
            return np.full((0, top_k), -1, dtype=np.int64), np.full((0, top_k), -1.0, dtype=np.float32)
        return self.predict_backend(self.features.transform(texts), top_k)

    def predict_features(self, features: sp.csr_matrix, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.features is not None or features.shape[1] != self.num_features:
            fitted = "texts (TF-IDF)" if self.features is not None else f"{self.num_features} feature columns"
            raise XmcError(f"this {self.TITLE} model was fitted on {fitted}, and these documents have "
                           f"{features.shape[1]} feature columns: score it on the dataset it was fitted on")
        matrix = sp.csr_matrix(features, dtype=np.float32)
        matrix.sort_indices()
        return self.predict_backend(matrix, top_k)

    # -- what each backend implements ---------------------------------------------------------------
    @abstractmethod
    def fit_backend(self, features: sp.csr_matrix, labels: sp.csr_matrix, seed: int, log) -> None:
        """features (N, F) float32 CSR, labels (N, L) 0/1 float32 CSR."""

    @abstractmethod
    def save_backend(self, folder: Path) -> None:
        """Write the backend's files into `folder` (it exists and is empty), without pickle."""

    @abstractmethod
    def load_backend(self, folder: Path) -> None:
        """Read what save_backend wrote."""

    @abstractmethod
    def predict_backend(self, features: sp.csr_matrix, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """(N, F) CSR, N >= 1 -> labels (N, top_k) int64, scores (N, top_k) float32 (see top_k_arrays)."""
