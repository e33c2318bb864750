"""Zero-shot labels: metrics.json's "zero_shot" figures over the test positives whose label no training document of
the model carried, the seeded `zero_shot_labels` split that holds a share of the test set's labels out of training,
and the vocabulary of a method that scores unseen labels (MethodSpec.scores_unseen_labels)."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from xmcbench.config import MethodSpec, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.interfaces import WholeMethod
from xmcbench.metrics import evaluate
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset, write_tiny_label_texts
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.formats import open_dataset
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import training_view
from xmcbench.saved import predict_texts, rescore_run
from xmcbench.scoring import zero_shot_mask


def test_zero_shot_figures_by_hand():
    # labels 2 and 3 are zero-shot; doc 0 has one (2), doc 1 none, doc 2 one (3), doc 3 two (2, 3)
    truth = sp.csr_matrix(np.array([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]], dtype=np.float32))
    predicted = np.array([[2, 0, 1], [1, 3, 0], [0, 1, -1], [3, 0, 1]])
    zero_shot = np.array([False, False, True, True])
    figures = evaluate(predicted, truth, ks=(1, 3), zero_shot=zero_shot)["zero_shot"]
    # documents 0, 2, 3: zero-shot hits in the top 1: 1, 0, 1; in the top 3: 1, 0, 1; positives 1, 1, 2
    assert figures == pytest.approx({"labels": 2, "documents": 3, "positives": 4, "P@1": 100 * 2 / 3,
                                     "P@3": 100 * (1 / 3 + 0 + 1 / 3) / 3, "R@1": 100 * (1 + 0 + 0.5) / 3,
                                     "R@3": 100 * (1 + 0 + 0.5) / 3})
    assert "zero_shot" not in evaluate(predicted, truth, ks=(1,), zero_shot=np.zeros(4, dtype=bool))
    assert zero_shot_mask(np.array([3, 0, 1]), 3, 5).tolist() == [False, True, False, True, True]
    assert zero_shot_mask(None, 3, 5).tolist() == [False, False, False, True, True]


def test_the_split_is_seeded_and_holds_labels_out_of_training_only(tmp_path):
    registry = build_registry()
    dataset = open_dataset(registry, str(write_tiny_dataset(tmp_path / "data", train=60, test=30)))
    spec = MethodSpec("m", "")
    view, held_out = training_view(dataset, TrainConfig(zero_shot_labels=0.25, seed=3), spec, log=lambda l: None)
    again, same = training_view(dataset, TrainConfig(zero_shot_labels=0.25, seed=3), spec, log=lambda l: None)
    other, different = training_view(dataset, TrainConfig(zero_shot_labels=0.25, seed=4), spec,
                                            log=lambda l: None)
    assert len(held_out) == 2 and held_out == same and held_out != different   # a quarter of the 8 labels
    columns = [dataset.label_names.index(name) for name in held_out]
    assert view.train_labels[:, columns].nnz == 0 and dataset.train_labels[:, columns].nnz > 0
    assert view.test_labels is dataset.test_labels and view.num_labels == dataset.num_labels
    untouched = [i for i in range(dataset.num_labels) if i not in columns]
    assert (view.train_labels[:, untouched] != dataset.train_labels[:, untouched]).nnz == 0
    assert view.train_labels.has_canonical_format   # sorted rows: napkinXC's PLT crashed the process on others
    with pytest.raises(XmcError, match="zero_shot_labels=1 is out of range"):
        TrainConfig(zero_shot_labels=1.0).validate()


class FirstLabels(WholeMethod):
    """Predicts every label in id order (the model's vocabulary), whatever the text: predictions fixed by hand."""

    def __init__(self, num_labels: int) -> None:
        self.num_labels = num_labels

    @classmethod
    def fit(cls, train_texts, train_labels, num_labels, config, log):
        return cls(num_labels)

    def save(self, folder: Path) -> None:
        folder.mkdir()
        (folder / "size.json").write_text(json.dumps(self.num_labels))

    @classmethod
    def load(cls, folder: Path, config):
        return cls(json.loads((folder / "size.json").read_text()))

    def predict(self, texts, top_k):
        row = np.full(top_k, -1, dtype=np.int64)
        row[:min(top_k, self.num_labels)] = np.arange(min(top_k, self.num_labels))
        scores = np.where(row >= 0, -np.arange(top_k, dtype=np.float32), -1.0).astype(np.float32)
        return np.tile(row, (len(texts), 1)), np.tile(scores, (len(texts), 1))


def first_labels_plugin(scores_unseen: bool) -> types.ModuleType:
    module = types.ModuleType("first_labels_plugin")

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("first-labels", "every label in id order", whole_method=FirstLabels,
                                       scores_unseen_labels=scores_unseen))

    module.xmcbench_register_methods = xmcbench_register_methods
    return module


def test_a_run_reports_zero_shot_figures_of_its_held_out_labels(tmp_path):
    registry = build_registry([("first-labels", first_labels_plugin(False))])
    data = write_tiny_dataset(tmp_path / "data", train=60, test=30)
    plan = plan_run(registry, "first-labels", str(data), set_options=["zero_shot_labels=0.25",
                                                                             "validation_size=0"], seed=0)
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    held_out = json.loads((run_dir / "config.json").read_text())["resolved"]["zero_shot_labels"]
    figures = json.loads((run_dir / "metrics.json").read_text())["zero_shot"]
    dataset = open_dataset(registry, str(data))
    columns = [dataset.label_names.index(name) for name in held_out]
    test = dataset.test_labels[:, columns]
    documents = np.flatnonzero(np.diff(test.tocsr().indptr) > 0)
    # every document's top 5 is labels 0..4: a held-out label there is a zero-shot hit
    in_top5 = [column for column in columns if column < 5]
    hits = np.asarray(test[:, [columns.index(c) for c in in_top5]].sum(axis=1)).ravel()[documents] if in_top5 \
        else np.zeros(len(documents))
    positives = np.asarray(test.sum(axis=1)).ravel()[documents]
    assert figures["documents"] == len(documents) and figures["positives"] == int(positives.sum())
    assert figures["P@5"] == pytest.approx(100 * np.mean(hits / 5))
    assert figures["R@5"] == pytest.approx(100 * np.mean(hits / positives))
    info = json.loads((run_dir / "model" / "label_info.json").read_text())
    assert all(info["counts"][column] == 0 for column in columns), "held out of the run's training rows"
    assert saved_models.evaluate(run_dir, registry=registry)["zero_shot"] == figures
    assert rescore_run(run_dir, registry=registry, log=lambda line: None)["zero_shot"] == figures


def test_a_method_that_scores_unseen_labels_has_them_in_its_vocabulary(tmp_path):
    data = write_tiny_dataset(tmp_path / "data", train=60, test=30)
    (data / "test_labels.txt").write_text((data / "test_labels.txt").read_text().replace("db:sql", "db:nosql"))
    texts = (data / "test_labels.txt").read_text()
    assert "db:nosql" in texts and "db:nosql" not in (data / "train_labels.txt").read_text()
    write_tiny_label_texts(data)
    with open(data / "label_texts.tsv", "a", encoding="utf-8") as table:
        table.write("db:nosql\tdocument store key value database without sql\n")
    for scores_unseen, expected in ((False, 8), (True, 9)):
        registry = build_registry([("first-labels", first_labels_plugin(scores_unseen))])
        plan = plan_run(registry, "first-labels", str(data), set_options=["validation_size=0"], seed=0)
        run_dir = launch.run(plan, tmp_path / f"run-{scores_unseen}", registry=registry, log=lambda line: None)
        names = json.loads((run_dir / "model" / "labels.json").read_text())
        assert len(names) == expected and ("db:nosql" in names) == scores_unseen
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["zero_shot"]["labels"] == 1, "the test-only label counts as zero-shot either way"
        found = predict_texts(run_dir, ["any text"], top_k=9, registry=registry)[0]["labels"]
        assert ("db:nosql" in found) == scores_unseen, "predict serves a label no training document carries"


# -- hybrids ---------------------------------------------------------------------------------------------------

def test_a_label_only_one_member_can_score_keeps_its_score():
    from xmcbench.fusion import weighted_scores

    labels = [np.array([[0, 1]]), np.array([[0, 2]])]        # label 2 lies beyond the first member's vocabulary
    normalised = [np.array([[0.9, 0.5]]), np.array([[0.8, 0.7]])]
    first, second = weighted_scores(labels, normalised, [0.25, 0.75], sizes=[2, 3])
    assert first.tolist() == [[0.25 * 0.9, 0.25 * 0.5]]
    assert second[0, 0] == pytest.approx(0.75 * 0.8) and second[0, 1] == pytest.approx(0.7), \
        "scored by the second member alone: its whole normalised score, not 3/4 of it"
    same = weighted_scores(labels, normalised, [0.25, 0.75], sizes=[3, 3])
    assert same[1].tolist() == [[0.75 * 0.8, 0.75 * 0.7]], "one vocabulary: the weighted sum as before"


def test_a_weighted_hybrid_of_nested_vocabularies(tmp_path):
    from xmcbench import ensemble

    data = write_tiny_dataset(tmp_path / "data", train=60, test=30)
    (data / "test_labels.txt").write_text((data / "test_labels.txt").read_text().replace("db:sql", "db:nosql"))
    write_tiny_label_texts(data)
    runs = []
    for scores_unseen in (False, True):
        registry = build_registry([("first-labels", first_labels_plugin(scores_unseen))])
        plan = plan_run(registry, "first-labels", str(data), set_options=["validation_size=12"], seed=0)
        runs.append(launch.run(plan, tmp_path / f"run-{scores_unseen}", registry=registry, log=lambda line: None))
    built = ensemble.build_ensemble(runs, tmp_path / "hybrid", fusion="weighted", registry=registry,
                                    log=lambda line: None)
    names = json.loads((built / "predictions_labels.json").read_text())
    assert len(names) == 9 and names[-1] == "db:nosql", "the longest vocabulary, the test-only label last"
    metrics = json.loads((built / "metrics.json").read_text())
    assert metrics["zero_shot"]["labels"] == 1
    reordered = tmp_path / "reordered"
    shutil.copytree(runs[0], reordered)
    labels_file = reordered / "model" / "labels.json"
    labels_file.write_text(json.dumps(list(reversed(json.loads(labels_file.read_text())))))
    with pytest.raises(XmcError, match="another label vocabulary"):
        ensemble.vocabulary([ensemble.read_member(reordered), ensemble.read_member(runs[1])])
