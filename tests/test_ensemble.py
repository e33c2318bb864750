"""Ensembles of saved runs: the combination rule, the ensemble directory, predict and evaluate on it."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from xmcbench import ensemble, runner
from xmcbench.cli import app
from xmcbench.errors import XmcError
from xmcbench.metrics import format_metrics
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset

cli = CliRunner()
slow = pytest.mark.slow


# -- the rule, on a hand-made example ---------------------------------------------------------------

def test_combine_sums_scores_over_the_union_of_the_members_top_k():
    a_labels = np.array([[3, 1, 0], [7, -1, -1], [-1, -1, -1]])
    a_scores = np.array([[0.9, 0.5, 0.45], [0.5, -1, -1], [-1, -1, -1]], dtype=np.float32)
    b_labels = np.array([[1, 4, 0], [6, -1, -1], [-1, -1, -1]])
    b_scores = np.array([[0.6, 0.55, 0.4], [0.5, -1, -1], [-1, -1, -1]], dtype=np.float32)

    labels, scores = ensemble.combine([a_labels, b_labels], [a_scores, b_scores], top_k=3)
    # row 0: 1 -> .5 + .6, 3 -> .9, 0 -> .45 + .4, 4 -> .55 (fourth: cut); row 1: a tie, lower id first;
    # row 2: nothing predicted, nothing returned
    np.testing.assert_array_equal(labels, [[1, 3, 0], [6, 7, -1], [-1, -1, -1]])
    np.testing.assert_allclose(scores, [[1.1, 0.9, 0.85], [0.5, 0.5, -1], [-1, -1, -1]], rtol=1e-6)
    assert labels.dtype == np.int64 and scores.dtype == np.float32

    # with k = 2 label 0 is outside both members' top-2: it counts 0 for each and drops out; 4 comes in
    labels, scores = ensemble.combine([a_labels, b_labels], [a_scores, b_scores], top_k=2)
    np.testing.assert_array_equal(labels[0], [1, 3])
    labels, scores = ensemble.combine([a_labels[:, :2], b_labels[:, :2]], [a_scores[:, :2], b_scores[:, :2]], top_k=3)
    np.testing.assert_array_equal(labels, [[1, 3, 4], [6, 7, -1], [-1, -1, -1]])
    np.testing.assert_allclose(scores[0], [1.1, 0.9, 0.55], rtol=1e-6)


# -- tiny runs --------------------------------------------------------------------------------------

def tiny_options(model_dir):
    options = {"model_name": str(model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
               "batch_size": 8, "max_length": 32, "threads": 1, "cluster_size": 2, "top_clusters": 2,
               "hidden_size": 8, "lr": 1e-3}
    return [f"{k}={v}" for k, v in options.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Two runs (seeds 1, 2) on one tiny dataset and one on a dataset with another label vocabulary."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        registry = build_registry()
        root = tmp_path_factory.mktemp("ensemble-runs")
        dataset = write_tiny_dataset(root / "tiny-topics")
        other = write_tiny_dataset(root / "other-topics", seed=1)
        for split in ("train", "test"):
            path = other / f"{split}_labels.txt"
            path.write_text(path.read_text().replace("db:sql", "db:sqlite"))

        def train(data, seed, name):
            plan = runner.plan_run(registry, "lightxml", str(data), set_options=tiny_options(tiny_model_dir),
                                   seed=seed)
            return runner.run(plan, root / name, registry=registry, log=lambda line: None)

        yield {"dataset": dataset, "registry": registry, "root": root,
               "members": [train(dataset, 1, "seed1"), train(dataset, 2, "seed2")],
               "other": train(other, 1, "other")}


@slow
def test_ensemble_metrics_from_saved_predictions_equal_evaluate_rescoring(runs, tmp_path):
    members, registry = runs["members"], runs["registry"]
    result = cli.invoke(app, ["ensemble", *map(str, members), "--output", str(tmp_path / "ens")])
    assert result.exit_code == 0, result.output
    directory = tmp_path / "ens"
    saved = json.loads((directory / "metrics.json").read_text())
    floats = {k: v for k, v in saved.items() if isinstance(v, float)}
    assert saved["metrics_from"] == "saved predictions" and saved["members"] == 2 and saved["top_k"] == 10
    assert format_metrics(floats) in result.stdout

    spec = json.loads((directory / "ensemble.json").read_text())
    assert spec["schema"] == 1 and spec["top_k"] == 10 and len(spec["members"]) == 2
    assert all(not m.startswith("/") for m in spec["members"])   # relative: the tree can move as a whole
    config = json.loads((directory / "config.json").read_text())
    assert config["method"] == "ensemble(lightxml+lightxml)"
    assert config["config"]["seed"] == 1 and config["resolved"]["member_seeds"] == [1, 2]
    timings = json.loads((directory / "timings.json").read_text())
    member_timings = [json.loads((m / "timings.json").read_text()) for m in members]
    assert timings["train_seconds"] == pytest.approx(sum(t["train_seconds"] for t in member_timings))
    assert timings["predict_ms_per_document"] == pytest.approx(sum(t["predict_ms_per_document"]
                                                                   for t in member_timings))

    # the saved ranking is the rule applied to the members' saved top-k
    member_predictions = [load_file(str(m / "predictions.safetensors")) for m in members]
    expected, _ = ensemble.combine([p["labels"] for p in member_predictions],
                                   [p["scores"] for p in member_predictions], 10)
    np.testing.assert_array_equal(load_file(str(directory / "predictions.safetensors"))["labels"], expected)

    # re-scoring by predicting with every member model gives the same metrics
    rescored = ensemble.evaluate_ensemble(directory, registry=registry)
    assert rescored == pytest.approx(floats)
    result = cli.invoke(app, ["evaluate", str(directory)])
    assert result.exit_code == 0 and result.stdout.strip() == format_metrics(rescored)

    # building without usable saved predictions (top-k wider than saved) predicts; each member recalls
    # 2 clusters of 2 labels, so lists wider than 4 add nothing and the metrics are the same
    wider = ensemble.build_ensemble(members, tmp_path / "wider", top_k=12, registry=registry, log=lambda line: None)
    wider_metrics = json.loads((wider / "metrics.json").read_text())
    assert wider_metrics["metrics_from"] == "predicted"
    assert {k: v for k, v in wider_metrics.items() if isinstance(v, float)} == pytest.approx(floats)

    # an existing ensemble is replaced only when asked
    with pytest.raises(XmcError, match="already holds an ensemble"):
        ensemble.build_ensemble(members, directory, registry=registry, log=lambda line: None)
    ensemble.build_ensemble(members, directory, overwrite=True, registry=registry, log=lambda line: None)


@slow
def test_predict_with_an_ensemble_returns_k_labels_by_descending_score(runs, tmp_path):
    members, registry = runs["members"], runs["registry"]
    directory = ensemble.build_ensemble(members, tmp_path / "ens", registry=registry, log=lambda line: None)
    texts = (runs["dataset"] / "test_texts.txt").read_text().splitlines()
    results = ensemble.predict_texts(directory, texts, top_k=3, registry=registry)
    names = json.loads((members[0] / "model" / "labels.json").read_text())
    saved = load_file(str(directory / "predictions.safetensors"))
    assert len(results) == len(texts)
    for row, result in enumerate(results):
        assert len(result["labels"]) == 3 and len(set(result["labels"])) == 3
        assert result["scores"] == sorted(result["scores"], reverse=True)
        assert result["labels"] == [names[i] for i in saved["labels"][row][:3]]

    result = cli.invoke(app, ["predict", str(directory), "--top-k", "4"], input=texts[0] + "\n" + texts[1] + "\n")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2 and all(len(line["labels"]) == 4 for line in lines)
    assert lines[0]["labels"][:3] == results[0]["labels"]


@slow
def test_members_with_another_label_vocabulary_fail_in_one_line(runs, tmp_path):
    members, other = runs["members"], runs["other"]
    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble([members[0], other], tmp_path / "ens", registry=runs["registry"])
    message = str(error.value)
    assert "\n" not in message and str(other) in message and "label vocabulary" in message
    assert not (tmp_path / "ens").exists()

    found = subprocess.run([sys.executable, "-m", "xmcbench", "ensemble", str(members[0]), str(other),
                            "--output", str(tmp_path / "ens")], capture_output=True, text=True)
    assert found.returncode == 2
    assert found.stderr.count("\n") == 1 and "label vocabulary" in found.stderr and str(other) in found.stderr


@slow
def test_an_unfinished_member_fails_in_one_line(runs, tmp_path):
    members = runs["members"]
    unfinished = tmp_path / "unfinished"
    shutil.copytree(members[1], unfinished)
    (unfinished / "metrics.json").unlink()
    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble([members[0], unfinished], tmp_path / "ens", registry=runs["registry"])
    message = str(error.value)
    assert "\n" not in message and str(unfinished) in message and "unfinished" in message


@slow
def test_a_member_that_changed_after_building_is_caught(runs, tmp_path):
    members, registry = runs["members"], runs["registry"]
    moved = [tmp_path / "a", tmp_path / "b"]
    for source, target in zip(members, moved):
        shutil.copytree(source, target)
    directory = ensemble.build_ensemble(moved, tmp_path / "ens", registry=registry, log=lambda line: None)
    shutil.rmtree(moved[1])
    shutil.copytree(runs["other"], moved[1])
    with pytest.raises(XmcError, match="label vocabulary"):
        ensemble.predict_texts(directory, ["python module"], registry=registry)
    with pytest.raises(XmcError, match="at least two runs"):
        ensemble.build_ensemble(moved[:1], tmp_path / "one", registry=registry)
