"""The training loop and its callbacks, through real runs: the events a plugin's logger sees, TensorBoard and
MLflow files a run leaves, loggers that change no weight, one inference loop, and a core that names no
plugin's component, encoder or dataset."""

from __future__ import annotations

import inspect
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from xmcbench import inference, training
from xmcbench.callbacks import TrainingCallback
from xmcbench.config import STAGE_STARTS, Stage, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import build_registry
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run

TINY = ["pretrained_weights=false", "num_layers=2", "hidden_size=8", "max_length=16", "threads=1",
        "batch_size=8", "epochs=2", "refit_epochs=1", "cluster_size=2", "top_clusters=2", "validation_size=8",
        "swa_every_steps=2", "swa_start_epoch=0"]


class Recorder(TrainingCallback):
    """Every event with what it carried, into a list shared by all instances."""

    events: list[tuple] = []

    def __init__(self, run_dir, config) -> None:
        pass

    def on_train_begin(self, trainer):
        self.events.append(("train_begin",))

    def on_stage_begin(self, trainer, stage):
        self.events.append(("stage_begin", stage.name))

    def on_epoch_begin(self, trainer):
        self.events.append(("epoch_begin", trainer.stage.name, trainer.epoch))

    def on_step_end(self, trainer):
        self.events.append(("step_end", trainer.step))

    def on_log(self, trainer, records):
        self.events.append(("log", [record["step"] for record in records]))

    def on_epoch_end(self, trainer):
        self.events.append(("epoch_end", trainer.stage.name, trainer.epoch))

    def on_evaluate(self, trainer, record):
        self.events.append(("evaluate", record["epoch"], record["metric"]))

    def on_stage_end(self, trainer, stage):
        self.events.append(("stage_end", stage.name))

    def on_train_end(self, trainer):
        self.events.append(("train_end",))


def recorder_plugin():
    return SimpleNamespace(xmcbench_register_loggers=hookimpl(
        lambda registry: registry.add_logger("recorder", Recorder, "records every event (test)")))


def train(registry, method, output, tiny_model_dir, tiny_dataset, *settings):
    plan = plan_run(registry, method, str(tiny_dataset),
                           set_options=[f"model_name={tiny_model_dir}", *TINY, *settings])
    return launch.run(plan, output, registry=registry, log=lambda line: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """lightxml-static (three stages) with the recording logger, and again with TensorBoard and MLflow."""
    from xmcbench.testing import write_tiny_dataset

    root = tmp_path_factory.mktemp("loop")
    dataset = write_tiny_dataset(root / "data")
    registry = build_registry(extra_plugins=[("recorder", recorder_plugin())])
    Recorder.events.clear()
    recorded = train(registry, "lightxml-static", root / "recorded", tiny_model_dir, dataset, "loggers=recorder")
    events = list(Recorder.events)
    tracked = train(registry, "lightxml-static", root / "tracked", tiny_model_dir, dataset,
                    "loggers=tensorboard,mlflow")
    return SimpleNamespace(recorded=recorded, tracked=tracked, events=events)


@pytest.mark.slow
def test_a_logger_plugin_sees_every_event_in_order(runs):
    import json

    events, log = runs.events, json.loads((runs.recorded / "training_log.json").read_text())
    kinds = [event[0] for event in events]
    assert kinds[0] == "train_begin" and kinds[-1] == "train_end" and kinds.count("train_begin") == 1
    assert [e[1] for e in events if e[0] == "stage_begin"] == ["recall", "rank", "recall-refit"]
    assert [e[1] for e in events if e[0] == "stage_end"] == ["recall", "rank", "recall-refit"]
    assert [e[1:] for e in events if e[0] == "epoch_end"] == \
        [("recall", 1), ("recall", 2), ("rank", 1), ("rank", 2), ("recall-refit", 1)]
    # validation scores only the last stage's epochs, after that epoch ends
    assert [e[1:] for e in events if e[0] == "evaluate"] == [(1, "P@5")]
    last_epoch_end = len(kinds) - 1 - kinds[::-1].index("epoch_end")
    assert kinds[last_epoch_end - 1] == "evaluate"   # scored as the epoch ends, before the loggers hear of its end
    steps = [e[1] for e in events if e[0] == "step_end"]
    logged = [step for e in events if e[0] == "log" for step in e[1]]
    assert steps == logged == [record["step"] for record in log["steps"]] == list(range(1, len(steps) + 1))


@pytest.mark.slow
def test_loggers_change_no_weight(runs):
    recorded, tracked = (load_file(str(run / "model" / "weights.safetensors")) for run in (runs.recorded, runs.tracked))
    assert recorded.keys() == tracked.keys()
    assert all(np.array_equal(recorded[name], tracked[name]) for name in recorded)


@pytest.mark.slow
def test_a_run_with_tensorboard_and_mlflow_leaves_readable_files(runs):
    import json

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = json.loads((runs.tracked / "training_log.json").read_text())
    events = EventAccumulator(str(runs.tracked / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == [record["step"] for record in log["steps"]]
    assert np.allclose([event.value for event in losses], [record["loss"] for record in log["steps"]])
    assert [event.value for event in events.Scalars("validation/P@5")] == \
        pytest.approx([record["score"] for record in log["validation"]])

    client = MlflowClient((runs.tracked / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.params["cluster_size"] == "2"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(metric.step for metric in history) == [record["step"] for record in log["steps"]]


def test_an_unknown_logger_is_refused_before_anything_runs(tiny_model_dir, tiny_dataset):
    with pytest.raises(XmcError, match="tensorbord.*did you mean 'tensorboard'"):
        plan_run(build_registry(), "lightxml", str(tiny_dataset),
                        set_options=[f"model_name={tiny_model_dir}", "loggers=tensorbord"])


def test_prediction_and_the_static_samplers_candidate_pass_share_one_inference_loop(tmp_path, tiny_model_dir,
                                                                                       tiny_dataset, monkeypatch):
    calls = []
    real = inference.map_documents

    def spy(model, tokens, function, outputs, *args, **kwargs):
        calls.append(outputs[0].dtype)
        return real(model, tokens, function, outputs, *args, **kwargs)

    monkeypatch.setattr(inference, "map_documents", spy)
    monkeypatch.setattr(training, "map_documents", spy)
    train(build_registry(), "lightxml-static", tmp_path / "run", tiny_model_dir, tiny_dataset, "validation_size=0",
          "epochs=1")
    # recalled clusters for the rank stage, the frozen encoder of the refit stage, then the test predictions
    assert len(calls) == 3


def test_stages_name_their_epochs_setting_and_start_strategy():
    assert Stage("refit", epochs_key="refit_epochs").epochs(TrainConfig(refit_epochs=4)) == 4
    for bad in ({"epochs_key": "lr"}, {"epochs_key": "epochz"}, {"start": "copy-everything"}):
        with pytest.raises(XmcError, match="malformed"):
            Stage("bad", **bad)
    assert set(STAGE_STARTS) == {"copy-encoder-to-ranker-encoder"}


def test_the_core_names_no_plugins_component_encoder_or_dataset():
    config = TrainConfig()
    assert (config.encoder, config.recaller, config.ranker, config.sampler, config.model_name) == ("",) * 5
    registry = build_registry()
    from xmcbench.runs import component, plan as planning, splits, whole

    source = "".join(inspect.getsource(module) for module in (planning, splits, component, whole, launch))
    assert not [name for name in registry.datasets if name in source]
    assert registry.default_dataset() == "debian-debtags-mini"   # marked by xmcbench's own datasets plugin


def test_a_method_that_names_no_component_is_refused_in_one_line(tiny_dataset):
    from xmcbench.config import MethodSpec

    plugin = SimpleNamespace(xmcbench_register_methods=hookimpl(
        lambda registry: registry.add_method(MethodSpec("bare", "names no component"))))
    registry = build_registry(extra_plugins=[("bare", plugin)])
    with pytest.raises(XmcError, match="the method bare names no encoder: .*--set encoder=NAME"):
        plan_run(registry, "bare", str(tiny_dataset))


def test_without_a_marked_dataset_a_run_asks_for_one():
    registry = build_registry()
    registry.datasets = {name: entry for name, entry in registry.datasets.items() if not entry.value.is_default}
    with pytest.raises(XmcError, match="give --dataset NAME_OR_PATH"):
        registry.default_dataset()


def test_config_does_not_import_the_registry():
    code = "import sys, xmcbench.config; print('xmcbench.registry' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_swa_average_holds_the_live_models_buffers():
    """A buffer training moves (lightxml's hold_prior centre, a running mean) must reach the averaged model that
    selection scores and the run keeps: torch's AveragedModel (use_buffers=False) copies the live buffers at every
    update and averages only the parameters."""
    import torch

    from xmcbench.callbacks import StochasticWeightAveraging

    model = torch.nn.Linear(2, 1)
    model.register_buffer("running_mean", torch.zeros(2))
    averaging = StochasticWeightAveraging(model, TrainConfig(swa_start_epoch=0, swa_every_steps=1))
    trainer = SimpleNamespace(epoch=0, step=1, log=SimpleNamespace(swa_updates=0))
    averaging.on_step_end(trainer)
    model.running_mean.fill_(3.0)
    with torch.no_grad():
        model.weight.fill_(1.0)
    trainer.step = 2
    averaging.on_step_end(trainer)
    averaged = averaging.averaged_model()
    assert torch.equal(averaged.running_mean, torch.full((2,), 3.0))
    assert not torch.equal(averaged.weight, model.weight), "parameters are still averaged"
    assert trainer.log.swa_updates == 2
