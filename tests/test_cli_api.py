"""`xmcbench run`, `predict` and `evaluate` are a thin layer over the Python API (xmcbench.api): each command
calls the API with what its options say, so a script can do everything the commands do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import xmcbench.api
from xmcbench.cli import app
from xmcbench.formats import FormatOptions

cli = CliRunner()


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """Recording fakes for the API functions the commands call; each call appends (name, args, kwargs)."""
    recorded = []
    run_dir = tmp_path / "run"

    def fake_train(*args, **kwargs):
        recorded.append(("train", args, kwargs))
        kwargs["log"]("a progress line")
        run_dir.mkdir(exist_ok=True)
        (run_dir / "timings.json").write_text(json.dumps({"train_seconds": 1.0, "train_ms_per_document": 2.0,
                                                          "predict_ms_per_document": 3.0}))
        return xmcbench.api.Run(run_dir, {"P@1": 50.0, "dataset": "d"}, {})

    def fake_resolved_config(*args, **kwargs):
        recorded.append(("resolved_config", args, kwargs))
        return {"method": args[0], "epochs": 1}

    class FakePredictor:
        def predict(self, *args):
            recorded.append(("predict", args, {}))
            return [{"labels": ["b", "a"], "scores": [0.5, 0.25]}, {"labels": [], "scores": []}]

    def fake_load(*args, **kwargs):
        recorded.append(("load", args, kwargs))
        return FakePredictor()

    def fake_evaluate(*args, **kwargs):
        recorded.append(("evaluate", args, kwargs))
        return {"P@1": 40.0}

    def fake_evaluate_predictions(*args, **kwargs):
        recorded.append(("evaluate_predictions", args, kwargs))
        return {"P@1": 30.0}

    for name, fake in [("train", fake_train), ("resolved_config", fake_resolved_config), ("load", fake_load),
                       ("evaluate", fake_evaluate), ("evaluate_predictions", fake_evaluate_predictions)]:
        monkeypatch.setattr(xmcbench.api, name, fake)
    return recorded


def test_run_calls_train_with_every_option(calls, tmp_path):
    output = tmp_path / "run"
    result = cli.invoke(app, ["run", "lightxml", "--dataset", "data/x.csv", "--set", "epochs=1", "--set",
                              "options.a=2", "--seed", "3", "--threads", "2", "--text-column", "body",
                              "--config", "c.toml", "--data-dir", "dd", "--output", str(output), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert [name for name, _, _ in calls] == ["train"]
    _, args, kwargs = calls[0]
    log = kwargs.pop("log")
    assert args == ("lightxml", "data/x.csv")
    assert kwargs == {"output": output, "overwrite": True, "seed": 3, "reading": FormatOptions(text_column="body"),
                      "config_file": Path("c.toml"), "data_dir": Path("dd"), "set_options": ["epochs=1", "options.a=2"],
                      "resume": None, "threads": 2}
    assert callable(log) and "a progress line" in result.output
    assert "P@1" in result.output and f"run directory: {output}" in result.output


def test_run_print_config_and_resume_go_through_the_api(calls, tmp_path):
    printed = cli.invoke(app, ["run", "lightxml", "--print-config"])
    assert printed.exit_code == 0, printed.output
    assert json.loads(printed.output) == {"method": "lightxml", "epochs": 1}
    assert calls[0] == ("resolved_config", ("lightxml", None),
                        {"seed": None, "reading": FormatOptions(), "config_file": None, "data_dir": None,
                         "set_options": [], "resume": None})

    resumed = cli.invoke(app, ["run", "--resume", str(tmp_path / "run")])
    assert resumed.exit_code == 0, resumed.output
    name, args, kwargs = calls[1]
    assert name == "train" and args == (None, None)
    assert kwargs["resume"] == tmp_path / "run" and kwargs["output"] is None and kwargs["set_options"] == []


def test_predict_calls_load_then_predict(calls, tmp_path):
    texts, ids = tmp_path / "texts.txt", tmp_path / "ids.txt"
    texts.write_text("first text\nsecond text\n")
    ids.write_text("d1\nd2\n")
    result = cli.invoke(app, ["predict", "some/run", "--input", str(texts), "--ids", str(ids), "--top-k", "2",
                              "--threshold", "0.1"])
    assert result.exit_code == 0, result.output
    assert calls == [("load", (Path("some/run"),), {"threads": None}),
                     ("predict", (["first text", "second text"], 2, 0.1), {})]
    assert result.output == ('{"id": "d1", "labels": ["b", "a"], "scores": [0.5, 0.25]}\n'
                             '{"id": "d2", "labels": [], "scores": []}\n')


def test_evaluate_calls_evaluate_for_runs_and_evaluate_predictions_for_matrices(calls, tmp_path):
    result = cli.invoke(app, ["evaluate", "some/run", "--dataset", "data/x.csv", "--text-column", "body",
                              "--data-dir", "dd", "--set", "eval_ks=1,3"])
    assert result.exit_code == 0, result.output
    assert calls[0] == ("evaluate", (Path("some/run"), "data/x.csv", FormatOptions(text_column="body")),
                        {"data_dir": Path("dd"), "set_options": ["eval_ks=1,3"]})
    assert "P@1" in result.output

    external = cli.invoke(app, ["evaluate", "--predictions", "p.npz", "--dataset", "d", "--labels", "l.json",
                                "--name", "sys", "--output", str(tmp_path / "ext")])
    assert external.exit_code == 0, external.output
    assert calls[1] == ("evaluate_predictions", (Path("p.npz"), "d"),
                        {"labels_file": Path("l.json"), "reading": FormatOptions(), "data_dir": None,
                         "output": tmp_path / "ext", "name": "sys", "set_options": []})
    assert f"run-like directory for `xmcbench report`: {tmp_path / 'ext'}" in external.output


def test_resolved_config_is_what_the_config_command_prints():
    printed = json.loads(cli.invoke(app, ["config", "lightxml", "--dataset", "wiki500k", "--set", "epochs=2"]).output)
    as_json = lambda config: json.loads(json.dumps(config))  # noqa: E731  (tuples print as lists)
    assert as_json(xmcbench.api.resolved_config("lightxml", "wiki500k", set_options=["epochs=2"])) == printed
    assert as_json(xmcbench.api.resolved_config("lightxml", "wiki500k", epochs=2)) == printed


def test_train_refuses_what_a_resumed_run_cannot_take(tmp_path):
    with pytest.raises(xmcbench.api.XmcError, match="resume takes only the run directory, not settings"):
        xmcbench.api.train(resume=tmp_path, epochs=2)
    with pytest.raises(xmcbench.api.XmcError, match="name a method"):
        xmcbench.api.train(data="debian-debtags-mini")
