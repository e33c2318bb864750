"""Training loggers as plugins: the built-in json, tensorboard and mlflow loggers pass the conformance check
and write what they say (read back with TensorBoard's and MLflow's own readers, across a resume); a
third-party logger registers and is listed; unknown names, bad registrations and a missing library fail in
one line; the check itself catches a logger that breaks the rules."""

from __future__ import annotations

import json
import re
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from xmcbench.callbacks import TrainingCallback
from xmcbench.config import TrainConfig
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import RejectedName, build_registry
from xmcbench.testing import check_logger

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
cli = CliRunner()


@pytest.fixture(autouse=True)
def isolated_environment(monkeypatch):
    """Every plugin loads, and MLflow logs nowhere but in tmp_path, whatever the environment says; what the
    mlflow logger sets in os.environ is undone afterwards."""
    for name in ("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", "XMCBENCH_PLUGINS", "MLFLOW_TRACKING_URI",
                 "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")   # recorded, so that teardown restores the original (absent) state
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def trainer(step: int = 0, log=None) -> types.SimpleNamespace:
    log = log or types.SimpleNamespace(steps=[], validation=[], selected_epoch=None, stopped_early=None,
                                       swa_updates=0)
    return types.SimpleNamespace(model=torch.nn.Linear(2, 2), config=TrainConfig(), stages=(), stage=None,
                                 epoch=0, step=step, documents_trained=0, log=log)


def record(step: int, epoch: int = 1) -> dict:
    return {"step": step, "epoch": epoch, "stage": "joint", "loss": 1.0 / step, "recall": 0.75 / step,
            "rank": 0.25 / step}


def session(logger, fake, steps: range, score: float, finish: bool) -> None:
    """on_train_begin, one on_log per step, on_epoch_end, on_evaluate (P@5) at the last step, maybe on_train_end."""
    logger.on_train_begin(fake)
    for step in steps:
        fake.step = step
        fake.log.steps.append(record(step))
        logger.on_log(fake, [fake.log.steps[-1]])
    fake.epoch += 1
    logger.on_epoch_end(fake)
    fake.log.validation.append({"epoch": fake.epoch, "score": score})
    logger.on_evaluate(fake, {"epoch": fake.epoch, "score": score, "metric": "P@5"})
    if finish:
        logger.on_train_end(fake)


# -- the built-in loggers --------------------------------------------------------------------------------

def test_the_builtin_loggers_are_registered_with_their_extras(registry):
    assert not registry.failures_of("xmcbench-loggers"), registry.failures_of("xmcbench-loggers")
    assert {name: entry.value.extra for name, entry in registry.loggers.items()
            if entry.origin.startswith("xmcbench-loggers")} == \
        {"tensorboard": "tensorboard", "mlflow": "mlflow"}


@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_the_builtin_loggers_conform(registry, name):
    check_logger(registry.logger(name))


def test_the_json_log_of_every_run_conforms_and_writes_the_training_log_and_the_loss_figure(tmp_path):
    from xmcbench.callbacks import JsonLog

    check_logger(lambda run_dir, config: JsonLog(run_dir))
    fake = trainer()
    session(JsonLog(tmp_path), fake, range(1, 4), 0.5, finish=True)
    written = json.loads((tmp_path / "training_log.json").read_text())
    assert written["steps"] == fake.log.steps and written["validation"] == [{"epoch": 1, "score": 0.5}]
    assert (tmp_path / "loss.png").stat().st_size > 0


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(event.step, round(event.value, 5)) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_holds_every_scalar_at_its_step(registry, tmp_path):
    session(registry.logger("tensorboard")(tmp_path, TrainConfig()), trainer(), range(1, 4), 0.5, finish=True)
    found = scalars(tmp_path / "tensorboard")
    assert set(found) == {"train/loss", "train/recall", "train/rank", "validation/P@5"}
    assert found["train/loss"] == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 5))]
    assert found["train/rank"] == [(1, 0.25), (2, 0.125), (3, round(0.25 / 3, 5))]
    assert found["validation/P@5"] == [(3, 0.5)]


def test_a_resumed_tensorboard_logger_replaces_the_steps_after_the_checkpoint(registry, tmp_path):
    # the first session logged steps 1-4 but checkpointed at step 2; the resumed one starts there
    first = trainer()
    session(registry.logger("tensorboard")(tmp_path, TrainConfig()), first, range(1, 5), 0.5, finish=True)
    # event files are read in name order, and a name starts with the second it was made in (then a counter
    # that sorts as text): a resumed session is a new second
    time.sleep(1.01 - time.time() % 1)
    second = trainer(step=2)
    session(registry.logger("tensorboard")(tmp_path, TrainConfig()), second, range(3, 6), 0.6, finish=True)
    found = scalars(tmp_path / "tensorboard")
    assert [step for step, _ in found["train/loss"]] == [1, 2, 3, 4, 5]
    assert found["validation/P@5"] == [(5, 0.6)]   # the interrupted session's step 4 is hidden


def test_mlflow_holds_params_and_metrics_and_a_resumed_run_appends_to_it(registry, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "lightxml-run"
    run_dir.mkdir()
    config = TrainConfig(lr=3e-4, eval_ks=(1, 5), options={"scale": 2.5})
    session(registry.logger("mlflow")(run_dir, config), trainer(), range(1, 3), 0.5, finish=False)   # interrupted
    session(registry.logger("mlflow")(run_dir, config), trainer(step=2), range(3, 5), 0.7, finish=True)

    client = MlflowClient((run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("xmcbench")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "the resumed session must append to the first session's run"
    run = runs[0]
    assert run.info.run_name == "lightxml-run" and run.info.status == "FINISHED"
    assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    params = run.data.params
    assert params["lr"] == "0.0003" and params["eval_ks"] == "1,5" and params["options.scale"] == "2.5"
    assert params["loggers"] == "" and params["batch_size"] == str(config.batch_size)
    assert set(params) == set(config.to_dict()) - {"options"} | {"options.scale"}
    history = {key: [(m.step, round(m.value, 5)) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("train/loss", "train/recall", "validation/P_at_5")}
    assert history["train/loss"] == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 5)), (4, 0.25)]
    assert [step for step, _ in history["train/recall"]] == [1, 2, 3, 4]
    assert history["validation/P_at_5"] == [(2, 0.5), (4, 0.7)]
    assert set(run.data.metrics) == {"train/loss", "train/recall", "train/rank", "validation/P_at_5"}


def test_mlflow_follows_the_tracking_uri_and_experiment_of_the_environment(registry, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "shared-store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "my-benchmarks")
    (tmp_path / "run").mkdir()
    session(registry.logger("mlflow")(tmp_path / "run", TrainConfig()), trainer(), range(1, 2), 0.5, finish=True)
    experiment = MlflowClient(store).get_experiment_by_name("my-benchmarks")
    assert experiment is not None and len(MlflowClient(store).search_runs([experiment.experiment_id])) == 1
    assert not (tmp_path / "run" / "mlruns").exists()


def test_mlflow_metric_names_are_made_valid():
    from xmcbench_loggers.mlflow_log import mlflow_name

    assert mlflow_name("validation/P@5") == "validation/P_at_5"
    assert mlflow_name("validation/PSnDCG@10") == "validation/PSnDCG_at_10"
    assert mlflow_name("options.a=b,c") == "options.a_b_c"


# -- a missing library ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, modules", [("tensorboard", ["torch.utils.tensorboard"]),
                                           ("mlflow", ["mlflow", "mlflow.entities", "mlflow.tracking"])])
def test_a_missing_library_is_one_line_naming_the_extra(registry, tmp_path, monkeypatch, name, modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)   # import raises ModuleNotFoundError
    with pytest.raises(XmcError) as raised:
        registry.logger(name)(tmp_path, TrainConfig())
    assert str(raised.value) == f"the {name} logger needs the {name} package: pip install 'xmcbench[{name}]'"


def test_a_missing_library_through_import_is_reported_too(registry, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("TensorBoard logging requires TensorBoard version 1.15 or above")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(XmcError, match=r"^the tensorboard logger needs .*pip install 'xmcbench\[tensorboard\]'$"):
        registry.logger("tensorboard")(tmp_path, TrainConfig())


# -- the registry ---------------------------------------------------------------------------------------

def test_an_unknown_logger_is_one_line_with_a_suggestion(registry):
    with pytest.raises(XmcError) as raised:
        registry.logger("tensorbord")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("unknown logger 'tensorbord'")
    assert "did you mean 'tensorboard'?" in message and "xmcbench plugins" in message


def test_with_no_logger_registered_the_error_says_so():
    with pytest.raises(XmcError, match="unknown logger 'mlflow' in loggers: none is registered"):
        build_registry(load_entry_points=False).logger("mlflow")


class CountingLogger(TrainingCallback):
    """Counts the steps it saw (in its state, so a resumed run goes on counting)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_log(self, trainer, records):
        self.steps += len(records)

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def build_counting(run_dir, config):
    return CountingLogger()


COUNTING_PLUGIN = types.SimpleNamespace(xmcbench_register_loggers=lambda registry: registry.add_logger(
    "counting", build_counting, "counts the steps", extra="counting-extra"))


def test_a_third_party_logger_is_registered_checked_and_listed(monkeypatch):
    registry = build_registry(extra_plugins=[("counter", COUNTING_PLUGIN)])
    assert not registry.failures_of("counter")
    assert registry.logger("counting") is build_counting
    assert registry.loggers["counting"].origin == "counter (<in-process>)"
    check_logger(registry.logger("counting"))

    from xmcbench import cli as cli_module
    from xmcbench import registry as registry_module

    # the command imports build_registry when it runs (the CLI starts without importing torch)
    monkeypatch.setattr(registry_module, "build_registry",
                        lambda: build_registry(extra_plugins=[("counter", COUNTING_PLUGIN)]))
    result = cli.invoke(cli_module.app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^counting\s+counter\s+xmcbench\[counting-extra\]\s+counts the steps$", result.output,
                     re.MULTILINE), result.output
    assert re.search(r"^mlflow\s+xmcbench-loggers\s+xmcbench\[mlflow\]\s+an MLflow run", result.output,
                     re.MULTILINE), result.output
    assert re.search(r"^counter\s+<in-process>\s+xmcbench_register_loggers\s+logger 'counting'$", result.output,
                     re.MULTILINE), result.output


def test_a_clashing_logger_name_is_rejected_alone():
    @hookimpl
    def xmcbench_register_loggers(registry):
        registry.add_logger("tensorboard", build_counting, "another tensorboard")
        registry.add_logger("counting", build_counting, "counts the steps")

    module = types.ModuleType("clasher")
    module.xmcbench_register_loggers = xmcbench_register_loggers
    registry = build_registry(extra_plugins=[("clasher", module)])
    failures = registry.failures_of("clasher")
    assert [type(failure) for failure in failures] == [RejectedName]
    assert "logger 'tensorboard' is registered twice: by xmcbench-loggers" in failures[0].error
    assert registry.loggers["tensorboard"].origin.startswith("xmcbench-loggers") and "counting" in registry.loggers


@pytest.mark.parametrize("arguments, error", [
    (("my logger", build_counting, "d"), "registers a logger named 'my logger', which contains whitespace"),
    (("a,b", build_counting, "d"), "which contains ','"),
    (("fine", "not callable", "d"), "registers logger 'fine' with a factory that is not callable"),
    (("fine", build_counting, ""), "registers logger 'fine' without a description"),
    (("fine", build_counting, "d", ""), "registers logger 'fine' with extra ''"),
])
def test_a_bad_logger_registration_fails_the_plugin_in_one_line(arguments, error):
    plugin = types.SimpleNamespace(xmcbench_register_loggers=lambda registry: registry.add_logger(*arguments))
    registry = build_registry(extra_plugins=[("bad", plugin)], load_entry_points=False)
    (failure,) = registry.failures_of("bad")
    assert error in failure.error and "\n" not in failure.error
    assert registry.loggers == {}


# -- the conformance check catches a broken logger ----------------------------------------------------

class MutatesTheLog(TrainingCallback):
    def on_log(self, trainer, records):
        records[-1]["loss"] = round(records[-1]["loss"], 1)


class AppendsToTheLog(TrainingCallback):
    def on_evaluate(self, trainer, record):
        trainer.log.validation.append(dict(record))


class ChangesTheModel(TrainingCallback):
    def on_epoch_end(self, trainer):
        with torch.no_grad():
            next(trainer.model.parameters()).add_(1.0)


class DrawsRandomNumbers(TrainingCallback):
    def on_step_end(self, trainer):
        torch.rand(1)


class LacksAnEvent:
    def on_train_begin(self, trainer): ...

    def state_dict(self):
        return {}

    def load_state_dict(self, state): ...


class UnsaveableState(TrainingCallback):
    def state_dict(self):
        return {"writer": object()}


class RaisesOnResume(TrainingCallback):
    def __init__(self, run_dir):
        self.marker = run_dir / "begun"

    def on_train_begin(self, trainer):
        if self.marker.exists():
            raise FileExistsError(f"{self.marker} exists")
        self.marker.touch()


@pytest.mark.parametrize("factory, message", [
    (lambda run_dir, config: MutatesTheLog(), r"on_log must not change trainer.log: trainer.log.steps was"),
    (lambda run_dir, config: AppendsToTheLog(), r"on_evaluate must not change trainer.log: trainer.log.validation"),
    (lambda run_dir, config: ChangesTheModel(), r"on_epoch_end must not change the model: changed: weight"),
    (lambda run_dir, config: DrawsRandomNumbers(), r"on_step_end must not draw from or reseed"),
    (lambda run_dir, config: LacksAnEvent(), r"must be a method \(on_stage_begin\)"),
    (lambda run_dir, config: UnsaveableState(), r"state_dict\(\) must (survive torch.save|load with torch.load)"),
    (lambda run_dir, config: RaisesOnResume(run_dir), r"on_train_begin\(\) at step 15 must work: raised "
                                                      r"FileExistsError"),
    (lambda run_dir: TrainingCallback(), r"factory\(run_dir, config\) must work \(a new run\): raised TypeError"),
])
def test_check_logger_names_the_broken_rule(factory, message):
    with pytest.raises(AssertionError, match=r"^logger .*" + message):
        check_logger(factory)


# -- the documentation's example works -------------------------------------------------------------------

def test_the_contributing_example_logger_conforms(tmp_path):
    text = CONTRIBUTING.read_text(encoding="utf-8")
    section = text[text.index("#### `xmcbench_register_loggers"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```\n", start)]
    module = types.ModuleType("xmcbench_csvlog_plugin")
    exec(compile(code, "CONTRIBUTING.md", "exec"), module.__dict__)
    registry = build_registry(extra_plugins=[("csvlog", module)], load_entry_points=False)
    assert not registry.failures_of("csvlog")
    check_logger(registry.logger("csv"))
    fake = trainer()
    session(registry.logger("csv")(tmp_path, TrainConfig()), fake, range(1, 3), 0.5, finish=True)
    assert (tmp_path / "loss.csv").read_text().splitlines() == ["step,loss", "1,1.0", "2,0.5"]
