"""Ensembles of saved runs, as in the paper's Table 3 (three encoders, or three label-cluster trees).

Rule (the paper's): for each document take the union of the members' top-k label ids; the ensemble score
of a label is the sum over members of that member's score for it (0 where the label is outside that
member's top-k); the ensemble's ranking is the top-k of the sums (ties: lower id first).

An ensemble directory:

    ensemble.json             {"schema", "members": [paths, relative to the ensemble directory], "top_k",
                               "label_names_sha256"}: all that `predict` and `evaluate` need
    config.json               method "ensemble(m1+m2+...)", dataset and version, member 0's config, so a
                              report reads it like a run
    metrics.json              test metrics of the ensemble (written last: its presence marks a finished build)
    timings.json              members' training seconds and prediction ms/document, summed
    predictions.safetensors   the ensemble's test-set top-k (labels (N, k) int64, scores (N, k) float32)
    environment.json          library versions, platform, date

Members must be finished runs sharing one label vocabulary (model/labels.json). Building reuses the
members' saved test predictions when they all have them for the current version of one dataset;
otherwise (and always for `evaluate`) every member model predicts the test split, one model at a time.
Propensities for PSP@k come from the dataset's whole training set, as in `xmcbench evaluate`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from xmcbench.config import check_top_k
from xmcbench.errors import XmcError
from xmcbench.metrics import evaluate
from xmcbench.modelio import load_model_dir
from xmcbench.pipeline import Predictions, pick_device, predict, set_threads
from xmcbench.registry import Registry, build_registry
from xmcbench.storage import read_json, write_json
from xmcbench.tokenization import tokenize

ENSEMBLE_FILE = "ensemble.json"
SCHEMA_VERSION = 1
MIN_TOP_K = 5   # the metrics are reported at k = 1, 3, 5


# -- the combination rule ---------------------------------------------------------------------------

def combine(labels: Sequence[np.ndarray], scores: Sequence[np.ndarray], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Members' top lists -> the ensemble's top-k.

    labels[m]: (N, k_m) int label ids of member m, best first, -1 for empty slots; scores[m]: (N, k_m).
    Each member contributes its first top_k columns. Returns labels (N, top_k) int64 (-1 padded) and
    scores (N, top_k) float32 (-1.0 padded): per document, the top_k labels of the union of the members'
    lists by the sum of their members' scores (descending, ties by ascending id)."""
    if not labels or len(labels) != len(scores):
        raise ValueError("combine needs one scores array per labels array, and at least one member")
    num_docs = np.asarray(labels[0]).shape[0]
    for member_labels, member_scores in zip(labels, scores):
        if np.shape(member_labels) != np.shape(member_scores) or np.shape(member_labels)[0] != num_docs:
            raise ValueError("every member needs labels and scores of one shape (N, k) with the same N")
    ids = np.concatenate([np.asarray(a)[:, :top_k] for a in labels], axis=1).astype(np.int64)      # (N, M*k)
    values = np.concatenate([np.asarray(a)[:, :top_k] for a in scores], axis=1).astype(np.float64)
    rows = np.broadcast_to(np.arange(num_docs)[:, None], ids.shape)
    valid = ids >= 0
    rows, ids, values = rows[valid], ids[valid], values[valid]
    # group equal (row, id): a stable sort keeps member order inside a group, so sums are reproducible
    order = np.lexsort((ids, rows))
    rows, ids, values = rows[order], ids[order], values[order]
    if len(ids):
        starts = np.flatnonzero(np.r_[True, (rows[1:] != rows[:-1]) | (ids[1:] != ids[:-1])])
        sums = np.add.reduceat(values, starts)
        rows, ids = rows[starts], ids[starts]
    else:
        sums = values
    # rank inside each row: descending sum, then ascending id
    order = np.lexsort((ids, -sums, rows))
    rows, ids, sums = rows[order], ids[order], sums[order]
    rank = np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")
    keep = rank < top_k
    out_labels = np.full((num_docs, top_k), -1, dtype=np.int64)
    out_scores = np.full((num_docs, top_k), -1.0, dtype=np.float32)
    out_labels[rows[keep], rank[keep]] = ids[keep]
    out_scores[rows[keep], rank[keep]] = sums[keep]
    return out_labels, out_scores


# -- members ----------------------------------------------------------------------------------------

@dataclass
class Member:
    path: Path            # as given (or as resolved from ensemble.json)
    config: dict          # the run's config.json
    label_names: list[str]
    labels_sha256: str

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))


def labels_digest(label_names: list[str]) -> str:
    """sha256 of the label list in canonical JSON (independent of file formatting)."""
    text = json.dumps(label_names, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_ensemble(directory: Path) -> bool:
    return (Path(directory) / ENSEMBLE_FILE).is_file()


def _read_json_file(path: Path, what: str):
    try:
        return read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise XmcError(f"{path} cannot be read as JSON ({' '.join(str(error).split())}): {what} is damaged") from None


def read_member(path: Path) -> Member:
    """A finished run directory usable as an ensemble member; anything else ends in one XmcError line."""
    path = Path(path)
    if not path.exists():
        raise XmcError(f"ensemble member {path} does not exist (give run directories written by `xmcbench run`)")
    if is_ensemble(path):
        raise XmcError(f"ensemble member {path} is itself an ensemble: give its member runs instead")
    if not (path / "config.json").is_file():
        raise XmcError(f"ensemble member {path} is not an xmcbench run directory (config.json is missing)")
    if not (path / "metrics.json").is_file():
        raise XmcError(f"ensemble member {path} is an unfinished run (metrics.json is missing): finish it with "
                       f"`xmcbench run --resume {path}` or leave it out of the ensemble")
    labels_path = path / "model" / "labels.json"
    for needed in (path / "model" / "model.json", labels_path):
        if not needed.is_file():
            raise XmcError(f"ensemble member {path} has no complete saved model ({needed} is missing); re-run training")
    config = _read_json_file(path / "config.json", "the run's configuration")
    label_names = _read_json_file(labels_path, "the label list")
    if not isinstance(config, dict) or not isinstance(label_names, list) \
            or not all(isinstance(name, str) for name in label_names):
        raise XmcError(f"ensemble member {path}: config.json or model/labels.json is damaged; re-run training")
    return Member(path, config, label_names, labels_digest(label_names))


def _check_vocabulary(members: list[Member], expected_sha256: str | None = None) -> None:
    first = members[0]
    for member in members:
        if expected_sha256 is not None and member.labels_sha256 != expected_sha256:
            raise XmcError(f"ensemble member {member.path} has another label vocabulary than when the ensemble was "
                           "built (model/labels.json changed); rebuild the ensemble with `xmcbench ensemble`")
        if member.labels_sha256 != first.labels_sha256:
            differ = sorted(set(member.label_names) ^ set(first.label_names))
            detail = f"e.g. {differ[0]!r} is in one and not the other" if differ else "the same labels in another order"
            raise XmcError(f"ensemble member {member.path} has another label vocabulary than {first.path} "
                           f"({len(member.label_names)} vs {len(first.label_names)} labels, {detail}): members "
                           "must be trained on the same labels")


# -- ensemble.json ----------------------------------------------------------------------------------

@dataclass
class Ensemble:
    directory: Path
    members: list[Member]
    member_refs: list[str]   # as written in ensemble.json
    top_k: int
    label_names_sha256: str


def read_ensemble(directory: Path) -> Ensemble:
    """The ensemble in `directory`, with every member re-checked (finished, same vocabulary as built)."""
    directory = Path(directory)
    path = directory / ENSEMBLE_FILE
    spec = _read_json_file(path, "the ensemble description")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), int):
        raise XmcError(f"{path} is not an ensemble description (no schema number); rebuild it with `xmcbench ensemble`")
    if spec["schema"] > SCHEMA_VERSION:
        raise XmcError(f"{path} has ensemble schema {spec['schema']} but this xmcbench reads {SCHEMA_VERSION} at "
                       "most; upgrade xmcbench")
    refs, top_k, sha = spec.get("members"), spec.get("top_k"), spec.get("label_names_sha256")
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs) \
            or not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1 or not isinstance(sha, str):
        raise XmcError(f"{path} lacks valid \"members\", \"top_k\" or \"label_names_sha256\": the ensemble "
                       "description is damaged; rebuild it with `xmcbench ensemble`")
    base = directory.resolve()
    members = [read_member(Path(ref) if Path(ref).is_absolute() else Path(os.path.normpath(base / ref)))
               for ref in refs]
    _check_vocabulary(members, sha)
    return Ensemble(directory, members, refs, top_k, sha)


# -- scoring and predicting -------------------------------------------------------------------------

def _score(labels: np.ndarray, dataset, model_label_names: list[str]) -> dict:
    """Metrics of test-set top lists (ids in the model vocabulary), as `xmcbench evaluate` computes them."""
    from xmcbench.runner import truth_in_vocabulary

    truth, inv_propensity = truth_in_vocabulary(dataset, model_label_names)
    return evaluate(labels, truth, inv_propensity=inv_propensity)


def _predict_member(member: Member, texts: list[str], texts_key: str | None, top_k: int, registry: Registry,
                    expected_sha256: str, description: str = "predicting") -> Predictions:
    model, config, label_names = load_model_dir(member.path, registry)
    if labels_digest(label_names) != expected_sha256:
        raise XmcError(f"ensemble member {member.path} has another label vocabulary than the ensemble; rebuild "
                       "the ensemble with `xmcbench ensemble`")
    config.top_k = top_k
    set_threads(config)
    device = pick_device(config)
    tokens = tokenize(texts, model.encoder.tokenizer, config.max_length, texts_key,
                      description=f"tokenizing ({member.path.name})")
    return predict(model, tokens, config, device, description=f"{description} ({member.path.name})")


def _predict_test(members: list[Member], dataset, top_k: int, registry: Registry, sha: str) -> tuple[np.ndarray, np.ndarray]:
    """Every member predicts the dataset's test split (one model in memory at a time); combined top-k."""
    found = [_predict_member(m, dataset.test_texts, f"{dataset.version}/test", top_k, registry, sha,
                             description="predicting test") for m in members]
    return combine([p.labels for p in found], [p.scores for p in found], top_k)


def _saved_predictions(members: list[Member], dataset, top_k: int):
    """The members' saved test predictions, or None when any is missing, stale or too short for top_k."""
    from safetensors.numpy import load_file

    labels, scores = [], []
    for member in members:
        path = member.path / "predictions.safetensors"
        if not path.is_file() or member.config.get("dataset_version") != dataset.version:
            return None
        try:
            saved = load_file(str(path))
        except Exception:  # a damaged file: predicting again is the safe fallback
            return None
        if "labels" not in saved or "scores" not in saved or saved["labels"].shape != saved["scores"].shape \
                or saved["labels"].ndim != 2 or saved["labels"].shape[0] != len(dataset.test_texts) \
                or saved["labels"].shape[1] < top_k:
            return None
        labels.append(saved["labels"])
        scores.append(saved["scores"])
    return labels, scores


# -- the commands -----------------------------------------------------------------------------------

def _check_output(output: Path, members: list[Member], overwrite: bool) -> None:
    """Refuse to write over anything but an earlier ensemble (and that only with overwrite)."""
    resolved = output.resolve()
    for member in members:
        where = member.path.resolve()
        if where == resolved or resolved in where.parents:
            raise XmcError(f"--output {output} holds ensemble member {member.path}; choose another --output")
    if not output.exists() or not any(output.iterdir()):
        return
    if not is_ensemble(output):
        raise XmcError(f"{output} is not empty and holds no xmcbench ensemble; choose another --output")
    if not overwrite:
        raise XmcError(f"{output} already holds an ensemble; choose another --output or pass --overwrite")


def default_output(dataset: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"ensemble-{Path(dataset).name}-{stamp}"


def build_ensemble(run_dirs: Sequence[Path], output: Path | None = None, top_k: int | None = None,
                   data_dir: Path | None = None, overwrite: bool = False, registry: Registry | None = None,
                   log=print) -> Path:
    """Write an ensemble directory of finished runs and score it on the test split; return the directory."""
    from xmcbench.runner import environment, open_dataset, save_predictions

    if len(run_dirs) < 2:
        raise XmcError(f"an ensemble needs at least two runs, got {len(run_dirs)}")
    members = [read_member(Path(p)) for p in run_dirs]
    seen = {}
    for member in members:
        key = member.path.resolve()
        if key in seen:
            raise XmcError(f"run {member.path} is given twice (also as {seen[key]}); give each member once")
        seen[key] = member.path
    _check_vocabulary(members)
    saved_k = [int(m.config.get("config", {}).get("top_k", 0) or 0) for m in members]
    top_k = top_k if top_k is not None else min(saved_k)
    if top_k < MIN_TOP_K:
        raise XmcError(f"--top-k {top_k} is too small: the metrics need each member's top {MIN_TOP_K} at least")
    first = members[0]
    dataset_ref = first.config.get("dataset")
    if not isinstance(dataset_ref, str):
        raise XmcError(f"ensemble member {first.path}: config.json does not say which dataset it was trained on")
    output = Path(output) if output else default_output(dataset_ref)
    _check_output(output, members, overwrite)

    registry = registry or build_registry()
    dataset = open_dataset(registry, dataset_ref, data_dir)
    sha = first.labels_sha256
    same_data = all(m.config.get("dataset") == dataset_ref for m in members)
    saved = _saved_predictions(members, dataset, top_k) if same_data else None
    started = time.perf_counter()
    if saved is not None:
        labels, scores = combine(saved[0], saved[1], top_k)
        source = "saved predictions"
    else:
        log("the members' saved test predictions cannot be reused (missing, another dataset or version, or fewer "
            f"than {top_k} labels): predicting the test split with every member")
        labels, scores = _predict_test(members, dataset, top_k, registry, sha)
        source = "predicted"
    combine_seconds = time.perf_counter() - started
    metrics = _score(labels, dataset, first.label_names)

    if output.exists() and is_ensemble(output):   # overwrite was checked above
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    base = output.resolve()
    refs = [os.path.relpath(m.path.resolve(), base) for m in members]
    write_json(output / ENSEMBLE_FILE, {"schema": SCHEMA_VERSION, "members": refs, "top_k": top_k,
                                        "label_names_sha256": sha})
    write_json(output / "config.json", {
        "method": "ensemble(" + "+".join(m.method for m in members) + ")",
        "dataset": dataset_ref, "dataset_name": dataset.name, "dataset_version": dataset.version,
        "members": refs, "config": first.config.get("config", {}),
        "resolved": {**first.config.get("resolved", {}), "num_labels": len(first.label_names),
                     "ensemble_members": len(members), "top_k": top_k,
                     "member_methods": [m.method for m in members],
                     "member_seeds": [m.config.get("config", {}).get("seed") for m in members]}})
    timings = [_read_json_file(m.path / "timings.json", "the run's timings") if (m.path / "timings.json").is_file()
               else {} for m in members]

    def total(key: str):
        values = [t.get(key) for t in timings]
        return float(sum(values)) if all(isinstance(v, (int, float)) for v in values) else None

    write_json(output / "timings.json", {
        "train_seconds": total("train_seconds"), "train_ms_per_document": total("train_ms_per_document"),
        "predict_seconds": total("predict_seconds"), "predict_ms_per_document": total("predict_ms_per_document"),
        "combine_ms_per_document": 1000 * combine_seconds / max(1, len(dataset.test_texts)),
        "metrics_from": source})
    write_json(output / "environment.json", environment())
    save_predictions(output / "predictions.safetensors", Predictions(labels, scores, None))
    write_json(output / "metrics.json", {"dataset": dataset.name, "test_documents": len(dataset.test_texts),
                                         "unseen_test_labels": len(dataset.label_names) - dataset.num_labels,
                                         "members": len(members), "top_k": top_k, "metrics_from": source,
                                         **metrics})
    return output


def evaluate_ensemble(directory: Path, dataset_name: str | None = None, data_dir: Path | None = None,
                      registry: Registry | None = None) -> dict:
    """Score an ensemble on a dataset's test split (its own by default), predicting with every member."""
    from xmcbench.runner import open_dataset

    ensemble = read_ensemble(directory)
    registry = registry or build_registry()
    if dataset_name is None:
        config_path = Path(directory) / "config.json"
        recorded = _read_json_file(config_path, "the ensemble's configuration") if config_path.is_file() else None
        dataset_name = recorded.get("dataset") if isinstance(recorded, dict) else None
        if not isinstance(dataset_name, str):
            dataset_name = ensemble.members[0].config.get("dataset")
        if not isinstance(dataset_name, str):
            raise XmcError(f"{directory} does not say which dataset it was built on; pass --dataset")
    dataset = open_dataset(registry, dataset_name, data_dir)
    labels, _ = _predict_test(ensemble.members, dataset, ensemble.top_k, registry, ensemble.label_names_sha256)
    return _score(labels, dataset, ensemble.members[0].label_names)


def predict_texts(directory: Path, texts: list[str], top_k: int = 5, registry: Registry | None = None) -> list[dict]:
    """Top-k labels with ensemble scores for raw texts. Members contribute their top max(top_k, K) labels,
    K from ensemble.json, so for top_k <= K the result is the start of the ranking `evaluate` scores."""
    check_top_k(top_k)
    ensemble = read_ensemble(directory)
    registry = registry or build_registry()
    width = max(top_k, ensemble.top_k)
    found = [_predict_member(m, texts, None, width, registry, ensemble.label_names_sha256)
             for m in ensemble.members]
    labels, scores = combine([p.labels for p in found], [p.scores for p in found], width)
    names = ensemble.members[0].label_names
    return [{"labels": [names[i] for i in row[:top_k] if i >= 0],
             "scores": [round(float(s), 6) for i, s in zip(row[:top_k], values[:top_k]) if i >= 0]}
            for row, values in zip(labels, scores)]
