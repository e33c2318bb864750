"""xmcbench-linear: every method against xmcbench's whole-method conformance suite (and a copy broken on
purpose), the plugin as installed (entry point), one-line refusals, and tiny end-to-end runs through the
real runner.

Needs the package installed with its backends (`pip install -e 'plugins/xmcbench-linear[all]'`): xmcbench
finds it only through its entry point. Nothing is downloaded; every test takes a second or two.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from xmcbench.cli import app
from xmcbench.config import resolve_config
from xmcbench.errors import XmcError
from xmcbench.registry import build_registry
from xmcbench.testing import check_whole_method, pickles_in, write_tiny_dataset
from xmcbench_linear.base import label_matrix
from xmcbench_linear.features import TfidfFeatures
from xmcbench_linear.methods import linear_methods
from xmcbench_linear.omikuji_trees import OmikujiTrees
from xmcbench_linear.ovr import OneVsRestSVM
from xmcbench_linear.plt import NapkinPLT
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.formats import open_dataset
from xmcbench.rundir import VALIDATION_PREDICTIONS_FILE
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import split_train_rows
from xmcbench.saved import predict_texts

METHODS = {spec.name: spec for spec in linear_methods()}
# settings that make the tiny dataset's 8 labels grow real trees (the defaults keep them in one leaf)
DEEPER = {"plt": ["options.plt_max_leaves=2"], "parabel": ["options.omikuji_min_branch_size=2"],
          "bonsai": ["options.omikuji_min_branch_size=3", "options.omikuji_cluster_k=3"], "ovr": []}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny", train=80, test=20)


# -- conformance ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_conforms_with_its_defaults(name):
    spec = METHODS[name]
    check_whole_method(spec.whole_method, resolve_config(spec, "tiny"))


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_conforms_with_deeper_trees(name):
    spec = METHODS[name]
    check_whole_method(spec.whole_method, resolve_config(spec, "tiny", set_options=DEEPER[name]))


class PLTThatLosesItsVectoriser(NapkinPLT):
    """load rebuilds the TF-IDF vocabulary but forgets the idf weights (every term weighs 1)."""

    @classmethod
    def load(cls, folder, config):
        model = super().load(folder, config)
        model.features.vectorizer.idf_ = np.ones_like(model.features.vectorizer.idf_)
        return model


class UnsortedOneVsRest(OneVsRestSVM):
    def predict_backend(self, features, top_k):
        labels, scores = super().predict_backend(features, top_k)
        return labels[:, ::-1].copy(), scores[:, ::-1].copy()


class PLTThatForgetsItsFeatureWidth(NapkinPLT):
    """A model fitted on a dataset's features is saved without the number of feature columns it read."""

    def save(self, folder):
        self.num_features = None if self.features is None else self.num_features
        super().save(folder)


@pytest.mark.parametrize("broken, method, rule", [
    (PLTThatLosesItsVectoriser, "plt", "a saved and loaded model must predict exactly as the fitted one"),
    (UnsortedOneVsRest, "ovr", "labels must come best first"),
    (PLTThatForgetsItsFeatureWidth, "plt", "predict_features on the 16 test documents' features, top_k=12, loaded, "
                                           "must work"),
])
def test_the_conformance_check_catches_a_broken_copy(broken, method, rule):
    with pytest.raises(AssertionError, match=f"{broken.__name__}: {rule}"):
        check_whole_method(broken, resolve_config(METHODS[method], "tiny"))


def test_tfidf_files_hold_data_only_and_transform_as_fitted(tmp_path):
    texts = ["python gtk bindings", "gtk toolkit widgets", "python module for gtk", "a c library"]
    settings = {"tfidf_ngram_max": 2, "tfidf_min_df": 1, "tfidf_max_features": 5, "tfidf_sublinear_tf": True}
    features, matrix = TfidfFeatures.fit(texts, settings)
    assert matrix.shape == (4, 5) and matrix.dtype == np.float32
    features.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tfidf.json", "tfidf_idf.npy"] and not pickles_in(tmp_path)
    loaded = TfidfFeatures.load(tmp_path)
    unseen = ["python gtk", "", "nothing known here"]
    assert (loaded.transform(unseen) != features.transform(unseen)).nnz == 0
    assert (loaded.transform(texts) != matrix).nnz == 0


# -- the plugin as installed ------------------------------------------------------------------------

def test_the_plugin_registers_the_methods_through_its_entry_point(registry):
    assert not registry.failures_of("linear"), registry.failures_of("linear")
    assert {name: registry.method(name).whole_method for name in METHODS} == \
        {"plt": NapkinPLT, "parabel": OmikujiTrees, "bonsai": OmikujiTrees, "ovr": OneVsRestSVM}
    plugin = next(p for p in registry.plugins if p.name == "linear")
    assert plugin.package == "xmcbench-linear" and plugin.hooks == ["xmcbench_register_methods"]
    listed = CliRunner().invoke(app, ["plugins"]).output
    assert all(f"method '{name}'" in listed for name in METHODS) and "xmcbench-linear" in listed


def test_bonsai_and_parabel_differ_only_in_their_documented_settings():
    parabel, bonsai = METHODS["parabel"].defaults, METHODS["bonsai"].defaults
    differ = {key: (parabel[key], bonsai[key]) for key in parabel if parabel[key] != bonsai[key]}
    assert differ == {"options.omikuji_cluster_k": (2, 100), "options.omikuji_balanced": (True, False),
                      "options.omikuji_max_depth": (20, 3)}


# -- refusals: one line, before the output folder is touched --------------------------------------------

@pytest.mark.parametrize("method, options, message", [
    ("plt", ["options.plt_arty=3"], "unknown setting options.plt_arty for plt \\(napkinXC\\): did you mean "
                                    "options.plt_arity\\?"),
    ("plt", ["options.plt_c=abc"], "options.plt_c must be float, got 'abc'"),
    ("parabel", ["options.omikuji_cluster_k=200"], "options.omikuji_cluster_k=200 exceeds "
                                                   "options.omikuji_min_branch_size=100"),
    ("ovr", ["options.ovr_max_labels=5"], "ovr fits one classifier per label and stops at "
                                          "options.ovr_max_labels=5 labels; this dataset has 8: use plt or parabel"),
    ("parabel", ["options.tfidf_min_df=0"], "options.tfidf_min_df=0 is out of range; it must be at least 1"),
])
def test_bad_settings_are_refused_in_one_line(registry, dataset_dir, tmp_path, method, options, message):
    plan = plan_run(registry, method, str(dataset_dir), set_options=options)
    with pytest.raises(XmcError, match=message):
        launch.run(plan, tmp_path / "out", registry=registry, log=lambda line: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, module, extra", [("plt", "napkinxc", "plt"), ("bonsai", "omikuji", "omikuji")])
def test_a_missing_backend_is_listed_and_named_with_its_extra(registry, dataset_dir, tmp_path, monkeypatch, method,
                                                               module, extra):
    monkeypatch.setitem(sys.modules, module, None)   # what an environment without the backend looks like
    assert method in build_registry().methods
    plan = plan_run(registry, method, str(dataset_dir))
    with pytest.raises(XmcError, match=f"needs {module}, which is not installed: "
                                       f"pip install 'xmcbench-linear\\[{extra}\\]'$"):
        launch.run(plan, tmp_path / "out", registry=registry, log=lambda line: None)
    assert not (tmp_path / "out").exists()


# -- end to end -------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["plt", "parabel"])
def test_a_tiny_run_writes_the_run_directory_and_serves_predict(registry, dataset_dir, tmp_path, capfd, method):
    plan = plan_run(registry, method, str(dataset_dir), set_options=["validation_size=16", "threads=1"])
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["P@1"] > 50   # the tiny dataset's words name its labels
    validation = load_file(str(run_dir / VALIDATION_PREDICTIONS_FILE))
    dataset = open_dataset(registry, str(dataset_dir))
    assert np.array_equal(validation["rows"], split_train_rows(dataset, plan.config)[1])
    assert validation["labels"].shape == (16, plan.config.top_k)
    assert not pickles_in(run_dir / "model") and (run_dir / "model" / "method" / "backend").is_dir()
    capfd.readouterr()
    found = predict_texts(run_dir, ["python interpreter module pip", ""], top_k=3, registry=registry)
    assert found[0]["labels"][0] == "lang:python" and len(found) == 2
    assert capfd.readouterr().out == ""   # the backend's own log never reaches stdout (predict writes JSON there)
    assert saved_models.evaluate(run_dir, registry=registry)["P@1"] == metrics["P@1"]


def test_ovr_fits_the_same_model_with_any_number_of_worker_processes(dataset_dir):
    from xmcbench.data import load_dataset_from_path

    dataset = load_dataset_from_path(dataset_dir)
    labels = dataset.train_labels[:, :dataset.num_labels].tocsr()
    predictions = []
    for threads in (1, 3):
        config = resolve_config(METHODS["ovr"], "tiny", set_options=[f"threads={threads}"])
        model = OneVsRestSVM.fit(dataset.train_texts, labels, dataset.num_labels, config, lambda line: None)
        predictions.append(model.predict(dataset.test_texts, 5))
    assert np.array_equal(predictions[0][0], predictions[1][0]) and np.array_equal(predictions[0][1], predictions[1][1])


@pytest.mark.parametrize("name", list(METHODS))
def test_documents_without_labels_or_known_words_and_labels_without_documents(name):
    import scipy.sparse as sp

    texts = ["python gtk", "gtk widget", "", "python module", "zz", "python gtk widget", "widget", "module python"] * 3
    labels = sp.csr_matrix(np.array([[1, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0],
                                     [1, 0, 0]] * 3, dtype=np.float32))   # label 2: no document; row 2: no label
    config = resolve_config(METHODS[name], "tiny", set_options=["threads=1"])
    model = METHODS[name].whole_method.fit(texts, labels, 3, config, lambda line: None)
    found, _ = model.predict(["python", "", "gtk widget"], 3)
    assert found[:, 0].tolist() == [0, 0, 1] and (found != 2).all()


def test_labels_given_out_of_order_or_twice_fit_the_same_model():
    import scipy.sparse as sp

    def matrix(rows):
        return sp.csr_matrix((np.ones(sum(map(len, rows)), dtype=np.float32), [label for row in rows for label in row],
                              np.cumsum([0, *map(len, rows)])), shape=(len(rows), 3))

    texts = ["python gtk", "gtk widget", "python module", "widget module", "python gtk widget", "module"] * 3
    rows = [[0, 1], [1, 2], [0, 2], [1, 2], [0, 1, 2], [2]] * 3
    canonical = matrix(rows)
    # the same labels, each row's ids reversed and its first id stored twice (a column-masked CSR is unsorted)
    messy = matrix([[*row[::-1], row[0]] for row in rows])
    assert not messy.has_canonical_format
    assert label_matrix(messy).has_canonical_format and (label_matrix(messy) != canonical).nnz == 0
    # napkinXC's PLT crashed the whole process on rows whose ids were not sorted
    config = resolve_config(METHODS["plt"], "tiny", set_options=["threads=1"])
    found = [METHODS["plt"].whole_method.fit(texts, labels, 3, config, lambda line: None).predict(texts[:6], 3)
             for labels in (canonical, messy)]
    assert np.array_equal(found[0][0], found[1][0]) and np.array_equal(found[0][1], found[1][1])


# -- datasets of sparse features (bag of words, no texts) ---------------------------------------------

def write_bag_of_words(raw: Path, folder: Path) -> Path:
    """The tiny raw-text dataset as Extreme Classification Repository files: word counts, no texts."""
    from sklearn.feature_extraction.text import CountVectorizer

    from xmcbench.data import load_dataset_from_path

    dataset = load_dataset_from_path(raw)
    counts = CountVectorizer().fit(dataset.train_texts)
    folder.mkdir(parents=True)
    for split, texts, labels in (("train", dataset.train_texts, dataset.train_labels),
                                 ("test", dataset.test_texts, dataset.test_labels)):
        matrix = counts.transform(texts).tocsr()
        lines = [f"{matrix.shape[0]} {matrix.shape[1]} {len(dataset.label_names)}"]
        for row in range(matrix.shape[0]):
            ids = ",".join(str(i) for i in labels[row].indices)
            pairs = " ".join(f"{j}:{v}" for j, v in sorted(zip(matrix[row].indices, matrix[row].data)))
            lines.append(f"{ids} {pairs}".strip())
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return folder


def test_a_dataset_of_sparse_features_trains_and_scores_the_linear_methods_and_refuses_the_others(
        registry, dataset_dir, tmp_path):
    bow = write_bag_of_words(dataset_dir, tmp_path / "bow")
    plan = plan_run(registry, "plt", str(bow), set_options=["validation_size=10"])
    logged = []
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=logged.append)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["P@1"] > 30   # the tiny dataset's words predict its labels
    assert json.loads((run_dir / "config.json").read_text())["resolved"]["inputs"] == "features"
    assert any("no TF-IDF" in line for line in logged)
    assert (run_dir / "validation_predictions.safetensors").is_file()
    assert saved_models.evaluate(run_dir, registry=registry)["P@1"] == pytest.approx(metrics["P@1"])

    with pytest.raises(XmcError) as error:   # the model reads feature columns, not texts
        predict_texts(run_dir, ["some text"], top_k=3, registry=registry)
    assert "fitted on a dataset's sparse features" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(XmcError) as error:   # a transformer method has nothing to read
        plan_run(registry, "lightxml", str(bow))
    message = str(error.value)
    assert "has sparse features but no texts, and lightxml reads texts" in message and "plt" in message
    assert "\n" not in message
