"""The "mlflow" logger (`--set loggers=mlflow`): an MLflow run per xmcbench run, with the settings as params
and the losses and validation scores as metrics.

Where: the tracking URI in MLFLOW_TRACKING_URI when it is set (a server, a database), else a store inside
the run directory: `sqlite:///RUN_DIR/mlflow.db` when SQLAlchemy and Alembic are installed (MLflow's
recommended local store), else the file store `RUN_DIR/mlruns` (MLflow 3 refuses it unless
MLFLOW_ALLOW_FILE_STORE is true, which this logger sets for its process when it uses a file store). View it
with `mlflow ui --backend-store-uri URI`. The experiment is "xmcbench" (or MLFLOW_EXPERIMENT_NAME), the run
is named after the run directory.

What: params are the resolved settings (`TrainConfig.to_dict()`: `options.NAME` for a plugin's options, lists
joined by commas, values cut at 500 characters); metrics are

    train/loss, train/<part>     every step's total loss and each loss part (recall, rank), at the step
    validation/<metric>          each epoch's validation score at the step reached, the metric's name made
                                 valid for MLflow: '@' becomes '_at_' (P@5 -> validation/P_at_5, nDCG@3 ->
                                 validation/nDCG_at_3), any other character MLflow refuses becomes '_'

The run id is kept in `RUN_DIR/mlflow_run.json`, so that a resumed run (`--resume`) appends to the same
MLflow run; training's end marks it FINISHED. Uses `MlflowClient`, not MLflow's global active run, so runs in
one process do not interfere.

A run folder cannot choose where its metrics go: the tracking URI is MLFLOW_TRACKING_URI or the folder's own
store, never the URI that mlflow_run.json names (a folder received from someone else could name any server
or folder), and the local store's path is checked by xmcbench.rundir.run_path (no symbolic link). A resumed
run whose first session logged elsewhere says so in one line and starts a new MLflow run in the store it
uses now.

Tracking never holds up training: each request to a tracking server waits at most REQUEST_TIMEOUT seconds and
is retried REQUEST_RETRIES times (unless MLFLOW_HTTP_REQUEST_TIMEOUT / _MAX_RETRIES say otherwise), and when
a call fails (a server that does not answer, a refused value) the logger says so in one line on stderr and
logs nothing more for the rest of the session; training goes on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import numbers
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from xmcbench.callbacks import TrainingCallback
from xmcbench.errors import XmcError, first_line
from xmcbench.rundir import run_path
from xmcbench.storage import write_json

NAME = "mlflow"
DESCRIPTION = "an MLflow run: settings as params, losses and scores as metrics (MLFLOW_TRACKING_URI, else in RUN_DIR)"
EXTRA = "mlflow"
RUN_FILE = "mlflow_run.json"
EXPERIMENT = "xmcbench"
NOT_LOGGED = ("step", "epoch", "stage")   # a record's keys that are not losses
PARAM_LENGTH = 500     # the limit of older MLflow servers (newer ones take 6,000 characters)
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
INVALID_CHARACTERS = re.compile(r"[^/\w.\- ]")   # MLflow's names: alphanumerics, _ - . space and /
# Bounded waits for a tracking server, set around each call unless the user set MLflow's own variables: at
# most about (REQUEST_RETRIES + 1) x REQUEST_TIMEOUT seconds before the logger gives up (MLflow's defaults,
# 120 s and 7 retries with exponential backoff, hold a run for minutes when the server does not answer).
REQUEST_TIMEOUT = 10
REQUEST_RETRIES = 1
BOUNDED_WAITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT),
                 "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(REQUEST_RETRIES),
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


def mlflow_name(name: str) -> str:
    """A metric or param name MLflow accepts: '@' -> '_at_' (P@5 -> P_at_5), other refused characters -> '_'."""
    return INVALID_CHARACTERS.sub("_", str(name).replace("@", "_at_"))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _param_value(value) -> str:
    if isinstance(value, (tuple, list)):
        text = ",".join(str(item) for item in value)
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    return text if len(text) <= PARAM_LENGTH else text[:PARAM_LENGTH - 3] + "..."


def flat_params(config) -> dict[str, str]:
    """The run's settings as MLflow params: one per TrainConfig field, `options.NAME` for each option."""
    params = {}
    for key, value in config.to_dict().items():
        if key == "options" and isinstance(value, dict):
            params.update({mlflow_name(f"options.{name}"): _param_value(option) for name, option in value.items()})
        else:
            params[mlflow_name(key)] = _param_value(value)
    return params


def _quiet() -> None:
    """MLflow's INFO lines and its deprecation and maintenance notes are not the user's business here."""
    logging.getLogger("mlflow").setLevel(max(logging.getLogger("mlflow").getEffectiveLevel(), logging.WARNING))
    logging.getLogger("alembic").setLevel(max(logging.getLogger("alembic").getEffectiveLevel(), logging.WARNING))


def _local_tracking_uri(run_dir: Path) -> str:
    if importlib.util.find_spec("sqlalchemy") is not None and importlib.util.find_spec("alembic") is not None:
        return "sqlite:///" + str(run_path(run_dir, "mlflow.db").resolve())
    return run_path(run_dir, "mlruns").resolve().as_uri()


@contextlib.contextmanager
def _bounded_waits():
    """MLflow's HTTP timeout and retries set to BOUNDED_WAITS for the duration of one call (a value the user
    set in the environment is kept), then restored."""
    added = {name: value for name, value in BOUNDED_WAITS.items() if not os.environ.get(name)}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


class MlflowLogger(TrainingCallback):
    def __init__(self, run_dir: Path, config, client, tracking_uri: str, experiment: str, entities) -> None:
        self.run_dir, self.config, self.client = run_dir, config, client
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self._metric, self._param = entities
        self.run_id: str | None = None
        self.failed = False   # a call failed: nothing more is logged this session

    def _call(self, what: str, function, *args, **kwargs):
        """An MLflow call, its waits bounded (_bounded_waits). When it fails (a server that does not answer, a
        refused value) the logger says so in one line on stderr and stops logging: None is returned and
        training goes on. MLflow may draw from Python's and numpy's global generators (names, ids), which a
        run's checkpoint saves for an exact resume: they are left as they were."""
        if self.failed:
            return None
        states = random.getstate(), np.random.get_state()
        try:
            with warnings.catch_warnings(), _bounded_waits():
                warnings.simplefilter("ignore")
                return function(*args, **kwargs)
        except Exception as error:
            self.failed = True
            print(f"warning: the mlflow logger could not {what} at {self.tracking_uri} ({type(error).__name__}: "
                  f"{first_line(error)[:300]}); training goes on without MLflow logging", file=sys.stderr, flush=True)
            return None
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])

    def _saved_run_id(self) -> str | None:
        """The MLflow run an earlier session of this run started, if it logged to the store used now."""
        path = run_path(self.run_dir, RUN_FILE)
        if not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(saved, dict):
            return None
        if saved.get("tracking_uri") != self.tracking_uri:
            print(f"note: {path} names the tracking store {str(saved.get('tracking_uri'))[:300]!r} of an earlier "
                  f"session; a run folder does not choose where its metrics go, so this session logs a new MLflow "
                  f"run to {self.tracking_uri} (set MLFLOW_TRACKING_URI to continue the earlier one)",
                  file=sys.stderr, flush=True)
            return None
        run_id = saved.get("run_id")
        return run_id if isinstance(run_id, str) else None

    def on_train_begin(self, trainer) -> None:
        run_id = self._saved_run_id()
        run = None
        if run_id is not None:   # --resume: the run of the earlier session, reopened
            run = self._call("reopen run " + run_id, self.client.get_run, run_id)
            self._call("reopen run " + run_id, self.client.update_run, run_id, status="RUNNING")
            logged = set(run.data.params) if run is not None else set()
        else:
            experiment = self._call(f"find experiment {self.experiment!r}", self.client.get_experiment_by_name,
                                    self.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else
                             self._call(f"create experiment {self.experiment!r}", self.client.create_experiment,
                                        self.experiment))
            if not self.failed:
                run = self._call("start a run", self.client.create_run, experiment_id, run_name=self.run_dir.name,
                                 tags={"xmcbench.run_dir": str(self.run_dir.resolve())})
            if run is None:
                return
            run_id, logged = run.info.run_id, set()
            write_json(run_path(self.run_dir, RUN_FILE), {"run_id": run_id, "tracking_uri": self.tracking_uri,
                                                          "experiment": self.experiment})
        if self.failed:
            return
        self.run_id = run_id
        # params cannot change once logged: a resumed session adds only those the first one did not have
        params = [self._param(key, value) for key, value in flat_params(self.config).items() if key not in logged]
        for batch in _batches(params, PARAMS_PER_BATCH):
            self._call("log params", self.client.log_batch, run_id, params=batch)

    def _log_metrics(self, metrics: list) -> None:
        for batch in _batches(metrics, METRICS_PER_BATCH):
            self._call("log metrics", self.client.log_batch, self.run_id, metrics=batch)

    def on_log(self, trainer, records: list[dict]) -> None:
        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        self._log_metrics([self._metric(mlflow_name(f"train/{key}"), float(value), now, int(record["step"]))
                           for record in records for key, value in record.items()
                           if key not in NOT_LOGGED and _is_number(value)])

    def on_evaluate(self, trainer, record: dict) -> None:
        if self.run_id is None:
            return
        name = mlflow_name(f"validation/{record.get('metric') or 'score'}")
        self._log_metrics([self._metric(name, float(record["score"]), int(time.time() * 1000), int(trainer.step))])

    def on_train_end(self, trainer) -> None:
        if self.run_id is not None:
            self._call("end run " + self.run_id, self.client.set_terminated, self.run_id, "FINISHED")


def build(run_dir: Path, config) -> MlflowLogger:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
    except ImportError as error:
        raise XmcError("the mlflow logger needs the mlflow package: pip install 'xmcbench[mlflow]'") from error
    _quiet()
    run_dir = Path(run_dir)
    # the user's choice, or the folder's own store: never a URI read from the folder (module docstring)
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip() or _local_tracking_uri(run_dir)
    if tracking_uri.startswith("file:") or "://" not in tracking_uri:   # a file store: chosen, so allowed
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or EXPERIMENT
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            client = MlflowClient(tracking_uri)
    except Exception as error:
        raise XmcError(f"the mlflow logger cannot use the tracking store {tracking_uri}: "
                       f"{type(error).__name__}: {first_line(error)}") from error
    return MlflowLogger(run_dir, config, client, tracking_uri, experiment, (Metric, Param))
