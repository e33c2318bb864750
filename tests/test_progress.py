"""Progress that reaches a log: when stderr is not a terminal, lines at a steady interval during a task."""

import re

import pytest

from xmcbench.errors import XmcError
from xmcbench.progress import progress_bar
from xmcbench.registry import build_registry
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run


def test_lines_at_an_interval_with_rate_eta_and_fields(monkeypatch, capsys):
    monkeypatch.setenv("XMCBENCH_PROGRESS_SECONDS", "0")   # a line at every update
    with progress_bar("epoch 1/2", total=40, unit="documents", completed=8) as advance:
        for step in range(4):
            advance(8, step=f"{step + 2}/5", mean_loss=0.5)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4   # three lines while it runs (not after the last update), then the summary
    assert re.fullmatch(r"epoch 1/2: 16/40 documents \(40%\)  elapsed 0:00  ETA \d+:\d\d  [\d.]+ documents/s  "
                        r"step 2/5  mean_loss 0.5000", lines[0]), lines[0]
    assert lines[-1].startswith("epoch 1/2: 40/40 documents in ")


def test_no_line_before_the_interval(monkeypatch, capsys):
    monkeypatch.setenv("XMCBENCH_PROGRESS_SECONDS", "3600")
    with progress_bar("predicting", total=10) as advance:
        advance(5)
        advance(5)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("predicting: 10/10 in ")


def test_a_bad_interval_is_one_line(monkeypatch):
    monkeypatch.setenv("XMCBENCH_PROGRESS_SECONDS", "soon")
    with pytest.raises(XmcError, match="XMCBENCH_PROGRESS_SECONDS='soon' must be a number of seconds"):
        with progress_bar("x", total=1):
            pass


@pytest.mark.slow
def test_training_writes_progress_lines_during_an_epoch(monkeypatch, capsys, tiny_model_dir, tiny_dataset, tmp_path):
    monkeypatch.setenv("XMCBENCH_PROGRESS_SECONDS", "0")
    options = {"model_name": str(tiny_model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
               "batch_size": 8, "max_length": 32, "threads": 1}
    registry = build_registry()
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=[f"{k}={v}" for k, v in options.items()])
    launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    lines = capsys.readouterr().err.splitlines()
    epoch = [line for line in lines if line.startswith("epoch 1/1: ")]
    # the flat run's PIFA rows take a pass over the training documents before the epoch: it shows too
    assert any(line.startswith("encoding the training documents for epoch 1: 48/48 documents in ")
               for line in lines[:lines.index(epoch[0])]), lines
    # 48 documents in 6 steps: five lines while the epoch runs, then its summary
    assert len(epoch) == 6
    assert re.match(r"epoch 1/1: 8/48 documents \(17%\)  elapsed \d+:\d\d  ETA \d+:\d\d  [\d.]+ documents/s  "
                    r"step 1/6  mean_loss \d\.\d{4}$", epoch[0]), epoch[0]
    assert epoch[-1].startswith("epoch 1/1: 48/48 documents in ")
