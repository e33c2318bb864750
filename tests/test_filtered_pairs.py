"""Filtered (document, label) pairs: removed from predictions before every score xmcbench computes (a run's
test and validation scoring, a whole method's, `evaluate`, `rescore`, ensembles, `evaluate --predictions`),
as the Extreme Classification Repository's evaluation removes those of filter_labels_*.txt; recorded in
metrics.json and named by the report. The golden test scores predictions fixed by hand on a dataset written
here, against a count made by hand."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from safetensors.numpy import load_file

import xmcbench
from xmcbench import ensemble, report
from xmcbench.runs import component
from xmcbench.config import MethodSpec
from xmcbench.formats import FormatOptions
from xmcbench.hookspecs import hookimpl
from xmcbench.inference import Predictions
from xmcbench.interfaces import WholeMethod
from xmcbench.registry import build_registry
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.config import TrainConfig
from xmcbench.formats import open_dataset
from xmcbench.rundir import reading_of
from xmcbench.runs.plan import plan_run
from xmcbench.saved import rescore_run
from xmcbench.scoring import evaluate_predictions, propensities, room_for_filtered_pairs, score, without_filtered_pairs

# Labels 0-3 (their names are the ids). Test truth: zero {0, 2}, one {1}, two {3}. Filtered test pairs:
# (zero, 1), (one, 1) (a true label: removed all the same), (two, 0), and (two, 2), which no prediction holds.
GOLDEN = {
    "trn_X.txt": "apple\nbanana\ncherry\ndate\n",
    "trn_X_Y.txt": "4 4\n0:1 1:1\n1:1\n2:1\n0:1 3:1\n",
    "tst_X.txt": "zero\none\ntwo\n",
    "tst_X_Y.txt": "3 4\n0:1 2:1\n1:1\n3:1\n",
    "Y.txt": "label zero\nlabel one\nlabel two\nlabel three\n",
    "filter_labels_test.txt": "0 1\n1 1\n2 0\n2 2\n",
}
# What the method below predicts for each test text, best first.
ANSWERS = {"zero": [1, 0, 3, 2], "one": [1, 2, 0, 3], "two": [0, 3, 1]}
# After the filter: zero [0, 3, 2], one [2, 0, 3], two [3, 1]. Hits in the top 1 / 3 / 5: zero 1 / 2 / 2 (0 and
# 2 are true), one 0 / 0 / 0, two 1 / 1 / 1. So P@1 = 2/3, P@3 = 3/9, P@5 = 3/15; R@3 = (2/2 + 0/1 + 1/1) / 3.
# Without the filter P@1 would be 1/3 (one's first label, 1, is true; zero's and two's are not).
BY_HAND = {"P@1": 100 * 2 / 3, "P@3": 100 * 3 / 9, "P@5": 100 * 3 / 15, "R@3": 100 * 2 / 3}
REMOVED = {"listed": 4, "removed": 3}


class FixedAnswers(WholeMethod):
    """Predicts ANSWERS for the test texts and nothing for any other text: predictions fixed by hand."""

    @classmethod
    def fit(cls, train_texts, train_labels, num_labels, config, log):
        return cls()

    def save(self, folder: Path) -> None:
        folder.mkdir()
        (folder / "answers.json").write_text(json.dumps(ANSWERS))

    @classmethod
    def load(cls, folder: Path, config):
        return cls()

    def predict(self, texts, top_k):
        labels = np.full((len(texts), top_k), -1, dtype=np.int64)
        scores = np.full((len(texts), top_k), -1.0, dtype=np.float32)
        for row, text in enumerate(texts):
            answer = ANSWERS.get(text, [])[:top_k]
            labels[row, :len(answer)] = answer
            scores[row, :len(answer)] = np.arange(len(answer), 0, -1)
        return labels, scores


def fixed_plugin() -> types.ModuleType:
    module = types.ModuleType("fixed_answers_plugin")

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("fixed", "answers fixed by hand", whole_method=FixedAnswers))

    module.xmcbench_register_methods = xmcbench_register_methods
    return module


@pytest.fixture(scope="module")
def registry():
    return build_registry(extra_plugins=[("fixed", fixed_plugin())])


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data") / "LF-golden"
    folder.mkdir()
    for name, content in GOLDEN.items():
        (folder / name).write_text(content)
    return folder


@pytest.fixture(scope="module")
def fixed_runs(registry, golden, tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("runs")
    return [launch.run(plan_run(registry, "fixed", str(golden), set_options=["validation_size=0"], seed=seed),
                       folder / f"seed{seed}", registry=registry, log=lambda line: None) for seed in (0, 1)]


def assert_by_hand(metrics: dict) -> None:
    assert {key: metrics[key] for key in BY_HAND} == pytest.approx(BY_HAND)
    assert metrics["filtered_pairs"] == REMOVED


def test_without_filtered_pairs_moves_the_rest_up():
    labels = np.array([[1, 0, 3, 2], [5, -1, -1, -1], [4, 1, 2, 3]])
    filtered = sp.csr_matrix(np.array([[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]]))
    kept, record = without_filtered_pairs(labels, filtered)
    assert kept.tolist() == [[0, 2, -1, -1], [-1, -1, -1, -1], [4, 1, 2, 3]]
    assert record == {"filtered_pairs": {"listed": 3, "removed": 3}}
    assert without_filtered_pairs(labels, None) == (labels, {})


def test_a_run_keeps_room_for_its_filtered_pairs(fixed_runs):
    # "two" has two filtered pairs: the top 5 + 2 are kept, so the deepest cut-off is still full after the removal
    config = json.loads((fixed_runs[0] / "config.json").read_text())["config"]
    assert config["top_k"] == 10   # the default already leaves room for 5 + 2
    dataset = types.SimpleNamespace(test_filter=sp.csr_matrix(np.array([[1, 1, 1], [0, 1, 0]])), train_filter=None)
    narrow = TrainConfig(top_k=5)
    room_for_filtered_pairs(narrow, dataset, log=lambda line: None)
    assert narrow.top_k == 8
    unfiltered = TrainConfig(top_k=5)
    room_for_filtered_pairs(unfiltered, types.SimpleNamespace(test_filter=None, train_filter=None))
    assert unfiltered.top_k == 5


def test_golden_a_run_scores_without_the_filtered_pairs(fixed_runs):
    metrics = json.loads((fixed_runs[0] / "metrics.json").read_text())
    assert_by_hand(metrics)
    saved = load_file(str(fixed_runs[0] / "predictions.safetensors"))   # the method's own top-k, unfiltered
    assert saved["labels"][0, :4].tolist() == ANSWERS["zero"]


def test_golden_every_other_scoring_path_agrees(fixed_runs, registry, golden, tmp_path):
    run = fixed_runs[0]
    assert_by_hand(saved_models.evaluate(run, registry=registry))
    assert_by_hand(xmcbench.load(run, registry=registry).evaluate())
    assert_by_hand(rescore_run(run, registry=registry, log=lambda line: None))
    assert_by_hand(evaluate_predictions(run / "predictions.npz", str(golden), registry=registry)[0])
    built = ensemble.build_ensemble(fixed_runs, tmp_path / "ensemble", registry=registry, log=lambda line: None)
    assert_by_hand(json.loads((built / "metrics.json").read_text()))
    assert_by_hand(saved_models.evaluate(built, registry=registry))


def test_the_report_says_pairs_were_filtered(fixed_runs, tmp_path):
    runs = report.load_runs([fixed_runs[0].parent], log=lambda line: None)
    text = report.write_report(runs, tmp_path / "report").read_text()
    assert "- Filtered pairs (the dataset's filter_labels files; taken out of the predictions before scoring" in text
    assert "4 pairs listed, 3 removed from the predictions" in text


def test_label_texts_option_is_recorded_and_read_again(registry, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.csv").write_text("text,labels\nzero,a\none,b\ntwo,a|b\n")
    (data / "test.csv").write_text("text,labels\nnot a fixed answer,a\n")
    (tmp_path / "texts.tsv").write_text("a\tthe first letter\n")
    reading = FormatOptions(label_texts=str(tmp_path / "texts.tsv"))
    run = xmcbench.train("fixed", str(data), output=tmp_path / "run", registry=registry, log=None, reading=reading,
                         validation_size=0).path
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["reading"]["label_texts"] == str(tmp_path / "texts.tsv")
    dataset = open_dataset(registry, recorded["dataset"], options=reading_of(recorded))
    assert dataset.label_texts == ["the first letter", "b"] and dataset.version == recorded["dataset_version"]
    rescore_run(run, registry=registry, log=lambda line: None)   # reads the dataset as the run did


@pytest.fixture
def filtered_lf(registry, tmp_path) -> Path:
    """The tiny topic dataset in the label-feature layout, with two filtered labels per document."""
    from xmcbench.formats import write_dataset
    from xmcbench.testing import write_tiny_dataset

    dataset = open_dataset(registry, str(write_tiny_dataset(tmp_path / "tiny", train=40, test=12)))
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        rows = dataset.train_labels.shape[0] if split == "train" else dataset.test_labels.shape[0]
        pairs = sp.csr_matrix((np.ones(2 * rows), (np.repeat(np.arange(rows), 2),
                                                   rng.integers(0, dataset.num_labels, 2 * rows))),
                              shape=(rows, len(dataset.label_names)))
        setattr(dataset, f"{split}_filter", pairs)
    return write_dataset(registry, dataset, tmp_path / "lf", "xc_label_features")


def assert_scored_with_the_filter(registry, run: Path, folder: Path) -> None:
    """metrics.json equals the score of the run's saved predictions without the dataset's filtered pairs."""
    metrics = json.loads((run / "metrics.json").read_text())
    saved = load_file(str(run / "predictions.safetensors"))
    dataset = open_dataset(registry, str(folder))
    expected = score(Predictions(saved["labels"], saved["scores"], None), dataset.test_labels, None,
                            propensities(dataset), (1, 3, 5), filtered=dataset.test_filter)
    assert metrics["filtered_pairs"] == expected["filtered_pairs"] and metrics["filtered_pairs"]["removed"] > 0
    assert metrics["P@1"] == pytest.approx(expected["P@1"]) and metrics["PSP@5"] == pytest.approx(expected["PSP@5"])
    assert saved_models.evaluate(run, registry=registry)["P@5"] == pytest.approx(metrics["P@5"])


@pytest.mark.slow
def test_a_lightxml_run_filters_its_test_and_validation_rows(registry, tiny_model_dir, filtered_lf, tmp_path,
                                                            monkeypatch):
    scored = []
    original = score

    def spy(*args, **kwargs):
        scored.append(kwargs.get("filtered"))
        return original(*args, **kwargs)

    monkeypatch.setattr(component, "score", spy)
    settings = [f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1",
                "max_length=16", "threads=1", "hidden_size=8", "validation_size=8", "batch_size=8"]
    plan = plan_run(registry, "lightxml", str(filtered_lf), set_options=settings)
    run = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    validation, test = scored[0], scored[-1]
    assert validation.shape[0] == 8 and test.shape[0] == 12   # the validation rows' train pairs, the test pairs
    monkeypatch.setattr(component, "score", original)
    assert_scored_with_the_filter(registry, run, filtered_lf)


def test_a_plt_run_on_the_label_feature_layout(registry, filtered_lf, tmp_path):
    if "plt" not in registry.methods:
        pytest.skip("the xmcbench-linear plugin (pip install -e 'plugins/xmcbench-linear[all]') is not installed")
    plan = plan_run(registry, "plt", str(filtered_lf), set_options=["validation_size=8", "threads=1"])
    run = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    assert_scored_with_the_filter(registry, run, filtered_lf)
