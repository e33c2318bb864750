"""Scoring: the one propensity model, label remapping, filtered pairs, and the metrics of any prediction,
xmcbench's own or a score matrix another system wrote, computed the one way (xmcbench.metrics.evaluate)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

from xmcbench.config import MAX_TOP_K, TrainConfig, apply_overrides, parse_set_options
from xmcbench.data import Dataset, read_texts
from xmcbench.errors import XmcError, joined_line
from xmcbench.formats import FormatOptions, open_dataset
from xmcbench.inference import Predictions, recalled_truth
from xmcbench.metrics import evaluate, propensity_scores
from xmcbench.registry import Registry, build_registry
from xmcbench.rundir import FINISHED_MARKER, labels_file_of
from xmcbench.storage import write_json

if TYPE_CHECKING:
    from xmcbench.model import XMCModel


def label_document_counts(labels: sp.spmatrix) -> np.ndarray:
    """(L,) int64 documents per label column of (N, L) training labels: the one source of training label
    frequencies, for the propensities (PSP@k) and the frequency bins of the metrics alike."""
    return np.asarray((labels > 0).sum(axis=0)).ravel().astype(np.int64)


@dataclass(frozen=True)
class Propensities:
    """The propensity model behind every PSP@k, PSnDCG@k and PSR@k xmcbench writes (see propensities()).

    inverse: (L,) 1 / p_l; label_counts: (L,) training documents per label, which the frequency bins use
    too; a, b: Jain et al.'s A and B; train_documents: N of the model."""

    inverse: np.ndarray
    label_counts: np.ndarray
    a: float
    b: float
    train_documents: int

    def record(self) -> dict:
        """What metrics.json records as "propensity"."""
        return {"model": "Jain et al. 2016: p = 1 / (1 + (log N - 1) (B + 1)^A (N_l + B)^-A)", "a": self.a,
                "b": self.b, "train_documents": self.train_documents,
                "counts_from": "all training documents of the dataset (validation rows included)"}


def propensities(dataset: Dataset, config: TrainConfig | None = None,
                 label_names: list[str] | None = None) -> Propensities:
    """The one propensity definition of runs, whole-method runs, validation, `evaluate` and ensembles: label
    frequencies N_l and N from every training document of the dataset (a run's validation rows and the rows
    max_train_docs leaves out included), so one dataset gives one set of weights whatever a run trained on.
    A and B are the dataset's (DatasetSpec.propensity_a/b), unless config sets propensity_a / propensity_b
    (> 0). label_names: the label order of the result, e.g. a saved model's vocabulary (labels the dataset
    lacks count 0); None: the dataset's own order. Shapes (L,), L = len(label_names) plus the dataset's labels
    not among them (remap_labels), or len(dataset.label_names)."""
    a = config.propensity_a if config is not None and config.propensity_a > 0 else dataset.propensity_a
    b = config.propensity_b if config is not None and config.propensity_b > 0 else dataset.propensity_b
    labels = dataset.train_labels
    if label_names is not None:
        labels = remap_labels(labels, dataset.label_names, label_names)
    counts = label_document_counts(labels)
    num_docs = dataset.train_labels.shape[0]
    return Propensities(1.0 / propensity_scores(counts, num_docs, a, b), counts, float(a), float(b), int(num_docs))


def score(predictions: Predictions, truth: sp.csr_matrix, model: XMCModel | None, weights: Propensities,
          ks=(1, 3, 5), frequency_bins: bool = True, filtered: sp.csr_matrix | None = None,
          zero_shot: np.ndarray | None = None, families: tuple | None = None) -> dict:
    """Metrics of a prediction at the cut-offs ks (xmcbench.metrics.evaluate), with the frequency bins and
    the propensity model recorded under "propensity"; truth (N, L) in the label order of `weights`.
    filtered: (N, L) pairs removed from the predictions first (without_filtered_pairs), recorded under
    "filtered_pairs"; None when the dataset has no filter. zero_shot: (L,) bool, the labels no training document
    of the model carried (zero_shot_mask): adds the "zero_shot" figures. families: the metric families computed
    (a registry's metric_families(); None: xmcbench's own)."""
    recalled = None
    if predictions.recalled is not None:
        recalled = recalled_truth(truth, predictions.recalled, model.label_cluster.cpu().numpy())
    labels, removal = without_filtered_pairs(predictions.labels, filtered)
    metrics = evaluate(labels, truth, ks=ks, inv_propensity=weights.inverse, recalled_truth=recalled,
                       label_counts=weights.label_counts if frequency_bins else None, zero_shot=zero_shot,
                       families=families)
    return {**metrics, **removal, "propensity": weights.record()}


def zero_shot_mask(model_counts: np.ndarray | None, num_model_labels: int, total_labels: int) -> np.ndarray:
    """(total_labels,) bool, True for the labels no training document of a model carried: those of its vocabulary
    with a count of 0 (LabelInfo.counts: the run's training rows), and every label beyond its vocabulary (the
    dataset's test-only labels, in remap_labels' order). model_counts None (a model saved before label
    information was kept): only the labels beyond its vocabulary."""
    mask = np.ones(total_labels, dtype=bool)
    mask[:num_model_labels] = False if model_counts is None else np.asarray(model_counts)[:num_model_labels] == 0
    return mask


def without_filtered_pairs(labels: np.ndarray, filtered: sp.csr_matrix | None) -> tuple[np.ndarray, dict]:
    """The one removal of filtered (document, label) pairs before scoring, as the Extreme Classification
    Repository's evaluation removes those of filter_labels_*.txt (Dataset.test_filter / train_filter).

    labels: (N, k) predicted label ids, best first, -1 for an empty slot; filtered: (N, L) 0/1 csr in the same
    label ids, or None. Returns the (N, k) labels with each listed pair taken out of its row, the labels after
    it moved up and -1 filling the end, and {"filtered_pairs": {"listed": pairs in the filter, "removed": pairs
    taken out of these predictions}} for metrics.json ({} without a filter)."""
    if filtered is None:
        return labels, {}
    labels = np.asarray(labels)
    filtered = sp.csr_matrix(filtered)
    width = np.int64(filtered.shape[1])
    listed = filtered.tocoo()
    listed_keys = np.unique(listed.row.astype(np.int64) * width + listed.col)
    rows = np.broadcast_to(np.arange(labels.shape[0], dtype=np.int64)[:, None], labels.shape)
    valid = (labels >= 0) & (labels < width)
    drop = np.zeros(labels.shape, dtype=bool)
    drop[valid] = np.isin(rows[valid] * width + labels[valid], listed_keys)
    order = np.argsort(drop, axis=1, kind="stable")   # kept labels first, in their order
    kept = np.take_along_axis(labels, order, axis=1)
    kept[np.take_along_axis(drop, order, axis=1)] = -1
    return kept, {"filtered_pairs": {"listed": int(listed_keys.size), "removed": int(drop.sum())}}


def filtered_pairs(dataset: Dataset, split: str = "test", label_names: list[str] | None = None,
                   rows: np.ndarray | None = None) -> sp.csr_matrix | None:
    """The dataset's filtered pairs of a split ("test" or "train", at `rows`), in the label order of
    `label_names` (remap_labels; None: the dataset's own), for score(filtered=...); None without a filter."""
    pairs = dataset.test_filter if split == "test" else dataset.train_filter
    if pairs is None:
        return None
    if rows is not None:
        pairs = pairs[rows]
    return pairs if label_names is None else remap_labels(pairs, dataset.label_names, label_names)


def room_for_filtered_pairs(config: TrainConfig, dataset: Dataset, log=print) -> None:
    """Raise config.top_k so that a document keeps max(eval_ks) predictions after its filtered pairs are removed
    (without_filtered_pairs): a filtered label in the top k would otherwise leave a slot empty at the deepest
    cut-off, a miss the repository's evaluation, which ranks 100 or more labels, never counts. Nothing changes
    for a dataset without filters."""
    most = max((int(np.diff(sp.csr_matrix(pairs).indptr).max(initial=0))
                for pairs in (dataset.test_filter, dataset.train_filter) if pairs is not None), default=0)
    needed = min(MAX_TOP_K, max(config.eval_ks) + most)
    if most and config.top_k < needed:
        log(f"top_k {config.top_k} -> {needed}: a document has up to {most} filtered (document, label) pairs, removed "
            f"from its predictions before scoring")
        config.top_k = needed


def remap_labels(labels: sp.csr_matrix, names: list[str], model_names: list[str]) -> sp.csr_matrix:
    """Re-index label columns to the model's vocabulary; labels the model does not know go after it."""
    index = {name: i for i, name in enumerate(model_names)}
    unknown = [n for n in names if n not in index]
    index.update({name: len(model_names) + i for i, name in enumerate(unknown)})
    mapping = np.array([index[n] for n in names], dtype=np.int64)
    labels = labels.tocoo()
    return sp.csr_matrix((labels.data, (labels.row, mapping[labels.col])),
                         shape=(labels.shape[0], len(model_names) + len(unknown)))


# Settings that change how predictions are scored, not what a model predicts: `evaluate --set` takes these.
EVALUATION_SETTINGS = ("eval_ks", "propensity_a", "propensity_b")


def evaluation_config(config: TrainConfig, set_options: list[str] = ()) -> TrainConfig:
    """config with `--set` evaluation settings (EVALUATION_SETTINGS) applied, top_k raised to max(eval_ks)."""
    overrides = parse_set_options(list(set_options))
    others = [key for key in overrides if key not in EVALUATION_SETTINGS]
    if others:
        raise XmcError(f"--set {others[0]}: evaluate takes only the scoring settings {', '.join(EVALUATION_SETTINGS)}; "
                       "the model's other settings are fixed")
    config = apply_overrides(config, overrides, "--set")
    config.top_k = max(config.top_k, max(config.eval_ks))
    config.validate("--set")
    return config


def ranked_labels(matrix: sp.csr_matrix, k: int) -> Predictions:
    """A (N, L) sparse score matrix -> its top k per row as Predictions: labels (N, k) int64 by descending
    score (ties: lower id first), scores (N, k) float32; rows with fewer stored entries end in -1 slots.
    Every stored entry is a prediction, whatever its score (0 and negative scores included)."""
    matrix = sp.csr_matrix(matrix)
    matrix.sum_duplicates()
    num_docs = matrix.shape[0]
    rows = np.repeat(np.arange(num_docs, dtype=np.int64), np.diff(matrix.indptr))
    order = np.lexsort((matrix.indices, -matrix.data, rows))
    rank = np.arange(rows.size) - matrix.indptr[rows]     # rows stay grouped in order: the row is the first key
    keep = rank < k
    labels = np.full((num_docs, k), -1, dtype=np.int64)
    scores = np.full((num_docs, k), -np.inf, dtype=np.float32)
    labels[rows[keep], rank[keep]] = matrix.indices[order][keep]
    scores[rows[keep], rank[keep]] = matrix.data[order][keep]
    return Predictions(labels, scores, None)


def _read_score_matrix(path: Path) -> sp.csr_matrix:
    path = Path(path)
    if not path.is_file():
        raise XmcError(f"{path} does not exist; pass a scipy sparse matrix saved with scipy.sparse.save_npz")
    try:
        matrix = sp.load_npz(path)
    except Exception as error:   # numpy and zipfile raise several types for a file that is not one
        raise XmcError(f"{path} is not a sparse matrix saved with scipy.sparse.save_npz ({type(error).__name__}: "
                       f"{joined_line(error)})") from None
    try:   # load_npz does not check the structure: an indptr that disagrees with the indices would fail later
        matrix = sp.csr_matrix(matrix, dtype=np.float64)
        matrix.check_format(full_check=True)
    except (ValueError, RuntimeError, IndexError, TypeError) as error:
        raise XmcError(f"{path} is not a consistent sparse matrix ({joined_line(error)}); save it again with "
                       "scipy.sparse.save_npz") from None
    if not np.all(np.isfinite(matrix.data)):
        raise XmcError(f"{path} holds scores that are not finite numbers (NaN or infinite); fix the system's output")
    return matrix


def _column_names(path: Path, labels_file: Path | None, num_columns: int, dataset: Dataset) -> list[str]:
    """The label name of each column of a score matrix: from labels_file (a JSON list, or one name per line),
    else from the file xmcbench writes beside its own (labels_file_of), else the dataset's label ids."""
    labels_file = labels_file or (labels_file_of(path) if labels_file_of(path).is_file() else None)
    if labels_file is None:
        if num_columns not in (dataset.num_labels, len(dataset.label_names)):
            raise XmcError(f"{path} has {num_columns} columns but {dataset.name} has {dataset.num_labels} training "
                           f"labels ({len(dataset.label_names)} with the test-only ones); give the name of each "
                           "column with --labels FILE")
        return list(dataset.label_names[:num_columns])
    try:
        names = json.loads(Path(labels_file).read_text(encoding="utf-8")) if str(labels_file).endswith(".json") \
            else read_texts(labels_file)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise XmcError(f"cannot read the label names in {labels_file}: {error}") from None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise XmcError(f"{labels_file} must be a JSON list of label names, or one name per line")
    if len(names) != num_columns:
        raise XmcError(f"{labels_file} names {len(names)} labels but {path} has {num_columns} columns; one name "
                       "per column, in column order")
    if len(set(names)) != len(names):
        raise XmcError(f"{labels_file} names a label twice; one name per column")
    if names and not set(names) & set(dataset.label_names):
        raise XmcError(f"none of the {len(names)} label names in {labels_file} (e.g. {names[0]!r}) is a label of "
                       f"{dataset.name} (e.g. {dataset.label_names[0]!r}): every prediction would miss; give the "
                       "file that names the matrix's columns with the dataset's label names")
    return names


def evaluate_predictions(path: Path, dataset_name: str, data_dir: Path | None = None,
                         registry: Registry | None = None, options: FormatOptions | None = None,
                         set_options: list[str] = (), labels_file: Path | None = None) \
        -> tuple[dict, Dataset, TrainConfig]:
    """Score a score matrix that any system wrote (xmcbench's predictions.npz, PECOS, pyxclib, ...) on a
    dataset's test split, exactly as xmcbench scores its own runs.

    path: a scipy CSR (N_test, L) saved with scipy.sparse.save_npz, row i scoring test document i, every
    stored entry a predicted label; columns are the dataset's label ids (its sorted training labels, then
    the test-only ones), or named by labels_file (or by the labels file beside it, labels_file_of).
    set_options: scoring settings (EVALUATION_SETTINGS), over TrainConfig's defaults.
    Returns (metrics, the dataset, the config they were scored with)."""
    config = evaluation_config(TrainConfig(), set_options)
    registry = registry or build_registry()
    matrix = _read_score_matrix(path)
    dataset = open_dataset(registry, dataset_name, data_dir, options)
    num_test = dataset.test_labels.shape[0]
    if matrix.shape[0] != num_test:
        raise XmcError(f"{path} has {matrix.shape[0]} rows but the test split of {dataset.name} has {num_test} "
                       "documents; row i must score test document i")
    names = _column_names(path, labels_file, matrix.shape[1], dataset)
    truth = remap_labels(dataset.test_labels, dataset.label_names, names)
    predictions = ranked_labels(matrix, max(config.eval_ks))
    weights = propensities(dataset, config, names)
    # another system's training set is unknown: its zero-shot labels are those no training document of the dataset has
    return score(predictions, truth, None, weights, config.eval_ks, filtered=filtered_pairs(dataset, "test", names),
                 zero_shot=weights.label_counts == 0, families=registry.metric_families()), dataset, config


def write_external_run(output: Path, name: str, predictions_path: Path, dataset_ref: str, dataset: Dataset,
                       config: TrainConfig, metrics: dict) -> Path:
    """A run-like directory for predictions made outside xmcbench, which `xmcbench report` reads beside
    runs: config.json (method "external:NAME", the dataset, the scoring settings) and metrics.json."""
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise XmcError(f"{output} is not an empty folder; choose another --output")
    settings = {key: getattr(config, key) for key in ("seed", *EVALUATION_SETTINGS)}
    if Path(dataset_ref).exists():   # a folder: its full path, as a run's config.json records it
        dataset_ref = str(Path(dataset_ref).resolve())
    write_json(output / "config.json", {
        "method": f"external:{name}", "dataset": dataset_ref, "dataset_name": dataset.name,
        "dataset_version": dataset.version, "config": settings,
        "resolved": {"predictions": str(Path(predictions_path).resolve())}})
    write_json(output / FINISHED_MARKER, {"dataset": dataset.name, "test_documents": dataset.test_labels.shape[0],
                                          "unseen_test_labels": len(dataset.label_names) - dataset.num_labels,
                                          **metrics})
    return output
