"""Claiming a run folder, so that a run never destroys what it did not write, and never writes outside it.

Every run folder holds RUN_MARKER, a file only xmcbench writes, locked (flock) by the process writing the
run for as long as it runs: a second process given the same folder is refused instead of writing over it,
and `--overwrite` deletes only folders that carry the marker. A run that replaces an earlier one is
written to a hidden sibling folder and swapped in when it has finished, so a run that fails, is
interrupted or is refused leaves the earlier run as it was. Ensembles and `xmcbench convert` write their
folders the same way (written_beside).

What a run writes stays inside its folder (run_path): no part of a path inside it may be a symbolic link,
`..` or absolute, so a run folder received from someone else (a tensorboard/ that links elsewhere, a
checkpoints/latest.json naming another folder) cannot steer a write, or a read, outside it. Resuming a run
checks its whole folder once (check_no_links); loggers and other writers ask run_path for their paths.

The files of a finished run: config.json (write_run_config), environment.json, the model folder, the
predictions (test, and validation when there is a split; the test top-k also as predictions.npz),
timings.json, data_report.json, and metrics.json last (FINISHED_MARKER: its presence marks the run finished);
write_results writes them.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp

import xmcbench
from xmcbench.data import IN_MEMORY, Dataset
from xmcbench.errors import XmcError
from xmcbench.formats import FormatOptions
from xmcbench.registry import Registry
from xmcbench.storage import atomic_write, read_json, replace_folder, staging_folder, write_json

if TYPE_CHECKING:
    import torch

    from xmcbench.inference import Predictions
    from xmcbench.runs.plan import Plan

RUN_MARKER = ".xmcbench-run"
FINISHED_MARKER = "metrics.json"
VALIDATION_PREDICTIONS_FILE = "validation_predictions.safetensors"   # see save_validation_predictions
PREDICTIONS_NPZ = "predictions.npz"   # the test top-k as a scipy CSR score matrix, see save_predictions_npz
VERSIONED_PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "scipy", "scikit-learn", "safetensors")


@dataclass
class ClaimedRun:
    """target: where the run ends up (--output). directory: where this process writes it, target itself or
    a staging sibling that replaces target in finish(). locks: the open, locked markers."""

    target: Path
    directory: Path
    locks: list = field(default_factory=list, repr=False)

    def finish(self) -> Path:
        """Swap a staged run into place (the replaced run is deleted only then) and release the locks."""
        if self.directory != self.target:
            replace_folder(self.directory, self.target)
            _write_marker(self.target / RUN_MARKER, replaces=None)
            self.directory = self.target
        self.release()
        return self.target

    def release(self) -> None:
        for handle in self.locks:
            handle.close()   # closing the descriptor releases its flock
        self.locks.clear()


def run_path(run_dir: Path, *parts: str) -> Path:
    """run_dir / parts, for a file or folder that xmcbench writes (or reads back) inside a run folder: every
    part is a plain name (no `..`, no absolute path) and nothing on the way below run_dir is a symbolic link,
    so the path stays inside the folder; anything else is refused in one XmcError line."""
    path = Path(run_dir)
    for part in parts:
        relative = PurePath(part)
        if relative.is_absolute() or ".." in relative.parts:
            raise XmcError(f"{run_dir}: {part!r} is not a path inside the run folder")
        for name in relative.parts:
            path = path / name
            if path.is_symlink():
                raise _link_error(path)
    return path


def check_no_links(run_dir: Path) -> None:
    """Refuse a run folder that holds a symbolic link anywhere inside it (run_path's rule, for the whole
    folder at once): resuming a run writes its checkpoints, logs and model into it."""
    for root, folders, files in os.walk(run_dir):   # os.walk does not descend into linked folders
        for name in sorted(folders + files):
            if os.path.islink(os.path.join(root, name)):
                raise _link_error(Path(root) / name)


def _link_error(path: Path) -> XmcError:
    return XmcError(f"{path} is a symbolic link (to {os.readlink(path)}): what a run writes stays inside its folder, "
                    "so a run folder may hold no links; replace the link by a copy of what it points to, or start "
                    "a new run")


def claim_output(output: Path, overwrite: bool, is_finished) -> ClaimedRun:
    """Claim `output` for a new run. is_finished(folder) -> bool tells a finished run from an unfinished one.

    Empty or missing: the run is written there. Holding a run (the marker): refused unless overwrite, then
    the new run is staged beside it and replaces it only when finished. Anything else: refused."""
    output = Path(output)
    try:
        if output.exists() and not output.is_dir():
            raise XmcError(f"--output {output} is a file, not a folder; choose another --output")
        output.mkdir(parents=True, exist_ok=True)
        if not any(output.iterdir()):
            lock = _create_locked_marker(output, replaces=None)
            if lock is not None:
                return ClaimedRun(output, output, [lock])
        if not (output / RUN_MARKER).exists():
            raise XmcError(f"{output} is not empty and holds no xmcbench run (no {RUN_MARKER} file); "
                           "choose another --output")
        target_lock = _lock_marker(output)
        if {path.name for path in output.iterdir()} == {RUN_MARKER}:   # claimed, then stopped before writing
            return ClaimedRun(output, output, [target_lock])
        if not overwrite:
            target_lock.close()
            if is_finished(output):
                raise XmcError(f"{output} already holds a finished run; choose another --output or pass --overwrite")
            raise XmcError(f"{output} holds an unfinished run; continue it with `xmcbench run --resume {output}` "
                           "or pass --overwrite")
        staging = staging_folder(output)
        if staging.exists():   # an earlier replacement that never finished: it is ours to discard
            _lock_marker(staging).close()
            shutil.rmtree(staging)
        staging.mkdir()
        return ClaimedRun(output, staging, [target_lock, _create_locked_marker(staging, replaces=output.name)])
    except OSError as error:
        raise XmcError(f"cannot use --output {output}: {error.strerror or error}") from None


def claim_existing(run_dir: Path) -> ClaimedRun:
    """Claim an unfinished run folder to resume it; a staged replacement keeps its target."""
    run_dir = Path(run_dir)
    check_no_links(run_dir)
    marker = run_dir / RUN_MARKER
    if not marker.exists():   # a run started before markers existed (the caller checked its config.json)
        lock = _create_locked_marker(run_dir, replaces=None)
        if lock is not None:
            return ClaimedRun(run_dir, run_dir, [lock])
    try:
        replaces = json.loads(marker.read_text(encoding="utf-8")).get("replaces")
    except (OSError, ValueError, AttributeError):
        raise XmcError(f"{marker} is damaged; this run cannot be resumed, start a new one") from None
    locks = [_lock_marker(run_dir)]
    if replaces is None:
        return ClaimedRun(run_dir, run_dir, locks)
    if not isinstance(replaces, str) or Path(replaces).name != replaces:
        raise XmcError(f"{marker} names {replaces!r} as the run it replaces: not a sibling folder name")
    target = run_dir.with_name(replaces)
    if target.exists():
        locks.insert(0, _lock_marker(target))
    return ClaimedRun(target, run_dir, locks)


def _write_marker(path: Path, replaces: str | None) -> None:
    path.write_text(json.dumps({"xmcbench": xmcbench.__version__, "replaces": replaces}) + "\n", encoding="utf-8")


def _create_locked_marker(folder: Path, replaces: str | None):
    """The marker, locked before it appears (written aside, locked, then linked into place so no other
    process can see it unlocked). None when another process created it first."""
    aside = folder / f"{RUN_MARKER}.{os.getpid()}"
    _write_marker(aside, replaces)
    handle = open(aside, "rb")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        os.link(aside, folder / RUN_MARKER)
    except FileExistsError:
        handle.close()
        return None
    finally:
        aside.unlink()
    return handle


def _lock_marker(folder: Path):
    handle = open(folder / RUN_MARKER, "rb")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise XmcError(f"another xmcbench process is writing {folder}; wait for it to end or choose another "
                       "--output") from None
    return handle


def model_bytes(run_dir: Path) -> int:
    """The size of a run's model: model/weights.safetensors for a component method, every file a whole method's
    save wrote (model/method/) for a whole method; 0 if neither is there."""
    weights = Path(run_dir) / "model" / "weights.safetensors"
    if weights.is_file():
        return weights.stat().st_size
    folder = Path(run_dir) / "model" / "method"
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file()) if folder.is_dir() else 0


def is_finished(run_dir: Path) -> bool:
    return (Path(run_dir) / FINISHED_MARKER).exists()


def default_output(plan: Plan) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{plan.method}-{Path(plan.dataset).name}-{stamp}"


def environment(packages: tuple[str, ...] = ()) -> dict:
    """environment.json: library versions (`packages`: a method's own backends too, None when missing),
    platform, GPU, date."""
    import torch   # loggers import this module when their plugin loads: torch only where it is used

    versions = {"python": sys.version.split()[0], "xmcbench": xmcbench.__version__}
    for package in VERSIONED_PACKAGES + tuple(packages):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            if package in packages:
                versions[package] = None
    return {"versions": versions, "platform": platform.platform(), "processor": platform.processor(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


PEAK_RSS_RESET = Path("/proc/self/clear_refs")   # Linux: writing 5 restarts VmHWM from the memory in use now


PROCESS_STATUS = Path("/proc/self/status")


def reset_peak_memory() -> None:
    """Start a run's memory peaks from what the process holds now: `compare` trains its runs one after another
    in one process, and without the reset every run would report the largest peak of the runs before it."""
    import torch

    try:
        PEAK_RSS_RESET.write_text("5")
    except OSError:
        pass   # not Linux: peak_memory_mb falls back to the process's lifetime peak
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def peak_memory_mb(device: torch.device) -> dict:
    """The peak resident memory since reset_peak_memory (VmHWM; elsewhere the process's ru_maxrss), and on a
    GPU the peak allocated by torch on `device`."""
    import torch

    try:
        kilobytes = next(int(line.split()[1]) for line in PROCESS_STATUS.read_text().splitlines()
                         if line.startswith("VmHWM:"))
    except (OSError, StopIteration, IndexError, ValueError):
        kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    memory = {"peak_rss_mb": kilobytes / 1024}
    if device.type == "cuda":
        memory["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return memory


def write_run_config(output: Path, plan: Plan, dataset: Dataset, registry: Registry, resolved: dict, record: dict,
                     packages: tuple[str, ...] = ()) -> None:
    """config.json (the method, the dataset and its version, every setting, what was derived, `resolved`:
    what the run decided, such as threads, device and the training rows, and `record` as "provenance": the code,
    options and option files behind the result, see runs.plan.provenance) and environment.json (its code part
    too)."""
    dataset_ref = plan.dataset if plan.dataset in registry.datasets or plan.dataset.startswith(IN_MEMORY) \
        else str(Path(plan.dataset).resolve())
    reading = {} if plan.reading == FormatOptions() else {"reading": dataclasses.asdict(plan.reading)}
    write_json(output / "config.json", {"method": plan.method, "dataset": dataset_ref, "dataset_name": dataset.name,
                                        "dataset_version": dataset.version, "config": plan.config.to_dict(),
                                        **reading, **plan.describe(), "resolved": resolved, "provenance": record})
    code = {key: record[key] for key in ("xmcbench", "method", "components", "indexer") if key in record}
    write_json(output / "environment.json", {**environment(packages), "provenance": code})


def note_budget(output: Path, epochs: int, log) -> None:
    """config.json's "budget": training stopped at its epoch cap with the validation score still rising
    (callbacks.still_improving), the scores per epoch with it."""
    recorded = read_json(output / "config.json")
    recorded["budget"] = {"epochs": epochs, "still_improving": True,
                          "validation": [{"epoch": r["epoch"], "score": r["score"]} for r in log.validation]}
    write_json(output / "config.json", recorded)


def write_results(output: Path, dataset: Dataset, metrics: dict, predictions: Predictions, *,
                  validation_predictions: Predictions | None, validation_rows: np.ndarray, train_seconds: float,
                  documents_trained: int, predict_seconds: float, resumed: bool, device: torch.device) -> None:
    """The files every finished run has besides its model: predictions (test, and validation when there is a
    split; the test top-k also as predictions.npz), timings.json, data_report.json, and metrics.json last,
    whose presence marks the run finished. documents_trained: the documents of the ms/document figure (a
    whole method's one pass: its training rows)."""
    save_predictions(output / "predictions.safetensors", predictions)
    save_predictions_npz(output / PREDICTIONS_NPZ, predictions.labels, predictions.scores,
                         dataset.label_names[:dataset.num_labels])
    if validation_predictions is not None:
        save_validation_predictions(output / VALIDATION_PREDICTIONS_FILE, validation_predictions.labels,
                                    validation_predictions.scores, validation_rows)
    write_json(output / "timings.json", {
        "train_seconds": train_seconds,
        "train_ms_per_document": 1000 * train_seconds / max(1, documents_trained),
        "documents_trained": documents_trained,
        "predict_seconds": predict_seconds,
        "predict_ms_per_document": 1000 * predict_seconds / max(1, len(dataset.test_texts)),
        "resumed": resumed,
        "model_bytes": model_bytes(output),   # so reports can give the size when the model files stay elsewhere
        **peak_memory_mb(device)})
    write_json(output / "data_report.json", dataset.report)
    write_json(output / FINISHED_MARKER, {"dataset": dataset.name, "test_documents": len(dataset.test_texts),
                                          "unseen_test_labels": len(dataset.label_names) - dataset.num_labels,
                                          **metrics})


def save_predictions(path: Path, predictions: Predictions) -> None:
    """Test-set top-k as tensors (labels (N, k) int64, scores (N, k) float32): for ensembles and checks."""
    from safetensors.numpy import save_file

    arrays = {"labels": predictions.labels, "scores": predictions.scores}
    if predictions.recalled is not None:
        arrays["recalled_clusters"] = predictions.recalled
    atomic_write(path, lambda temporary: save_file(arrays, str(temporary)))


def labels_file_of(npz_path: Path) -> Path:
    """The label-names file that goes with a predictions .npz: predictions.npz -> predictions_labels.json."""
    return Path(npz_path).with_name(Path(npz_path).stem + "_labels.json")


def save_predictions_npz(path: Path, labels: np.ndarray, scores: np.ndarray, label_names: list[str]) -> None:
    """The top-k as the sparse score matrix PECOS and pyxclib users exchange: a scipy CSR (N, L) of float32,
    row i holding the scores of document i's top-k labels (ids -1, empty slots, left out), written with
    scipy.sparse.save_npz; the L column names go beside it in labels_file_of(path), a JSON list.
    labels, scores: (N, k); label_names: (L,) the names of the label ids."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float32)
    rows = np.broadcast_to(np.arange(labels.shape[0])[:, None], labels.shape)
    kept = labels >= 0
    # built from (data, indices, indptr) directly: a COO conversion would drop nothing but sums duplicates,
    # and a score of 0.0 is a prediction that must stay a stored entry
    order = np.lexsort((labels[kept], rows[kept]))
    indptr = np.concatenate(([0], np.cumsum(kept.sum(axis=1))))
    matrix = sp.csr_matrix((scores[kept][order], labels[kept][order].astype(np.int32), indptr),
                           shape=(labels.shape[0], len(label_names)))

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as file:   # a file object: given a name, numpy would append ".npz" to it
            sp.save_npz(file, matrix, compressed=True)

    atomic_write(path, write)
    write_json(labels_file_of(path), list(label_names))


def save_validation_predictions(path: Path, labels: np.ndarray, scores: np.ndarray, rows: np.ndarray) -> None:
    """The final model's top-k on the validation rows, for choosing ensemble weights without the test set
    (xmcbench.ensemble, --fusion weighted). Every method writes this one format:

    labels (V, k) int64 label ids (-1: empty slot), scores (V, k) float32, rows (V,) int64 = the training-set
    row indices of the validation documents, as split_train_rows returns them (sorted)."""
    from safetensors.numpy import save_file

    labels, scores, rows = np.asarray(labels), np.asarray(scores), np.asarray(rows)
    if labels.ndim != 2 or labels.shape != scores.shape or rows.shape != (labels.shape[0],):
        raise ValueError(f"validation predictions need labels and scores of one shape (V, k) and rows (V,), got "
                         f"{labels.shape}, {scores.shape} and {rows.shape}")
    arrays = {"labels": np.ascontiguousarray(labels, dtype=np.int64),
              "scores": np.ascontiguousarray(scores, dtype=np.float32),
              "rows": np.ascontiguousarray(rows, dtype=np.int64)}
    atomic_write(path, lambda temporary: save_file(arrays, str(temporary)))


def reading_of(saved: dict) -> FormatOptions:
    """The reading options a run recorded in its config.json ("reading", see write_run_config), so that
    --resume, evaluate, rescore and ensembles read its dataset path as the run did; defaults when none."""
    recorded = saved.get("reading") or {}
    return FormatOptions(**{key: value for key, value in recorded.items() if key in FormatOptions.__dataclass_fields__})
