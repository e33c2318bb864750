"""`xmcbench compare`: cells trained once, reused by hash, reported side by side."""

import json

import pytest
from typer.testing import CliRunner

from xmcbench import runner
from xmcbench.cli import app, expand_seeds

pytestmark = pytest.mark.slow


def compare_args(model_dir, dataset, output, *extra):
    settings = [f"model_name={model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32",
                "threads=1", "cluster_size=2", "top_clusters=2", "hidden_size=8"]
    args = ["compare", "lightxml", "lightxml-random-neg", "--dataset", str(dataset), "--output", str(output),
            "--seeds", "0", "--seeds", "1", "--baseline", "lightxml", *extra]
    for setting in settings:
        args += ["--set", setting]
    return args


def test_compare_trains_each_cell_once_and_reports(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    cli = CliRunner()
    output = tmp_path / "report"
    result = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble"))
    assert result.exit_code == 0, result.output
    assert len(list((output / "runs").iterdir())) == 4
    assert len(list((output / "ensembles").iterdir())) == 2
    report = (output / "report.md").read_text()
    assert "lightxml-random-neg" in report and "ensemble(" in report and "loss_curves.png" in report
    assert (output / "precision.png").exists()

    def no_training(*args, **kwargs):
        raise AssertionError("a cached cell was trained again")

    monkeypatch.setattr(runner, "run", no_training)
    again = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble"))
    assert again.exit_code == 0, again.output
    assert again.output.count("reusing") == 4

    monkeypatch.undo()
    changed = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--set", "head_lr=0.002"))
    assert changed.exit_code == 0, changed.output
    assert len(list((output / "runs").iterdir())) == 8, "another setting is another result"

    rebuilt = cli.invoke(app, ["report", str(output / "runs"), "--format", "json", "--output", str(tmp_path / "j")])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads((tmp_path / "j" / "table.json").read_text())


def test_seeds_can_be_typed_as_a_list():
    assert expand_seeds(["compare", "a", "--seeds", "0", "1", "2", "-b", "a"]) == \
        ["compare", "a", "--seeds", "0", "--seeds", "1", "--seeds", "2", "-b", "a"]


def test_compare_weighted_ensemble_fuses_the_methods_seed_by_seed(tiny_model_dir, tiny_dataset, tmp_path):
    cli = CliRunner()
    output = tmp_path / "report"
    refused = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble", "--fusion", "weighted"))
    assert refused.exit_code != 0 and "validation_size=0" in str(refused.exception)
    assert "\n" not in str(refused.exception) and not (output / "runs").exists()   # refused before training

    result = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble", "--fusion", "weighted",
                                          "--set", "validation_size=8"))
    assert result.exit_code == 0, result.output
    ensembles = sorted(p.name for p in (output / "ensembles").iterdir())
    assert len(ensembles) == 2 and all(name.startswith("weighted-lightxml+lightxml-random-neg-seed")
                                       for name in ensembles)
    report = (output / "report.md").read_text()
    assert "| weighted-ensemble(lightxml+lightxml-random-neg) |       2 |" in report
    assert "## Ensembles" in report and "seed 0: lightxml" in report and "seed 1: lightxml" in report
    assert "## Head and tail" in report and (output / "frequency_bins.png").exists()

    one = cli.invoke(app, ["compare", "lightxml", "--ensemble", "--fusion", "weighted", "--dataset", str(tiny_dataset),
                           "--output", str(output)])
    assert one.exit_code != 0 and "name at least two methods" in str(one.exception)
