"""Interruptions: SIGKILL mid-epoch or mid-checkpoint, Ctrl-C and a NaN loss, then --resume; and
determinism: the same seed gives the same metrics and weights."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

# 48 training documents, batch 8: 6 steps an epoch, 18 in all; SWA and validation both active
SETTINGS = ["num_layers=2", "pretrained_weights=false", "epochs=3", "batch_size=8", "max_length=32",
            "hidden_size=8", "cluster_size=2", "top_clusters=2", "lr=1e-3", "swa_start_epoch=1",
            "swa_every_steps=2", "validation_size=8", "checkpoint_every_steps=2", "threads=1"]

DRIVER = textwrap.dedent("""
    import os, signal, sys
    from xmcbench import checkpoint, training
    from xmcbench.cli import main
    action, at_step = sys.argv[1], int(sys.argv[2])
    original_step, original_save = training.Trainer.train_step, checkpoint.save_file

    def train_step(self, rows, stage):
        if action == "nan" and self.step + 1 == at_step:
            original_loss = self.model.training_loss
            self.model.training_loss = lambda *a, **k: (original_loss(*a, **k)[0] * float("nan"), {})
        record = original_step(self, rows, stage)
        if self.step == at_step and action in ("kill", "interrupt"):
            os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGINT)
        return record

    def save_file(tensors, path):
        if action == "kill-while-saving" and f"step-{at_step:08d}" in path:
            with open(path, "wb") as half:
                half.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save(tensors, path)

    training.Trainer.train_step, checkpoint.save_file = train_step, save_file
    sys.argv = ["xmcbench"] + sys.argv[3:]
    main()
""")


def run_args(model_dir, dataset, output):
    args = ["run", "lightxml", "--dataset", str(dataset), "--output", str(output), "--seed", "1"]
    for setting in SETTINGS + [f"model_name={model_dir}"]:
        args += ["--set", setting]
    return args


def xmcbench(*args, driver=None):
    command = [sys.executable, "-c", DRIVER, *driver] if driver else [sys.executable, "-m", "xmcbench"]
    return subprocess.run(command + list(args), capture_output=True, text=True, env={**os.environ})


def outcome(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    weights = load_file(str(run_dir / "model" / "weights.safetensors"))
    losses = [s["loss"] for s in json.loads((run_dir / "training_log.json").read_text())["steps"]]
    return metrics, weights, losses


def assert_same(a, b):
    assert a[0] == b[0], "metrics differ"
    assert a[2] == b[2], "loss curves differ"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    from xmcbench.testing import write_tiny_dataset

    root = tmp_path_factory.mktemp("resume")
    dataset = write_tiny_dataset(root / "tiny-topics")
    result = xmcbench(*run_args(tiny_model_dir, dataset, root / "reference"))
    assert result.returncode == 0, result.stderr
    return dataset, outcome(root / "reference")


def test_same_seed_gives_identical_metrics_and_weights(reference, tiny_model_dir, tmp_path):
    dataset, expected = reference
    assert xmcbench(*run_args(tiny_model_dir, dataset, tmp_path / "again")).returncode == 0
    assert_same(outcome(tmp_path / "again"), expected)


@pytest.mark.parametrize("action, at_step, resumes_from", [
    ("kill", 9, 8),                 # SIGKILL in the middle of epoch 2, one step after a checkpoint
    ("kill-while-saving", 10, 8),   # SIGKILL while checkpoint 10 is half written: 8 is used
    ("interrupt", 5, 5),            # Ctrl-C: checkpoint after the current step, then a clean stop
])
def test_resume_continues_exactly(reference, tiny_model_dir, tmp_path, action, at_step, resumes_from):
    dataset, expected = reference
    output = tmp_path / "run"
    stopped = xmcbench(*run_args(tiny_model_dir, dataset, output), driver=[action, str(at_step)])
    if action == "interrupt":
        assert stopped.returncode == 130
        last = stopped.stderr.strip().splitlines()[-1]
        assert f"interrupted at step {at_step}" in last and f"xmcbench run --resume {output}" in last
        assert "Ctrl-C: stopping after the current training step, with a checkpoint" in stopped.stderr
    else:
        assert stopped.returncode == -signal.SIGKILL
    assert not (output / "metrics.json").exists()
    pointer = json.loads((output / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == resumes_from

    refused = xmcbench(*run_args(tiny_model_dir, dataset, output))
    assert refused.returncode == 2 and "holds an unfinished run" in refused.stderr

    resumed = xmcbench("run", "--resume", str(output))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {output} at step {resumes_from}" in resumed.stderr
    assert_same(outcome(output), expected)
    assert not (output / "checkpoints").exists(), "the finished run drops its training checkpoint"


def test_resume_takes_this_process_threads_and_keeps_the_run_settings(reference, tiny_model_dir, tmp_path):
    dataset, _ = reference
    output = tmp_path / "run"
    assert xmcbench(*run_args(tiny_model_dir, dataset, output), driver=["interrupt", "5"]).returncode == 130
    recorded = json.loads((output / "config.json").read_text())
    assert recorded["config"]["threads"] == 1

    resumed = xmcbench("run", "--resume", str(output), "--threads", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert "device cpu, 2 threads" in resumed.stderr
    assert json.loads((output / "config.json").read_text()) == recorded, "the run's settings and key stay its own"
    assert (output / "metrics.json").exists()
    refused = xmcbench("run", "--resume", str(output), "--seed", "2")
    assert refused.returncode == 2 and "--resume takes only the run directory (and --threads)" in refused.stderr


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(reference, tiny_model_dir, tmp_path):
    dataset, _ = reference
    output = tmp_path / "run"
    result = xmcbench(*run_args(tiny_model_dir, dataset, output), driver=["nan", "7"])
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("xmcbench: error: training diverged: the loss is nan at step 7") and "Traceback" not in result.stderr
    assert json.loads((output / "checkpoints" / "latest.json").read_text())["step"] == 6


def test_resume_refuses_a_finished_run(reference, tiny_model_dir, tmp_path):
    dataset, _ = reference
    output = tmp_path / "done"
    assert xmcbench(*run_args(tiny_model_dir, dataset, output)).returncode == 0
    result = xmcbench("run", "--resume", str(output))
    assert result.returncode == 2 and "finished run: nothing to resume" in result.stderr


def test_resume_inside_a_later_stage_of_a_static_method(reference, tiny_model_dir, tmp_path):
    """Stage 2 of lightxml-static reads candidates frozen at its start: they must come back from the
    checkpoint, not be recomputed from the half-trained encoder."""
    dataset, _ = reference
    args = lambda output: [a.replace("lightxml", "lightxml-static") if a == "lightxml" else a
                           for a in run_args(tiny_model_dir, dataset, output)]
    assert xmcbench(*args(tmp_path / "static-reference")).returncode == 0
    expected = outcome(tmp_path / "static-reference")
    stages = [s.get("stage") for s in json.loads((tmp_path / "static-reference" / "training_log.json")
                                                 .read_text())["steps"]]
    assert stages[21] == "rank" and stages.count("rank") == 15
    output = tmp_path / "static"
    stopped = xmcbench(*args(output), driver=["kill", "23"])
    assert stopped.returncode == -signal.SIGKILL
    resumed = xmcbench("run", "--resume", str(output))
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 22" in resumed.stderr
    assert_same(outcome(output), expected)
