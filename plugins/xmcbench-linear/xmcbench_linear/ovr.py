"""`ovr`: one linear SVM per label (one-vs-rest, as DiSMEC without its distributed training) on TF-IDF.

Each label gets scikit-learn's LinearSVC: squared hinge, L2, C = options.ovr_c, solved by liblinear's dual
coordinate descent (DiSMEC's solver; on text, with more features than documents, far faster than the primal
Newton method), its random order seeded by the run's seed for every label. Weights below
options.ovr_weight_threshold (absolute) are pruned, as DiSMEC prunes at 0.01, so the (L, F) weight matrix
stays sparse. Scores are the SVM margins w.x + b. A label without a positive training document is never
predicted; one that every training document has always gets the margin 1.

With several threads, labels are fitted in forked worker processes, not threads: liblinear's random
generator is one per process, so each label's fit, seeded on its own, is the same whatever the number of
workers (threads would share that generator in an order that varies).

Label sets above options.ovr_max_labels (5,000) are refused before anything is read: L classifiers over
the whole training set cost L passes, and plt or parabel are the methods for those.

Saved file (backend/): ovr.npz, plain numpy arrays (the weights in CSR form, the biases, which labels were
trained), written by numpy.savez and read back with allow_pickle=False. scikit-learn's estimators would
need pickle, so only their coefficients are kept.
"""

from __future__ import annotations

import multiprocessing
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.config import TrainConfig
from xmcbench.errors import XmcError
from xmcbench_linear.base import LinearMethod

WEIGHTS_FILE = "ovr.npz"
PREDICT_BLOCK = 2048   # documents scored at once: a (block, L) dense score matrix
# what a fit's workers read: set before they fork, so they share it copy-on-write instead of receiving it
_TRAINING: dict = {}


def _fit_labels(block: tuple[int, int]) -> list[tuple[np.ndarray, np.ndarray, float, bool]]:
    """Labels start..stop-1 of the data in _TRAINING -> per label (kept feature ids int32, their weights
    float32, bias, trained)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.svm import LinearSVC

    inputs, columns = _TRAINING["inputs"], _TRAINING["columns"]
    num_documents = inputs.shape[0]
    fitted = []
    with warnings.catch_warnings():   # a label that does not converge in liblinear's iterations is still usable
        warnings.simplefilter("ignore", ConvergenceWarning)
        for label in range(*block):
            positives = columns.indices[columns.indptr[label]:columns.indptr[label + 1]]
            if len(positives) == 0 or len(positives) == num_documents:
                fitted.append((np.zeros(0, np.int32), np.zeros(0, np.float32), float(len(positives) > 0),
                               len(positives) > 0))
                continue
            targets = np.zeros(num_documents)
            targets[positives] = 1.0
            svm = LinearSVC(C=_TRAINING["c"], dual=True, random_state=_TRAINING["seed"]).fit(inputs, targets)
            weights = svm.coef_.ravel()
            kept = np.flatnonzero(np.abs(weights) >= _TRAINING["threshold"]).astype(np.int32)
            fitted.append((kept, weights[kept].astype(np.float32), float(svm.intercept_[0]), True))
    return fitted


class OneVsRestSVM(LinearMethod):
    """TF-IDF + one linear SVM per label."""

    TITLE = "ovr (scikit-learn)"
    BACKEND_MODULE = "sklearn.svm"
    EXTRA = "ovr"
    packages = ("scikit-learn",)
    OPTIONS = {
        "ovr_c": 1.0,                    # C of every label's SVM
        "ovr_weight_threshold": 0.01,    # weights below this (absolute) are pruned
        "ovr_max_labels": 5000,          # larger label sets are refused
    }

    @classmethod
    def minimum(cls) -> dict:
        return {**super().minimum(), "ovr_c": 1e-9, "ovr_weight_threshold": 0.0, "ovr_max_labels": 1}

    @classmethod
    def check(cls, config: TrainConfig, num_labels: int) -> None:
        super().check(config, num_labels)
        limit = cls.settings_of(config)["ovr_max_labels"]
        if num_labels > limit:
            raise XmcError(f"ovr fits one classifier per label and stops at options.ovr_max_labels={limit:,} labels; "
                           f"this dataset has {num_labels:,}: use plt or parabel")

    def fit_backend(self, features: sp.csr_matrix, labels: sp.csr_matrix, seed: int, log) -> None:
        num_documents, num_features = features.shape
        # liblinear's type, converted once rather than once per label; workers inherit it when they fork
        _TRAINING.update(inputs=features.astype(np.float64), columns=labels.tocsc(), seed=seed,
                         c=self.settings["ovr_c"], threshold=self.settings["ovr_weight_threshold"])
        workers = min(self.threads, self.num_labels) if "fork" in multiprocessing.get_all_start_methods() else 1
        log(f"one-vs-rest: {self.num_labels} linear SVMs (C {self.settings['ovr_c']:g}), {workers} processes")
        try:
            if workers > 1:
                step = -(-self.num_labels // (4 * workers))   # a few blocks per worker: they finish together
                blocks = [(start, min(start + step, self.num_labels)) for start in range(0, self.num_labels, step)]
                with multiprocessing.get_context("fork").Pool(workers) as pool:
                    fitted = [label for block in pool.map(_fit_labels, blocks, chunksize=1) for label in block]
            else:
                fitted = _fit_labels((0, self.num_labels))
        finally:
            _TRAINING.clear()
        self.weights = sp.csr_matrix((np.concatenate([f[1] for f in fitted]), np.concatenate([f[0] for f in fitted]),
                                      np.cumsum([0] + [len(f[0]) for f in fitted])),
                                     shape=(self.num_labels, num_features), dtype=np.float32)
        self.bias = np.array([f[2] for f in fitted], dtype=np.float32)
        self.trained = np.array([f[3] for f in fitted], dtype=bool)

    def save_backend(self, folder: Path) -> None:
        weights = self.weights
        np.savez(folder / WEIGHTS_FILE, data=weights.data, indices=weights.indices, indptr=weights.indptr,
                 shape=np.array(weights.shape, dtype=np.int64), bias=self.bias, trained=self.trained)

    def load_backend(self, folder: Path) -> None:
        with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as saved:
            self.weights = sp.csr_matrix((saved["data"], saved["indices"], saved["indptr"]),
                                         shape=tuple(int(n) for n in saved["shape"]))
            self.bias, self.trained = saved["bias"], saved["trained"]

    def predict_backend(self, features: sp.csr_matrix, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.full((features.shape[0], top_k), -1, dtype=np.int64)
        scores = np.full((features.shape[0], top_k), -1.0, dtype=np.float32)
        width = min(top_k, self.num_labels)
        transposed = self.weights.T.tocsr()
        for start in range(0, features.shape[0], PREDICT_BLOCK):
            block = (features[start:start + PREDICT_BLOCK] @ transposed).toarray() + self.bias
            block[:, ~self.trained] = -np.inf
            top = np.argpartition(-block, width - 1, axis=1)[:, :width]
            values = np.take_along_axis(block, top, axis=1)
            order = np.lexsort((top, -values), axis=1)   # best first, ties: lower label id first
            top, values = np.take_along_axis(top, order, axis=1), np.take_along_axis(values, order, axis=1)
            found = np.isfinite(values)
            stop = start + len(block)
            labels[start:stop, :width] = np.where(found, top, -1)
            scores[start:stop, :width] = np.where(found, values, -1.0)
        return labels, scores
