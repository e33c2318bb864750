"""`parabel` and `bonsai`: partitioned label trees by omikuji on TF-IDF features.

One class, two settings, as omikuji's README documents them:

- Parabel (Prabhu et al., 2018): omikuji's defaults — 3 trees of balanced 2-means clusters, at most 20
  levels, no split below 100 labels, squared-hinge linear classifiers with C = 1, weights below 0.1 pruned;
- Bonsai (Khandagale et al., 2019): the same with regular (unbalanced) k-means of k = 100 and depth 3:
  shallow, wide trees.

Saved files (backend/): omikuji's own `Model.save` folder — settings.json and one CBOR file per tree, no
pickle — copied as they are. Right after training, the model is saved to a private folder and loaded back
from it, so the fitted model and every later load predict from the same files with the same scores.

omikuji's Rust code prints its log to the process's stdout and progress bars to stderr; both go to a
temporary file while it works, so that nothing but xmcbench's own output reaches the terminal (`xmcbench
predict` writes JSON lines to stdout). Its k-means draws from a random generator it seeds itself, with no
seed to set: the same seed does not give the same trees (`deterministic = False`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.errors import XmcError
from xmcbench_linear.base import LinearMethod, top_k_arrays

PARABEL = {"omikuji_cluster_k": 2, "omikuji_balanced": True, "omikuji_max_depth": 20}
BONSAI = {"omikuji_cluster_k": 100, "omikuji_balanced": False, "omikuji_max_depth": 3}


@contextlib.contextmanager
def quiet_native_output():
    """Send what native code writes to file descriptors 1 and 2 into a temporary file while the block runs.
    Yields a function returning that output's last line (for an error message)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as captured:
        saved = os.dup(1), os.dup(2)
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)

        def last_line() -> str:
            captured.seek(0)
            lines = [line.strip() for line in captured.read().decode("utf-8", "replace").splitlines() if line.strip()]
            return lines[-1] if lines else ""

        try:
            yield last_line
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def write_training_file(path: Path, features: sp.csr_matrix, labels: sp.csr_matrix) -> None:
    """The Extreme Classification Repository format omikuji reads: a header "N F L", then per document its
    comma-separated labels, a space, and feature:value pairs. omikuji's reader refuses a line that ends in
    that space, so a document without features is its labels alone (and one without either, empty)."""
    with open(path, "w", encoding="ascii") as file:
        file.write(f"{features.shape[0]} {features.shape[1]} {labels.shape[1]}\n")
        for row in range(features.shape[0]):
            ids = labels.indices[labels.indptr[row]:labels.indptr[row + 1]]
            start, stop = features.indptr[row], features.indptr[row + 1]
            pairs = " ".join(f"{column}:{value:.7g}" for column, value in zip(features.indices[start:stop],
                                                                              features.data[start:stop]))
            file.write(",".join(map(str, ids)) + (" " + pairs if pairs else "") + "\n")


class OmikujiTrees(LinearMethod):
    """TF-IDF + omikuji's partitioned label trees; scores are the trees' averaged label probabilities."""

    TITLE = "parabel/bonsai (omikuji)"
    BACKEND_MODULE = "omikuji"
    EXTRA = "omikuji"
    packages = ("scikit-learn", "omikuji")
    deterministic = False
    OPTIONS = {
        "omikuji_trees": 3,               # trees in the forest
        **PARABEL,                        # cluster_k: children per split; balanced k-means or not; max tree depth
        "omikuji_min_branch_size": 100,   # a node with fewer labels is not split
        "omikuji_c": 1.0,                 # C of the linear classifiers
        "omikuji_weight_threshold": 0.1,  # classifier weights below this (absolute) are pruned
        "omikuji_beam_size": 10,          # beam of the tree search when predicting
        "omikuji_max_sparse_density": 0.1,  # weight vectors denser than this are made dense in memory (faster)
    }

    @classmethod
    def minimum(cls) -> dict:
        return {**super().minimum(), "omikuji_trees": 1, "omikuji_cluster_k": 2, "omikuji_max_depth": 1,
                "omikuji_min_branch_size": 2, "omikuji_c": 1e-9, "omikuji_weight_threshold": 0.0,
                "omikuji_beam_size": 1, "omikuji_max_sparse_density": 0.0}

    @classmethod
    def check_settings(cls, settings: dict) -> None:
        # omikuji aborts the whole process (a Rust panic) when a node has fewer labels than clusters
        if settings["omikuji_cluster_k"] > settings["omikuji_min_branch_size"]:
            raise XmcError(f"options.omikuji_cluster_k={settings['omikuji_cluster_k']} exceeds "
                           f"options.omikuji_min_branch_size={settings['omikuji_min_branch_size']}: a node must hold "
                           "at least as many labels as it has clusters; raise the branch size or lower k")

    def fit_backend(self, features: sp.csr_matrix, labels: sp.csr_matrix, seed: int, log) -> None:
        import omikuji

        settings = self.settings
        parameters = omikuji.Model.default_hyper_param()
        parameters.n_trees = settings["omikuji_trees"]
        parameters.cluster_k = settings["omikuji_cluster_k"]
        parameters.cluster_balanced = settings["omikuji_balanced"]
        parameters.max_depth = settings["omikuji_max_depth"]
        parameters.min_branch_size = settings["omikuji_min_branch_size"]
        parameters.linear_c = settings["omikuji_c"]
        parameters.linear_weight_threshold = settings["omikuji_weight_threshold"]
        log(f"omikuji: {parameters.n_trees} trees, {'balanced' if parameters.cluster_balanced else 'unbalanced'} "
            f"{parameters.cluster_k}-means, depth at most {parameters.max_depth}, {self.threads} threads")
        with tempfile.TemporaryDirectory(prefix="xmcbench-omikuji-") as folder:
            data = Path(folder) / "train.txt"
            write_training_file(data, features, labels)
            with quiet_native_output() as last_line:
                try:
                    trained = omikuji.Model.train_on_data(str(data), parameters, n_threads=self.threads)
                except RuntimeError as error:
                    raise XmcError(f"omikuji could not train: {error} ({last_line()})") from None
                # the model predicts from its saved files, as every later load does: a freshly trained model
                # adds its weights up in another order, which changes scores in their last bit
                trained.save(str(self._private_folder()))
        self._load_private()

    def _private_folder(self) -> Path:
        # removed with this object: the model's files, which save_backend copies
        self._folder = tempfile.TemporaryDirectory(prefix="xmcbench-omikuji-")
        return Path(self._folder.name) / "model"

    def _load_private(self) -> None:
        import omikuji

        folder = Path(self._folder.name) / "model"
        with quiet_native_output() as last_line:
            try:
                self.model = omikuji.Model.load(str(folder))
            except RuntimeError as error:
                raise XmcError(f"omikuji cannot read its model files: {error} ({last_line()}); re-run training") \
                    from None
            self.model.init_prediction_thread_pool(self.threads)
            # as omikuji's own `test` command does (its default density 0.1): predicting from sparse weights
            # is several times slower; the saved files stay sparse
            self.model.densify_weights(self.settings["omikuji_max_sparse_density"])

    def save_backend(self, folder: Path) -> None:
        for file in sorted((Path(self._folder.name) / "model").iterdir()):
            shutil.copyfile(file, folder / file.name)

    def load_backend(self, folder: Path) -> None:
        shutil.copytree(folder, self._private_folder())
        self._load_private()

    def predict_backend(self, features: sp.csr_matrix, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        beam = self.settings["omikuji_beam_size"]
        rows = []
        with quiet_native_output():
            for row in range(features.shape[0]):
                start, stop = features.indptr[row], features.indptr[row + 1]
                pairs = list(zip(features.indices[start:stop].tolist(), features.data[start:stop].tolist()))
                rows.append(self.model.predict(pairs, beam_size=beam, top_k=top_k))
        return top_k_arrays(rows, top_k)
