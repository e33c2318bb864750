"""What every score rests on and what users compare with: the eval_ks setting, one propensity definition for
runs, `evaluate` and ensembles, predictions.npz, and scoring predictions made outside xmcbench.

Runs use the toy whole method of test_whole_methods (word votes: fitting is instant)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tests.test_whole_methods import votes_plugin
from xmcbench import api, compare, ensemble, report
from xmcbench.cli import app
from xmcbench.config import MethodSpec, TrainConfig, parse_ks, resolve_config
from xmcbench.data import load_dataset_from_path
from xmcbench.errors import XmcError
from xmcbench.metrics import propensity_scores
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.saved import rescore_run
from xmcbench.scoring import evaluate_predictions, label_document_counts, propensities

cli = CliRunner()
PROPENSITY_METRICS = [f"{family}@{k}" for family in ("PSP", "PSnDCG", "PSR") for k in (1, 3, 5)]


@pytest.fixture(scope="module")
def registry():
    return build_registry(extra_plugins=[("votes", votes_plugin())], load_entry_points=False)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny", train=60, test=20)


def run_votes(registry, dataset_dir, output, *options, seed=0):
    plan = plan_run(registry, "votes", str(dataset_dir), set_options=["validation_size=12", *options],
                           seed=seed)
    return launch.run(plan, output, registry=registry, log=lambda line: None)


@pytest.fixture(scope="module")
def run_dirs(registry, dataset_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    return [run_votes(registry, dataset_dir, folder / f"seed{seed}", seed=seed) for seed in (0, 1)]


# -- eval_ks ----------------------------------------------------------------------------------------

def test_eval_ks_parses_like_the_other_settings_and_raises_top_k():
    spec = MethodSpec("m", "")
    config = resolve_config(spec, "d", set_options=["eval_ks=10, 1,3,5,100,5"])
    assert config.eval_ks == (1, 3, 5, 10, 100) and config.top_k == 100   # sorted, distinct; top_k follows
    assert resolve_config(spec, "d").eval_ks == (1, 3, 5) and resolve_config(spec, "d").top_k == 10
    assert TrainConfig.from_dict({"eval_ks": [1, 20], "top_k": 20}).eval_ks == (1, 20)   # as config.json has it
    assert parse_ks([3, 1], "eval_ks", "x") == (1, 3)
    for bad in ("0,1", "1,a", "", "1.5", "true"):
        with pytest.raises(XmcError) as error:
            resolve_config(spec, "d", set_options=[f"eval_ks={bad}"])
        assert "eval_ks must be a list of positive integers" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(XmcError, match="between 1 and 1000"):
        resolve_config(spec, "d", set_options=["eval_ks=1,5000"])
    with pytest.raises(XmcError, match="top_k=10 keeps fewer labels than eval_ks asks for"):
        TrainConfig.from_dict({"eval_ks": [1, 20]})
    with pytest.raises(XmcError, match="propensity_a=-1.0 is out of range"):
        resolve_config(spec, "d", set_options=["propensity_a=-1"])


def test_result_keys_of_runs_saved_before_the_scoring_settings_stay_the_same(registry, dataset_dir):
    from xmcbench.storage import fingerprint

    plan = plan_run(registry, "votes", str(dataset_dir), set_options=["validation_size=12"])
    before = {key: value for key, value in plan.config.to_dict().items()
              if key not in ("eval_ks", "propensity_a", "propensity_b", "loggers", "tree_levels", "level_top",
                             "score_combiner", "ranker_weight", "zero_shot_labels", "indexer", "validation_split",
                             "tail_alpha")}
    assert compare.legacy_result_key(registry, plan, "v1") == fingerprint("votes", before, [{
        "name": "joint", "trains": ("encoder", "ranker_encoder", "recaller", "ranker"), "losses": ("recall", "rank"),
        "epochs_key": "epochs", "start": None}], "v1")
    deeper = plan_run(registry, "votes", str(dataset_dir), set_options=["validation_size=12", "eval_ks=1,10"])
    assert compare.legacy_result_key(registry, deeper, "v1") != compare.legacy_result_key(registry, plan, "v1")
    slotted = plan_run(registry, "votes", str(dataset_dir), set_options=["validation_size=12", "tail_alpha=1"])
    assert compare.result_key(registry, slotted, "v1") != compare.result_key(registry, plan, "v1")


def test_a_run_scores_at_its_eval_ks(registry, dataset_dir, tmp_path):
    run_dir = run_votes(registry, dataset_dir, tmp_path / "deep", "eval_ks=1,3,5,10,20")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert {"P@20", "R@20", "PSR@20", "nDCG@10", "PSnDCG@20"} <= set(metrics)
    assert json.loads((run_dir / "config.json").read_text())["config"]["top_k"] == 20
    assert load_file(str(run_dir / "predictions.safetensors"))["labels"].shape[1] == 20
    assert metrics["frequency_bins"]["k"] == 5   # the head/tail split stays at P@5
    # evaluate rescores at other cut-offs with --set, and refuses settings that are not about scoring
    again = saved_models.evaluate(run_dir, registry=registry, set_options=["eval_ks=2,30"])
    assert "R@30" in again and "P@5" not in again
    with pytest.raises(XmcError, match="evaluate takes only the scoring settings"):
        saved_models.evaluate(run_dir, registry=registry, set_options=["epochs=3"])


# -- one propensity definition ------------------------------------------------------------------------

def test_run_evaluate_and_ensemble_use_one_propensity_definition(run_dirs, registry, dataset_dir, tmp_path):
    """A run with a validation split trains on 48 of 60 documents; its PSP@k, PSnDCG@k and PSR@k still use
    the frequencies of all 60, like `xmcbench evaluate` of the same model and like ensembles."""
    recorded = json.loads((run_dirs[0] / "metrics.json").read_text())
    assert recorded["propensity"]["train_documents"] == 60
    assert (recorded["propensity"]["a"], recorded["propensity"]["b"]) == (0.55, 1.5)
    evaluated = saved_models.evaluate(run_dirs[0], registry=registry)
    for key in PROPENSITY_METRICS + ["P@5", "R@5"]:
        assert evaluated[key] == pytest.approx(recorded[key]), key
    assert evaluated["frequency_bins"] == recorded["frequency_bins"]
    dataset = load_dataset_from_path(dataset_dir)
    counts = label_document_counts(dataset.train_labels)
    weights = propensities(dataset)
    assert np.allclose(weights.inverse, 1.0 / propensity_scores(counts, 60, 0.55, 1.5))
    # an ensemble of a run with itself ranks like the run: the same metrics, whichever rows its members used
    other = ensemble.read_member(run_dirs[1])
    scored = ensemble._score(load_file(str(run_dirs[0] / "predictions.safetensors"))["labels"], dataset,
                             [ensemble.read_member(run_dirs[0]), other])
    for key in PROPENSITY_METRICS:
        assert scored[key] == pytest.approx(recorded[key]), key


def test_propensity_settings_override_the_datasets_a_and_b(registry, dataset_dir, tmp_path):
    run_dir = run_votes(registry, dataset_dir, tmp_path / "amazon-like", "propensity_a=0.6", "propensity_b=2.6")
    recorded = json.loads((run_dir / "metrics.json").read_text())["propensity"]
    assert (recorded["a"], recorded["b"], recorded["train_documents"]) == (0.6, 2.6, 60)
    dataset = load_dataset_from_path(dataset_dir)
    config = TrainConfig(propensity_a=0.6, propensity_b=2.6)
    assert np.allclose(propensities(dataset, config).inverse, 1.0 / propensity_scores(
        label_document_counts(dataset.train_labels), 60, 0.6, 2.6))


# -- predictions.npz and scoring predictions made elsewhere -----------------------------------------------

def test_runs_and_ensembles_write_predictions_npz(run_dirs, registry, tmp_path):
    saved = load_file(str(run_dirs[0] / "predictions.safetensors"))
    matrix = sp.load_npz(run_dirs[0] / "predictions.npz")
    names = json.loads((run_dirs[0] / "predictions_labels.json").read_text())
    assert names == json.loads((run_dirs[0] / "model" / "labels.json").read_text())
    assert matrix.format == "csr" and matrix.shape == (20, len(names)) and matrix.dtype == np.float32
    for row in range(20):
        kept = saved["labels"][row] >= 0
        assert dict(zip(matrix[row].indices, matrix[row].data)) == \
            dict(zip(saved["labels"][row][kept], saved["scores"][row][kept]))
    built = ensemble.build_ensemble(run_dirs, tmp_path / "ens", registry=registry, log=lambda line: None)
    fused = load_file(str(built / "predictions.safetensors"))
    matrix = sp.load_npz(built / "predictions.npz")
    assert matrix.shape[0] == 20 and matrix.nnz == int((fused["labels"] >= 0).sum())
    assert json.loads((built / "metrics.json").read_text())["propensity"]["train_documents"] == 60


def test_evaluate_predictions_scores_any_systems_matrix_like_a_run(run_dirs, dataset_dir, tmp_path):
    recorded = json.loads((run_dirs[0] / "metrics.json").read_text())
    # xmcbench's own file, its column names read from the file beside it
    metrics, _, _ = evaluate_predictions(run_dirs[0] / "predictions.npz", str(dataset_dir))
    for key in ("P@1", "P@5", "nDCG@3", "R@5") + tuple(PROPENSITY_METRICS):
        assert metrics[key] == pytest.approx(recorded[key]), key
    # an outside system with its own column order, named by --labels (one name per line); its scores are the
    # run's ranks, so that no tie is broken by column order
    names = json.loads((run_dirs[0] / "predictions_labels.json").read_text())
    saved = load_file(str(run_dirs[0] / "predictions.safetensors"))
    ranks = np.where(saved["labels"] >= 0, saved["labels"].shape[1] - np.arange(saved["labels"].shape[1]), 0)
    rows = np.repeat(np.arange(20), saved["labels"].shape[1])
    kept = saved["labels"].ravel() >= 0
    matrix = sp.csr_matrix((ranks.ravel()[kept], (rows[kept], saved["labels"].ravel()[kept])), shape=(20, len(names)))
    permutation = np.random.default_rng(0).permutation(len(names))   # new column j holds old column permutation[j]
    matrix = matrix[:, permutation].tocsr()
    external = tmp_path / "external"
    external.mkdir()
    sp.save_npz(external / "scores.npz", matrix)
    (external / "names.txt").write_text("\n".join(names[i] for i in permutation) + "\n")
    metrics, _, _ = evaluate_predictions(external / "scores.npz", str(dataset_dir),
                                                labels_file=external / "names.txt")
    assert metrics["PSP@5"] == pytest.approx(recorded["PSP@5"]) and metrics["P@1"] == pytest.approx(recorded["P@1"])
    # without names, the columns are the dataset's label ids: the permuted matrix then scores differently
    unnamed, _, _ = evaluate_predictions(external / "scores.npz", str(dataset_dir))
    assert unnamed["P@1"] != pytest.approx(recorded["P@1"])


@pytest.mark.parametrize("shape, names, message", [
    ((19, 8), None, "has 19 rows but the test split of tiny has 20 documents"),
    ((20, 3), None, "has 3 columns but tiny has"),
    ((20, 2), ["a"], "names 1 labels but"),
    ((20, 2), ["a", "a"], "names a label twice"),
])
def test_evaluate_predictions_refuses_mismatched_shapes_in_one_line(dataset_dir, tmp_path, shape, names, message):
    path = tmp_path / "scores.npz"
    sp.save_npz(path, sp.random(*shape, density=0.3, format="csr", random_state=0))
    labels_file = None
    if names is not None:
        labels_file = tmp_path / "names.json"
        labels_file.write_text(json.dumps(names))
    with pytest.raises(XmcError) as error:
        evaluate_predictions(path, str(dataset_dir), labels_file=labels_file)
    assert message in str(error.value) and "\n" not in str(error.value)
    (tmp_path / "not.npz").write_text("hello")
    with pytest.raises(XmcError, match="is not a sparse matrix saved with scipy.sparse.save_npz"):
        evaluate_predictions(tmp_path / "not.npz", str(dataset_dir))


def test_evaluate_command_puts_an_external_system_in_the_report(run_dirs, dataset_dir, tmp_path):
    output = tmp_path / "external-run"
    result = cli.invoke(app, ["evaluate", "--predictions", str(run_dirs[0] / "predictions.npz"), "--dataset",
                              str(dataset_dir), "--name", "pecos-xr", "--output", str(output),
                              "--set", "eval_ks=1,3,5,10"])
    assert result.exit_code == 0, result.output
    assert "P@1" in result.stdout and "PSR@10" in result.stdout and str(output) in result.stdout
    config = json.loads((output / "config.json").read_text())
    assert config["method"] == "external:pecos-xr" and config["config"]["eval_ks"] == [1, 3, 5, 10]
    runs = report.load_runs([output, *run_dirs], log=lambda line: None)
    rows = {row["method"]: row for row in report.summarize(runs)}
    assert rows["external:pecos-xr"]["stats"]["PSP@5"]["mean"] == pytest.approx(
        json.loads((run_dirs[0] / "metrics.json").read_text())["PSP@5"])
    neither = cli.invoke(app, ["evaluate"])
    assert isinstance(neither.exception, XmcError) and "a run directory or --predictions" in str(neither.exception)
    no_dataset = cli.invoke(app, ["evaluate", "--predictions", str(run_dirs[0] / "predictions.npz")])
    assert "--predictions needs --dataset" in str(no_dataset.exception)


def test_predict_passes_ids_through_and_drops_labels_below_a_threshold(run_dirs, registry, tmp_path, monkeypatch):
    monkeypatch.setattr(api, "build_registry", lambda: registry)   # what `predict` loads the model with
    texts = tmp_path / "texts.txt"
    texts.write_text("python interpreter module\nsql query\n")
    ids = tmp_path / "ids.txt"
    ids.write_text("doc-7\ndoc-9\n")
    result = cli.invoke(app, ["predict", str(run_dirs[0]), "--input", str(texts), "--ids", str(ids), "--top-k", "5"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["id"] for row in rows] == ["doc-7", "doc-9"] and list(rows[0]) == ["id", "labels", "scores"]
    cut = sorted(rows[0]["scores"])[len(rows[0]["scores"]) // 2]
    kept = cli.invoke(app, ["predict", str(run_dirs[0]), "--input", str(texts), "--threshold", str(cut)])
    first = json.loads(kept.stdout.splitlines()[0])
    assert first["scores"] and min(first["scores"]) >= cut
    assert first["labels"] == [label for label, value in zip(rows[0]["labels"], rows[0]["scores"]) if value >= cut]
    ids.write_text("only-one\n")
    short = cli.invoke(app, ["predict", str(run_dirs[0]), "--input", str(texts), "--ids", str(ids)])
    assert isinstance(short.exception, XmcError) and "has 1 lines but there are 2 texts" in str(short.exception)


# -- rescore ----------------------------------------------------------------------------------------

def test_rescore_scores_saved_predictions_again_without_the_model(registry, dataset_dir, tmp_path):
    """A run scored under an older definition (here: PSP from its own training rows, no PSR) gets the metrics
    a run of this version writes, from its saved predictions alone: the model files may be gone."""
    import shutil

    run_dir = run_votes(registry, dataset_dir, tmp_path / "run")
    written = json.loads((run_dir / "metrics.json").read_text())
    old = {key: value for key, value in written.items() if not key.startswith("PSR") and key != "propensity"}
    old.update({"PSP@5": 1.0, "coverage": 77.0})
    (run_dir / "metrics.json").write_text(json.dumps(old))
    shutil.rmtree(run_dir / "model" / "method")
    (run_dir / "predictions.npz").unlink()

    rescored = rescore_run(run_dir, registry=registry, log=lambda line: None)
    assert json.loads((run_dir / "metrics.json").read_text()) == json.loads(json.dumps(rescored))
    for key in ("P@1", "PSP@5", "PSR@3", "nDCG@5"):
        assert rescored[key] == pytest.approx(written[key]), key
    assert rescored["propensity"] == written["propensity"] and rescored["frequency_bins"] == written["frequency_bins"]
    assert rescored["coverage"] == 77.0 and "rescored" in rescored   # kept: coverage needs the model's clusters
    assert (run_dir / "predictions.npz").is_file()


def test_rescore_refuses_what_is_not_a_finished_run_in_one_line(tmp_path):
    from tests.test_bad_input import assert_one_line_error, xmcbench

    assert_one_line_error(xmcbench("rescore", str(tmp_path)), "is not a finished run with saved predictions")
