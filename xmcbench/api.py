"""The Python API, for notebooks and scripts: train, load, predict and evaluate without the command line.

    import xmcbench
    run = xmcbench.train("lightxml", "debian-debtags-mini", epochs=1)
    predictor = xmcbench.load(run.path)            # the model is read once
    predictor.predict(["python bindings for gtk"], top_k=5)
    xmcbench.evaluate(predictor, "debian-debtags-mini")

Every function reuses what the commands do (xmcbench.runs, xmcbench.saved); docs/api.md describes them.

`data`, wherever a function takes it, is one of:
  - a registered dataset name ("debian-debtags-mini"), or a folder or file path in any format `xmcbench formats`
    lists (reading options in `reading=`, a FormatOptions or a dict of its fields);
  - data held in memory: a tuple (train_texts, train_labels, test_texts, test_labels), or a dict with those
    keys; texts: (N,) str; labels: (N,) lists of label names, aligned with the texts.
"""

from __future__ import annotations

import datetime
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from xmcbench import saved
from xmcbench.data import IN_MEMORY, Dataset
from xmcbench.distributed import is_main_process
from xmcbench.errors import XmcError
from xmcbench.formats import FormatOptions, dataset_from_rows, open_dataset
from xmcbench.registry import Registry, build_registry
from xmcbench.rundir import FINISHED_MARKER, is_finished
from xmcbench.runs import launch
from xmcbench.runs.plan import Plan, plan_resume, plan_run
from xmcbench.saved import SavedModel
from xmcbench.scoring import evaluate_predictions as score_matrix, write_external_run
from xmcbench.storage import fingerprint, read_json

IN_MEMORY_KEYS = ("train_texts", "train_labels", "test_texts", "test_labels")

__all__ = ["Predictor", "Run", "evaluate", "evaluate_predictions", "load", "resolved_config", "train"]


# -- data -------------------------------------------------------------------------------------------

def _reading(reading: FormatOptions | dict | None) -> FormatOptions:
    if reading is None:
        return FormatOptions()
    if isinstance(reading, FormatOptions):
        return reading
    if isinstance(reading, dict):
        unknown = sorted(set(reading) - set(FormatOptions.__dataclass_fields__))
        if unknown:
            raise XmcError(f"reading: unknown option {unknown[0]!r}; the options are "
                           f"{', '.join(FormatOptions.__dataclass_fields__)}")
        return FormatOptions(**reading)
    raise XmcError(f"reading must be a FormatOptions or a dict of its fields, got {type(reading).__name__}")


def _check_threshold(threshold: Any) -> None:
    """A predict threshold is None or a finite number: NaN would drop every label without a word."""
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                  or not math.isfinite(threshold)):
        raise XmcError(f"threshold must be a finite number (labels scoring below it are dropped), got {threshold!r}")


def _text_list(value: Any, what: str) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise XmcError(f"{what} must be a list of strings, got {type(value).__name__}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise XmcError(f"{what}[{i}] is a {type(text).__name__}, not a string")
    return list(value)


def _label_rows(value: Any, what: str) -> list[list[str]]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise XmcError(f"{what} must be a list of label-name lists, got {type(value).__name__}")
    rows = []
    for i, row in enumerate(value):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) \
                or not all(isinstance(label, str) for label in row):
            raise XmcError(f"{what}[{i}] must be a list of label names (e.g. [\"graphics\", \"network\"]), "
                           f"got {row!r}")
        rows.append(list(row))
    return rows


def in_memory_dataset(data: Any) -> Dataset | None:
    """The Dataset of data held in memory ((train_texts, train_labels, test_texts, test_labels), as a tuple or
    a dict with those keys), named "in-memory:<hash>" with the hash of the lists as its version; None when
    `data` is not such data (a name or a path)."""
    if isinstance(data, dict):
        missing = [key for key in IN_MEMORY_KEYS if key not in data]
        if missing:
            raise XmcError(f"data given as a dict needs the keys {', '.join(IN_MEMORY_KEYS)}; {missing[0]!r} is "
                           "missing")
        parts = [data[key] for key in IN_MEMORY_KEYS]
    elif isinstance(data, (tuple, list)):
        if len(data) != 4:
            raise XmcError(f"data given as a tuple needs 4 parts ({', '.join(IN_MEMORY_KEYS)}), got {len(data)}")
        parts = list(data)
    else:
        return None
    train_texts, test_texts = _text_list(parts[0], "train_texts"), _text_list(parts[2], "test_texts")
    train_rows, test_rows = _label_rows(parts[1], "train_labels"), _label_rows(parts[3], "test_labels")
    for split, texts, rows in (("train", train_texts, train_rows), ("test", test_texts, test_rows)):
        if len(texts) != len(rows):
            raise XmcError(f"{split}_labels has {len(rows)} rows for {len(texts)} {split}_texts; give one list of "
                           "label names per text")
    version = fingerprint(train_texts, train_rows, test_texts, test_rows)
    return dataset_from_rows(f"{IN_MEMORY}{version}", version, train_texts, train_rows, test_texts, test_rows,
                             "the data given in memory")


def _name(data: Any) -> str:
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    raise XmcError(f"data must be a dataset name, a path, or (train_texts, train_labels, test_texts, test_labels); "
                   f"got {type(data).__name__}")


def open_data(data: Any, registry: Registry, reading: FormatOptions | dict | None = None,
              data_dir: str | os.PathLike | None = None) -> Dataset:
    """`data` (a name, a path, data held in memory, or a Dataset) read into a Dataset; data_dir: the folder of
    user-provided registered datasets (default: $XMCBENCH_DATA_DIR)."""
    if isinstance(data, Dataset):
        return data
    memory = in_memory_dataset(data)
    if memory is not None:
        return memory
    return open_dataset(registry, _name(data), _path(data_dir), _reading(reading))


def _path(value: str | os.PathLike | None) -> Path | None:
    return Path(value) if value is not None else None


def _set_options(settings: dict[str, Any]) -> list[str]:
    """TrainConfig settings as `--set` strings: options={"a": 1} -> "options.a=1", True -> "true",
    (1, 3) -> "1,3"."""
    def text(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value)
        return str(os.fspath(value) if isinstance(value, os.PathLike) else value)

    pairs: list[str] = []
    for key, value in settings.items():
        if key == "options":
            if not isinstance(value, dict):
                raise XmcError(f"options must be a dict of option names and values, got {type(value).__name__}")
            pairs += [f"options.{name}={text(v)}" for name, v in value.items()]
        else:
            pairs.append(f"{key}={text(value)}")
    return pairs


# -- a saved model ----------------------------------------------------------------------------------

class Predictor:
    """A saved run's model (or an ensemble's member models), read once by `load`; predict and evaluate reuse it
    (xmcbench.saved.SavedModel). label_names: (L,) the model's label vocabulary (for an ensemble, the members'
    shared one)."""

    def __init__(self, saved: SavedModel) -> None:
        self.saved = saved
        self.path = saved.path
        self.label_names = saved.label_names

    def __repr__(self) -> str:
        kind = f"ensemble of {len(self.saved.models)}" if self.saved.ensemble else "run"
        return f"Predictor({str(self.path)!r}, {kind}, {len(self.label_names)} labels)"

    def predict(self, texts: Sequence[str], top_k: int = 10, threshold: float | None = None) -> list[dict]:
        """texts: (N,) str. Returns N dicts {"labels": [name, ...], "scores": [float, ...]}, best first, at most
        top_k each (fewer when threshold drops the labels scoring below it) — what `xmcbench predict` writes."""
        texts = _text_list(texts, "texts")
        _check_threshold(threshold)
        return self.saved.predict(texts, top_k, threshold)

    def evaluate(self, data: Any = None, reading: FormatOptions | dict | None = None, *,
                 data_dir: str | os.PathLike | None = None, set_options: Sequence[str] = (),
                 **settings: Any) -> dict:
        """Metrics (P@k, nDCG@k, PSP@k, ... at the run's eval_ks, as in metrics.json) of the model on the test
        split of `data` (see the module docstring); None: the dataset it was trained on, read as it was read
        (or with `reading`, when given). settings, set_options: scoring settings over the run's (eval_ks,
        propensity_a, propensity_b), as keywords or as `--set` strings "key=value"."""
        reading = _reading(reading)
        config = self.saved.scoring_config(list(set_options) + _set_options(settings))   # before any data is read
        dataset = self.saved.recorded_dataset(_path(data_dir), reading) if data is None else \
            open_data(data, self.saved.registry, reading, data_dir)
        return self.saved.evaluate(dataset, config)


def load(path: str | os.PathLike, registry: Registry | None = None, threads: int | None = None) -> Predictor:
    """The model of a run directory (or its model/ folder), or the member models of an ensemble directory,
    read once (xmcbench.saved.load) into a Predictor. threads: torch CPU threads of its predictions (None:
    the ones each model trained with)."""
    return Predictor(saved.load(Path(path), registry or build_registry(), threads))


# -- a run ------------------------------------------------------------------------------------------

@dataclass
class Run:
    """A finished run directory: path, metrics (metrics.json), config (config.json)."""

    path: Path
    metrics: dict
    config: dict
    _data: Dataset | None = field(default=None, repr=False, compare=False)   # in-memory data it was trained on
    _predictor: Predictor | None = field(default=None, repr=False, compare=False)
    _registry: Registry | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Run":
        path = Path(path)
        if not is_finished(path):
            raise XmcError(f"{path} holds no finished run (metrics.json is missing)")
        return cls(path, read_json(path / FINISHED_MARKER), read_json(path / "config.json"))

    def predictor(self) -> Predictor:
        """The run's model, read on the first call and kept (see `load`)."""
        if self._predictor is None:
            self._predictor = load(self.path, self._registry)
        return self._predictor

    def evaluate(self, data: Any = None, reading: FormatOptions | dict | None = None, **scoring: Any) -> dict:
        """Metrics on the test split of `data`; None: the data the run was trained on (kept in memory when it
        was given as lists). scoring: Predictor.evaluate's keywords (data_dir, set_options, eval_ks=...)."""
        return self.predictor().evaluate(data if data is not None else self._data, reading, **scoring)


def _plan(registry: Registry, method: str | None, data: Any, seed: int | None,
          config_file: str | os.PathLike | None, data_dir: str | os.PathLike | None,
          reading: FormatOptions | dict | None, set_options: Sequence[str],
          settings: dict[str, Any]) -> tuple[Plan, Dataset | None]:
    """The resolved plan of a new run (runs.plan.plan_run), and the dataset when `data` is held in memory."""
    if method is None:
        raise XmcError("name a method (e.g. \"lightxml\"), or pass resume=RUN_DIR to continue a run")
    reading = _reading(reading)
    options = list(set_options) + _set_options(settings)
    memory = in_memory_dataset(data)
    if memory is not None and reading != FormatOptions():
        raise XmcError("reading options read a file or folder; data given in memory takes none")
    name = memory.name if memory is not None else _name(data) if data is not None else None   # None: the default
    plan = plan_run(registry, method, name, _path(config_file), options, seed, _path(data_dir), loaded=memory,
                    reading=reading)
    return plan, memory


def _resumed_plan(resume: str | os.PathLike, given: dict[str, bool]) -> Plan:
    """The plan recorded in the unfinished run directory `resume`; given: which arguments that would change the
    run were passed (a resumed run takes none)."""
    passed = [name for name, was_given in given.items() if was_given]
    if passed:
        raise XmcError(f"resume takes only the run directory, not {passed[0]}: the run's settings are in its "
                       "config.json")
    return plan_resume(Path(resume))


def _given(method: str | None, data: Any, seed: int | None, reading: FormatOptions | dict | None,
           config_file: Any, set_options: Sequence[str], settings: dict[str, Any]) -> dict[str, bool]:
    return {"method": method is not None, "data": data is not None, "seed": seed is not None,
            "reading": _reading(reading) != FormatOptions(), "config_file": config_file is not None,
            "set_options": bool(set_options), "settings": bool(settings)}


def describe_plan(plan: Plan) -> dict:
    """What `xmcbench config` and `run --print-config` print of a plan."""
    return {"method": plan.method, "dataset": plan.dataset, **plan.config.to_dict(), **plan.describe()}


def resolved_config(method: str | None = None, data: Any = None, *, seed: int | None = None,
                    registry: Registry | None = None, reading: FormatOptions | dict | None = None,
                    config_file: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None,
                    set_options: Sequence[str] = (), resume: str | os.PathLike | None = None,
                    **settings: Any) -> dict:
    """The configuration `train` with the same arguments would run with, without running it: the method, the
    dataset, every setting, and for a dataset without a preset, the settings derived from its statistics with
    what each follows from (what `xmcbench config` and `xmcbench run --print-config` print)."""
    registry = registry or build_registry()
    if resume is not None:
        plan = _resumed_plan(resume, _given(method, data, seed, reading, config_file, set_options, settings))
    else:
        plan, _ = _plan(registry, method, data, seed, config_file, data_dir, reading, set_options, settings)
    return describe_plan(plan)


def train(method: str | None = None, data: Any = None, *, output: str | os.PathLike | None = None,
          seed: int | None = None, registry: Registry | None = None, log: Callable[[str], Any] | None = print,
          reading: FormatOptions | dict | None = None, overwrite: bool = False,
          config_file: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None,
          set_options: Sequence[str] = (), resume: str | os.PathLike | None = None, **settings: Any) -> Run:
    """Train `method` on `data` (see the module docstring; None: the default dataset) like `xmcbench run`;
    return the finished Run.

    settings: TrainConfig settings (epochs=1, lr=1e-4, options={"name": value}); set_options: the same as
    `--set` strings ("epochs=1"), applied before `settings`; config_file: a TOML or JSON file of settings.
    seed: None: the config file's, else the method's default (0).
    output: the run directory; default runs/METHOD-DATASET-TIMESTAMP under the current folder, as the CLI
    (runs/METHOD-in-memory-HASH-TIMESTAMP for data held in memory). overwrite: replace a finished run there.
    data_dir: the folder of user-provided registered datasets (default: $XMCBENCH_DATA_DIR).
    resume: an interrupted run directory to continue from its last checkpoint; it takes no method, data or
    settings (they are in its config.json) but `threads`, the torch CPU threads of this process (the run's
    recorded settings and result key stay its own; the last bits of a float may then differ from a run that was
    never stopped). log: where progress lines go (None: nowhere).
    In the other processes of a torchrun run the Run has only its path: process 0 writes the run's files.
    """
    registry = registry or build_registry()
    log = log or (lambda line: None)
    memory = None
    if resume is not None:
        threads = settings.pop("threads", None)
        given = _given(method, data, seed, reading, config_file, set_options, settings)
        plan = _resumed_plan(resume, {**given, "output": output is not None})
        if threads is not None:   # how this process computes, not what the run is: config.json keeps its own
            plan.config.threads = threads
        output = resume
    else:
        plan, memory = _plan(registry, method, data, seed, config_file, data_dir, reading, set_options, settings)
        if memory is not None and output is None:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            output = Path("runs") / f"{method}-in-memory-{memory.version[:8]}-{stamp}"
    path = launch.run(plan, _path(output), _path(data_dir), overwrite, registry, log=log, resume=resume is not None)
    if not is_main_process():
        return Run(path, {}, {})
    finished = Run.open(path)
    finished._data, finished._registry = memory, registry
    return finished


def evaluate(path_or_predictor: str | os.PathLike | Predictor | Run, data: Any = None,
             reading: FormatOptions | dict | None = None, registry: Registry | None = None, *,
             data_dir: str | os.PathLike | None = None, set_options: Sequence[str] = (), **settings: Any) -> dict:
    """Metrics of a run directory, ensemble directory, Run or Predictor on the test split of `data` (None: the
    dataset it was trained on); data_dir, set_options, settings: see Predictor.evaluate."""
    if isinstance(path_or_predictor, (Predictor, Run)):
        return path_or_predictor.evaluate(data, reading, data_dir=data_dir, set_options=set_options, **settings)
    return load(path_or_predictor, registry).evaluate(data, reading, data_dir=data_dir, set_options=set_options,
                                                      **settings)


def evaluate_predictions(predictions: str | os.PathLike, data: str | os.PathLike, *,
                         labels_file: str | os.PathLike | None = None, reading: FormatOptions | dict | None = None,
                         data_dir: str | os.PathLike | None = None, output: str | os.PathLike | None = None,
                         name: str | None = None, registry: Registry | None = None, set_options: Sequence[str] = (),
                         **settings: Any) -> dict:
    """Metrics of a score matrix that any system wrote, scored on the test split of `data` (a dataset name or
    path) exactly as xmcbench scores its runs (scoring.evaluate_predictions).

    predictions: a scipy CSR (test documents x labels) saved with scipy.sparse.save_npz; labels_file: the name
    of each column (JSON list or one per line; default: NAME_labels.json beside it, else the dataset's label
    ids). settings, set_options: scoring settings (eval_ks, propensity_a, propensity_b). output: also write a
    run-like folder there that `xmcbench report` reads beside runs, the system named `name` (default: the
    file's name)."""
    predictions = Path(predictions)
    metrics, dataset, config = score_matrix(
        predictions, _name(data), _path(data_dir), registry, _reading(reading),
        list(set_options) + _set_options(settings), _path(labels_file))
    if output is not None:
        write_external_run(Path(output), name or predictions.stem, predictions, _name(data), dataset, config,
                                  metrics)
    return metrics
