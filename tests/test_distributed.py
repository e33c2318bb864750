"""torchrun with the gloo backend on the CPU: 2 processes sharing each global batch must train like 1 process.

Tolerance: the per-step loss of the 2-process run equals the 1-process loss within 1e-5 (absolute). Only the
order of floating-point sums differs (each process reduces over half the batch, gradients are then
averaged), which moves the loss by ~1e-7 per step on these tiny models; dropout is off so both runs see the
same network. Predictions of the final models must give the same metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmcbench.testing import make_tiny_transformer, write_tiny_dataset

pytestmark = pytest.mark.slow

LOSS_TOLERANCE = 1e-5


def settings(model_dir: Path) -> list[str]:
    values = {"model_name": model_dir, "pretrained_weights": "false", "num_layers": 2, "hidden_size": 8,
              "max_length": 16, "dropout": 0, "cluster_size": 2, "top_clusters": 2, "epochs": 2, "refit_epochs": 1,
              "batch_size": 8, "swa": "false", "threads": 1, "lr": 0.01, "validation_size": 6}
    return [part for key, value in values.items() for part in ("--set", f"{key}={value}")]


def xmcbench_run(method: str, dataset: Path, model_dir: Path, output: Path, processes: int, env: dict) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] \
        if processes > 1 else [sys.executable]
    command = launcher + ["-m", "xmcbench", "run", method, "--dataset", str(dataset), "--output", str(output),
                          *settings(model_dir)]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return {"steps": json.loads((output / "training_log.json").read_text())["steps"],
            "metrics": json.loads((output / "metrics.json").read_text()),
            "config": json.loads((output / "config.json").read_text()),
            "stderr": finished.stderr}


def isolated_environment(tmp_path: Path) -> dict:
    # gloo over the loopback interface: CI machines have no network, and their hostname may not resolve
    return {**os.environ, "XMCBENCH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.parametrize("method", ["lightxml", "lightxml-static"])
def test_two_processes_follow_the_single_process_loss_curve(tmp_path, method):
    model_dir = make_tiny_transformer(tmp_path / "tiny", dropout=0.0)
    # 49 documents, 6 held out for validation: 43 train in batches of 8, so the last batch has 3 documents
    # (uneven shares) and, in the static method's candidate pass, shards differ in size too.
    dataset = write_tiny_dataset(tmp_path / "data", train=49, test=16)
    env = isolated_environment(tmp_path)
    single = xmcbench_run(method, dataset, model_dir, tmp_path / "one", 1, env)
    double = xmcbench_run(method, dataset, model_dir, tmp_path / "two", 2, env)

    assert double["config"]["resolved"]["processes"] == 2
    assert len(single["steps"]) == len(double["steps"]) > 10
    for one, two in zip(single["steps"], double["steps"]):
        assert one["step"] == two["step"]
        for part in ("loss", "recall", "rank"):
            if part in one:
                assert two[part] == pytest.approx(one[part], abs=LOSS_TOLERANCE), (part, one["step"])
    for key in ("P@1", "P@3", "P@5", "coverage"):
        assert double["metrics"][key] == pytest.approx(single["metrics"][key], abs=1e-6)
    # one voice: the run's summary is printed by rank 0 only
    assert double["stderr"].count("documents, ") == 1


def test_last_batch_smaller_than_the_number_of_processes(tmp_path):
    """A final batch of 1 document on 2 processes: one process runs a placeholder whose loss weighs nothing."""
    model_dir = make_tiny_transformer(tmp_path / "tiny", dropout=0.0)
    dataset = write_tiny_dataset(tmp_path / "data", train=23, test=8)   # 17 train after validation: 8 + 8 + 1
    env = isolated_environment(tmp_path)
    single = xmcbench_run("lightxml", dataset, model_dir, tmp_path / "one", 1, env)
    double = xmcbench_run("lightxml", dataset, model_dir, tmp_path / "two", 2, env)
    for one, two in zip(single["steps"], double["steps"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], abs=LOSS_TOLERANCE)


def test_a_non_main_process_ends_without_the_interpreters_finalization(tiny_model_dir, tiny_dataset, tmp_path,
                                                                         monkeypatch):
    """`xmcbench run` in a process other than rank 0 leaves through os._exit(0) once its part is done: in the
    interpreter's finalization such a process aborted now and then, and torchrun then killed rank 0 mid-write."""
    from typer.testing import CliRunner

    from xmcbench.cli import app

    exits = []

    def record_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", record_exit)
    monkeypatch.setenv("RANK", "1")   # WORLD_SIZE unset: the run itself is a single process
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    arguments = ["run", "lightxml", "--dataset", str(tiny_dataset), "--output", str(tmp_path / "run")]
    for key, value in {"model_name": tiny_model_dir, "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
                       "max_length": 16, "threads": 1, "cluster_size": 2, "top_clusters": 2, "hidden_size": 8}.items():
        arguments += ["--set", f"{key}={value}"]
    result = CliRunner().invoke(app, arguments)
    assert exits == [0] and result.exit_code == 0, result.output
    assert "P@1" not in result.output, "process 0 reports; the others stay silent"
