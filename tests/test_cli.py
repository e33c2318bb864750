"""The command line: thin commands over runner functions, one-line errors."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from xmcbench.cli import app


cli = CliRunner()


def xmcbench(*args, input=None):
    return subprocess.run([sys.executable, "-m", "xmcbench", *args], capture_output=True, text=True, input=input)


def test_plugins_lists_the_builtin_plugin_with_its_package():
    result = cli.invoke(app, ["plugins"])
    assert result.exit_code == 0
    assert "lightxml" in result.output and "xmcbench" in result.output and "sampler 'dynamic'" in result.output


def test_datasets_lists_sizes_and_presence():
    result = cli.invoke(app, ["datasets"])
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.output.splitlines()[2:]}
    assert "embedded" in lines["debian-debtags-mini"] and "4,244" in lines["debian-debtags-mini"]
    assert lines["wiki500k"].split()[4] == "no"


def test_config_prints_the_resolved_preset_and_overrides():
    result = cli.invoke(app, ["config", "lightxml", "--dataset", "wiki500k", "--set", "epochs=2"])
    assert result.exit_code == 0
    config = json.loads(result.output)
    assert config["num_clusters"] == 8192 and config["top_clusters"] == 32 and config["hidden_size"] == 500
    assert config["batch_size"] == 32 and config["max_length"] == 128 and config["epochs"] == 2
    assert config["model_name"] == "bert-base-uncased"   # the paper's encoder, not the offline default
    default = json.loads(cli.invoke(app, ["run", "lightxml", "--print-config"]).output)
    assert default["dataset"] == "debian-debtags-mini" and default["num_layers"] == 5


def test_version_and_help_start_without_the_heavy_libraries():
    assert xmcbench("--version").stdout.strip().startswith("xmcbench ")
    probe = ("import sys\nfrom xmcbench.cli import app\n"
             "for args in (['--help'], ['--version'], ['run', '--help']):\n"
             "    try:\n        app(args)\n    except SystemExit:\n        pass\n"
             "print(sorted(name for name in ('torch', 'transformers', 'sklearn') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("args, message", [
    (["run", "lightxm"], "unknown method 'lightxm': did you mean 'lightxml'"),
    (["run", "lightxml", "--set", "epoch=3", "--print-config"], "unknown setting 'epoch': did you mean 'epochs'"),
    (["run", "lightxml", "--set", "epochs=three", "--print-config"], "epochs must be int, got 'three'"),
    (["run", "lightxml", "--dataset", "wiki500k", "--data-dir", "/nonexistent"], "dataset 'wiki500k' not found"),
    (["predict", "/nonexistent-run"], "/nonexistent-run does not exist"),
])
def test_user_errors_end_in_one_line(args, message):
    result = xmcbench(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert message in result.stderr


@pytest.mark.slow
def test_run_then_predict_and_evaluate(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    settings = [f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1",
                "max_length=32", "threads=1", "cluster_size=2", "top_clusters=2", "hidden_size=8"]
    args = ["run", "lightxml", "--dataset", str(tiny_dataset), "--output", str(run_dir), "--seed", "3"]
    for setting in settings:
        args += ["--set", setting]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "P@1" in result.output and "coverage" in result.output
    assert json.loads((run_dir / "config.json").read_text())["config"]["seed"] == 3

    again = xmcbench(*args)
    assert again.returncode == 2 and "already holds a finished run" in again.stderr

    predicted = xmcbench("predict", str(run_dir), "--top-k", "3", input="python interpreter module\nsql query\n")
    assert predicted.returncode == 0, predicted.stderr
    rows = [json.loads(line) for line in predicted.stdout.splitlines()]
    assert len(rows) == 2 and all(len(r["labels"]) == 3 == len(r["scores"]) for r in rows)
    threaded = cli.invoke(app, ["predict", str(run_dir), "--top-k", "3", "--threads", "2"],
                          input="python interpreter module\nsql query\n")
    assert threaded.exit_code == 0, threaded.output
    assert [json.loads(line)["labels"] for line in threaded.stdout.splitlines()] == [r["labels"] for r in rows]
    assert torch.get_num_threads() == 2, "predict --threads sets torch's threads (the model trained with 1)"

    evaluated = cli.invoke(app, ["evaluate", str(run_dir)])
    assert evaluated.exit_code == 0 and "P@1" in evaluated.output
