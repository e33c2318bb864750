"""`plt`: Probabilistic Label Trees (Jasinska-Kobus et al., 2020) by napkinXC on TF-IDF features.

napkinXC's own settings are those of benchmarks/linear_references.py: its defaults (hierarchical balanced
2-means tree over the labels' feature centroids, at most 100 labels under a pre-leaf node, logistic
node classifiers by liblinear with C = 10, weights below 0.1 pruned), seeded by the run's seed.

Saved files (backend/): napkinXC writes its model as its own binary files (args.bin, tree.bin, weights.bin)
and a text tree (tree.txt) — no pickle — which are copied as they are. napkinXC reads a model from a folder
it owns, so a loaded model works on a private copy in a temporary folder, never on the run directory.

Determinism: liblinear draws from the C library's rand(), which napkinXC does not seed, so it is seeded
with the run's seed before fitting. With one thread the same seed gives the same model; with several,
the threads share that one random stream in an order that varies, and the weights differ in their last
digits from run to run.
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench_linear.base import LinearMethod, label_lists, top_k_arrays


def seed_c_library_rand(seed: int) -> None:
    """srand(seed): liblinear inside napkinXC shuffles with rand(), which nothing else seeds."""
    try:
        ctypes.CDLL(None).srand(ctypes.c_uint(seed))
    except (OSError, AttributeError):   # no C library symbols to reach: stay unseeded
        pass


class NapkinPLT(LinearMethod):
    """TF-IDF + napkinXC PLT; scores are the tree's label probabilities."""

    TITLE = "plt (napkinXC)"
    BACKEND_MODULE = "napkinxc"
    EXTRA = "plt"
    packages = ("scikit-learn", "napkinxc")
    OPTIONS = {
        "plt_arity": 2,                 # children of an inner node (k of the k-means that builds the tree)
        "plt_max_leaves": 100,          # labels under one pre-leaf node at most
        "plt_c": 10.0,                  # liblinear's C for the node classifiers
        "plt_weights_threshold": 0.1,   # node-classifier weights below this (absolute) are pruned
    }

    @classmethod
    def minimum(cls) -> dict:
        return {**super().minimum(), "plt_arity": 2, "plt_max_leaves": 1, "plt_c": 1e-9, "plt_weights_threshold": 0.0}

    def _model(self, folder: str, seed: int | None = None):
        from napkinxc.models import PLT

        return PLT(folder, arity=self.settings["plt_arity"], max_leaves=self.settings["plt_max_leaves"],
                   liblinear_c=self.settings["plt_c"], weights_threshold=self.settings["plt_weights_threshold"],
                   seed=seed, threads=self.threads)

    def _private_folder(self) -> str:
        # removed with this object: napkinXC reads (and writes) its model files there
        self._folder = tempfile.TemporaryDirectory(prefix="xmcbench-plt-")
        return self._folder.name

    def fit_backend(self, features: sp.csr_matrix, labels: sp.csr_matrix, seed: int, log) -> None:
        folder = self._private_folder()
        self.model = self._model(folder, seed)
        seed_c_library_rand(seed)
        log(f"napkinXC PLT: {labels.shape[1]} labels, arity {self.settings['plt_arity']}, {self.threads} threads")
        self.model.fit(features, label_lists(labels))

    def save_backend(self, folder: Path) -> None:
        for file in sorted(Path(self._folder.name).iterdir()):
            shutil.copyfile(file, folder / file.name)

    def load_backend(self, folder: Path) -> None:
        private = self._private_folder()
        for file in sorted(Path(folder).iterdir()):
            shutil.copyfile(file, Path(private) / file.name)
        self.model = self._model(private)

    def predict_backend(self, features: sp.csr_matrix, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        return top_k_arrays(self.model.predict_proba(features, top_k=top_k), top_k)
