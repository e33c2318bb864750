"""Whole methods (xmcbench.interfaces.WholeMethod): a toy one registered in-process runs through `launch.run`
into the same run directory as a component method (same validation split, scoring, predictions, claim
and --overwrite rules), its saved model serves `predict`, `evaluate`, `ensemble` and `report`, and the
conformance check `check_whole_method` passes it and catches copies broken in each way it checks."""

from __future__ import annotations

import json
import pickle
import random
import shutil
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from xmcbench import ensemble, report, whole_methods
from xmcbench.config import MethodSpec, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.interfaces import WholeMethod
from xmcbench.registry import build_registry
from xmcbench.rundir import RUN_MARKER
from xmcbench.testing import check_whole_method, pickles_in
from xmcbench.whole_methods import is_whole_method_model, load_model_dir
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.formats import open_dataset
from xmcbench.inference import Predictions
from xmcbench.rundir import peak_memory_mb, PEAK_RSS_RESET, VALIDATION_PREDICTIONS_FILE
from xmcbench.runs.plan import plan_resume, plan_run
from xmcbench.runs.splits import split_train_rows
from xmcbench.saved import predict_texts
from xmcbench.scoring import propensities, score


class WordVotes(WholeMethod):
    """Each training word votes for the labels of its documents; a text's labels are ranked by its words'
    votes (ties: lower id first). Saved as one JSON file."""

    def __init__(self, votes: dict[str, list[float]], num_labels: int) -> None:
        self.votes, self.num_labels = votes, num_labels

    @classmethod
    def fit(cls, train_texts, train_labels, num_labels, config, log):
        votes = defaultdict(lambda: [0.0] * num_labels)
        for text, row in zip(train_texts, range(train_labels.shape[0])):
            for word in set(text.split()):
                for label in train_labels.indices[train_labels.indptr[row]:train_labels.indptr[row + 1]]:
                    votes[word][label] += 1.0
        log(f"{len(votes)} words")
        return cls(dict(votes), num_labels)

    def save(self, folder: Path) -> None:
        folder.mkdir()
        (folder / "votes.json").write_text(json.dumps({"num_labels": self.num_labels, "votes": self.votes}))

    @classmethod
    def load(cls, folder: Path, config):
        saved = json.loads((folder / "votes.json").read_text())
        return cls(saved["votes"], saved["num_labels"])

    def scores(self, text: str) -> np.ndarray:
        total = np.zeros(self.num_labels)
        for word in set(text.split()):
            total += self.votes.get(word, 0.0)
        return total

    def predict(self, texts, top_k):
        labels = np.full((len(texts), top_k), -1, dtype=np.int64)
        scores = np.full((len(texts), top_k), -1.0, dtype=np.float32)
        for row, text in enumerate(texts):
            total = self.scores(text)
            order = [label for label in np.lexsort((np.arange(self.num_labels), -total)) if total[label] > 0][:top_k]
            labels[row, :len(order)] = order
            scores[row, :len(order)] = total[order]
        return labels, scores


# -- broken on purpose: each breaks one rule of the contract -------------------------------------------

class UnsortedVotes(WordVotes):
    def predict(self, texts, top_k):
        labels, scores = super().predict(texts, top_k)
        for row in range(len(labels)):   # worst first
            count = int((labels[row] >= 0).sum())
            labels[row, :count], scores[row, :count] = labels[row, :count][::-1], scores[row, :count][::-1]
        return labels, scores


class PickledVotes(WordVotes):
    def save(self, folder: Path) -> None:
        folder.mkdir()
        (folder / "votes.bin").write_bytes(pickle.dumps((self.votes, self.num_labels)))

    @classmethod
    def load(cls, folder: Path, config):
        return cls(*pickle.loads((folder / "votes.bin").read_bytes()))


class ForgetfulVotes(WordVotes):
    """Its load loses the vocabulary (like a linear method whose load forgets its TF-IDF vectoriser)."""

    @classmethod
    def load(cls, folder: Path, config):
        return cls({}, json.loads((folder / "votes.json").read_text())["num_labels"])


class UnseededVotes(WordVotes):
    @classmethod
    def fit(cls, train_texts, train_labels, num_labels, config, log):
        model = super().fit(train_texts, train_labels, num_labels, config, log)
        noise = random.Random()   # seeded from the system, not from config.seed
        model.votes = {word: [v + noise.random() for v in values] for word, values in model.votes.items()}
        return model


class OutsideFolderVotes(WordVotes):
    """Saves a pointer to its folder's absolute path and reads from there."""

    def save(self, folder: Path) -> None:
        super().save(folder)
        (folder / "where.txt").write_text(str(folder))

    @classmethod
    def load(cls, folder: Path, config):
        return super().load(Path((folder / "where.txt").read_text()), config)


class BatchDependentVotes(WordVotes):
    def predict(self, texts, top_k):
        labels, scores = super().predict(texts, top_k)
        return labels, np.where(labels >= 0, scores + np.float32(len(texts)), scores)


class PaddedWithZeroVotes(WordVotes):
    def predict(self, texts, top_k):
        labels, scores = super().predict(texts, top_k)
        return np.where(labels < 0, 0, labels), scores


@pytest.mark.parametrize("broken, rule", [
    (UnsortedVotes, "labels must come best first"),
    (PickledVotes, "saved files must be free of pickle.*votes.bin \\(starts with a pickle protocol"),
    (ForgetfulVotes, "a saved and loaded model must predict exactly as the fitted one"),
    (UnseededVotes, "fitting again with the same config"),
    (OutsideFolderVotes, "load\\(folder, config\\) must work on a copy of the saved folder"),
    (BatchDependentVotes, "a text's prediction must not depend on the other texts"),
    (PaddedWithZeroVotes, "a label must not appear twice in a row"),
])
def test_the_conformance_check_catches_each_broken_rule(broken, rule):
    with pytest.raises(AssertionError, match=f"whole method .*{broken.__name__}: {rule}"):
        check_whole_method(broken, TrainConfig())


def test_the_toy_whole_method_conforms():
    check_whole_method(WordVotes, TrainConfig())


def test_pickles_in_names_each_kind_of_pickle(tmp_path):
    (tmp_path / "plain.json").write_text("{}")
    np.save(tmp_path / "numbers.npy", np.arange(3), allow_pickle=False)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "mixed.npz", fine=np.arange(2), bad=np.array([None, "x"], dtype=object))
    (tmp_path / "model.pkl").write_bytes(b"x")
    (tmp_path / "weights.bin").write_bytes(pickle.dumps([1, 2]))
    found = pickles_in(tmp_path)
    assert [line.split(" ")[0] for line in found] == ["mixed.npz", "model.pkl", "objects.npy", "weights.bin"]


# -- registration ---------------------------------------------------------------------------------------

def votes_plugin(method_class=WordVotes, name: str = "votes") -> types.ModuleType:
    module = types.ModuleType(f"{name}_plugin")

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec(name, "word votes, a toy whole method", whole_method=method_class))

    module.xmcbench_register_methods = xmcbench_register_methods
    return module


def test_a_whole_method_must_subclass_the_contract():
    registry = build_registry(extra_plugins=[("bad", votes_plugin(method_class=dict))], load_entry_points=False)
    assert registry.failed and "whose whole_method is not a subclass of xmcbench.interfaces.WholeMethod" in \
        registry.failed[0].error


# -- runs ---------------------------------------------------------------------------------------------------

class FeatureVotes(WordVotes):
    reads_features = True


def test_a_raw_text_dataset_with_a_features_file_is_read_as_texts(dataset_dir, tmp_path):
    from xmcbench.data import load_dataset_from_path

    folder = shutil.copytree(dataset_dir, tmp_path / "with-features")
    (folder / "train_v1.txt").write_text("0 0:1\n1 oops\n")   # malformed: reading it would raise
    dataset = load_dataset_from_path(folder)
    # its features are the training documents' only: a run of a method that reads features reads the texts
    assert dataset.has_train_features and not whole_methods.reads_features(FeatureVotes, dataset)


@pytest.fixture(scope="module")
def registry():
    # no entry point: a whole method needs no component, so none is loaded
    return build_registry(extra_plugins=[("votes", votes_plugin())], load_entry_points=False)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    from xmcbench.testing import write_tiny_dataset

    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny", train=60, test=20)


def plan(registry, dataset_dir, *options, seed=0):
    return plan_run(registry, "votes", str(dataset_dir), set_options=["validation_size=12", *options],
                           seed=seed)


@pytest.fixture(scope="module")
def run_dirs(registry, dataset_dir, tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("runs")
    return [launch.run(plan(registry, dataset_dir, seed=seed), folder / f"seed{seed}", registry=registry,
                       log=lambda line: None) for seed in (0, 1)]


@pytest.mark.skipif(not PEAK_RSS_RESET.exists(), reason="restarting the peak needs Linux's clear_refs")
def test_a_run_reports_its_own_memory_peak_not_the_process_lifetime(registry, dataset_dir, tmp_path):
    # as in `compare`: something before the run (here 400 MB, freed again) peaked far above what the run needs
    block = np.ones(400 * 2**20 // 8)
    earlier_peak = peak_memory_mb(torch.device("cpu"))["peak_rss_mb"]
    del block
    run_dir = launch.run(plan(registry, dataset_dir), tmp_path / "run", registry=registry, log=lambda line: None)
    peak = json.loads((run_dir / "timings.json").read_text())["peak_rss_mb"]
    assert 0 < peak < earlier_peak - 300


def test_a_run_writes_the_run_directory_of_any_method(run_dirs, registry, dataset_dir):
    run_dir = run_dirs[0]
    for name in ("config.json", "environment.json", "timings.json", "metrics.json", "data_report.json",
                 "predictions.safetensors", "validation_predictions.safetensors", RUN_MARKER,
                 "model/model.json", "model/labels.json", "model/method/votes.json"):
        assert (run_dir / name).is_file(), name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["method"] == "votes" and config["config"]["validation_size"] == 12
    assert config["resolved"]["whole_method"].endswith("WordVotes")
    assert config["resolved"]["train_docs"] == 48 and config["resolved"]["validation_docs"] == 12
    timings = json.loads((run_dir / "timings.json").read_text())
    assert {"train_seconds", "train_ms_per_document", "predict_ms_per_document"} <= set(timings)
    assert timings["model_bytes"] == sum(f.stat().st_size for f in (run_dir / "model" / "method").rglob("*")
                                         if f.is_file()) > 0
    assert is_whole_method_model(run_dir) and not pickles_in(run_dir / "model")


def test_metrics_and_predictions_come_from_the_shared_code(run_dirs, registry, dataset_dir):
    run_dir = run_dirs[0]
    the_plan = plan(registry, dataset_dir)
    dataset = open_dataset(registry, str(dataset_dir))
    train_rows, validation_rows = split_train_rows(dataset, the_plan.config)
    model, _, _ = load_model_dir(run_dir, registry)
    saved = load_file(str(run_dir / "predictions.safetensors"))
    assert saved["labels"].dtype == np.int64 and saved["scores"].dtype == np.float32
    assert saved["labels"].shape == (20, the_plan.config.top_k)
    expected = score(Predictions(saved["labels"], saved["scores"], None), dataset.test_labels, None,
                            propensities(dataset, the_plan.config), the_plan.config.eval_ks)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert all(metrics[key] == pytest.approx(value) for key, value in expected.items() if isinstance(value, float))
    validation = load_file(str(run_dir / VALIDATION_PREDICTIONS_FILE))
    # the rows of a component method's run with the same seed and validation_size
    assert np.array_equal(validation["rows"], validation_rows) and validation["rows"].dtype == np.int64
    labels, scores = model.predict([dataset.train_texts[i] for i in validation_rows], the_plan.config.top_k)
    assert np.array_equal(validation["labels"], labels) and np.array_equal(validation["scores"], scores)


def test_predict_evaluate_ensemble_and_report_read_the_saved_model(run_dirs, registry, dataset_dir, tmp_path):
    found = predict_texts(run_dirs[0], ["python interpreter module", ""], top_k=3, registry=registry)
    assert found[0]["labels"][0] == "lang:python" and found[1] == {"labels": [], "scores": []}
    metrics = saved_models.evaluate(run_dirs[0], registry=registry)
    assert metrics["P@1"] == json.loads((run_dirs[0] / "metrics.json").read_text())["P@1"]
    built = ensemble.build_ensemble(run_dirs, tmp_path / "ensemble", registry=registry, log=lambda line: None)
    assert saved_models.evaluate(built, registry=registry)["P@1"] == \
        json.loads((built / "metrics.json").read_text())["P@1"]
    assert saved_models.predict_texts(built, ["python interpreter"], top_k=2, registry=registry)[0]["labels"]
    runs = report.load_runs(run_dirs)
    assert [run.method for run in runs] == ["votes", "votes"] and all(run.values()["model_mb"] > 0 for run in runs)


def test_overwrite_rules_are_those_of_every_run(run_dirs, registry, dataset_dir):
    with pytest.raises(XmcError, match="already holds a finished run"):
        launch.run(plan(registry, dataset_dir), run_dirs[1], registry=registry, log=lambda line: None)
    copy = run_dirs[1].parent / "copy"
    shutil.copytree(run_dirs[1], copy)
    assert launch.run(plan(registry, dataset_dir, seed=1), copy, overwrite=True, registry=registry,
                      log=lambda line: None) == copy
    assert (copy / "metrics.json").is_file() and not list(copy.parent.glob(".copy.*"))


def test_a_damaged_or_unknown_model_ends_in_one_line(run_dirs, registry, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dirs[0], copy)
    with pytest.raises(XmcError, match="no installed plugin provides as a whole method"):
        load_model_dir(copy, build_registry(load_entry_points=False))
    (copy / "model" / "method" / "votes.json").write_text("{}")
    with pytest.raises(XmcError, match="votes.json is truncated"):
        predict_texts(copy, ["python"], registry=registry)


def test_a_refusal_leaves_the_output_folder_untouched(registry, dataset_dir, tmp_path):
    class Refusing(WordVotes):
        @classmethod
        def check(cls, config, num_labels):
            raise XmcError("refused")

    refusing = build_registry(extra_plugins=[("refusing", votes_plugin(Refusing, "refusing"))],
                              load_entry_points=False)
    with pytest.raises(XmcError, match="refused"):
        launch.run(plan_run(refusing, "refusing", str(dataset_dir)), tmp_path / "out", registry=refusing)
    assert not (tmp_path / "out").exists()


def test_resume_of_a_method_without_checkpoints_is_refused_in_one_line(run_dirs, registry, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dirs[0], copy)
    (copy / "metrics.json").unlink()
    before = sorted(path.name for path in copy.iterdir())
    with pytest.raises(XmcError, match="votes keeps no checkpoint while it fits, so --resume cannot continue it"):
        launch.run(plan_resume(copy), copy, registry=registry, log=lambda line: None, resume=True)
    assert sorted(path.name for path in copy.iterdir()) == before, "nothing refitted, nothing written"


class CheckpointedVotes(WordVotes):
    """Counts the votes of half the documents, saves them in checkpoint_dir, then the rest: a run stopped after
    the first half continues from it."""

    stop_after_half = False

    @classmethod
    def fit(cls, train_texts, train_labels, num_labels, config, log, *, checkpoint_dir, label_info):
        half = len(train_texts) // 2
        progress = checkpoint_dir / "first-half.json"
        if progress.is_file():
            first = cls(json.loads(progress.read_text()), num_labels)
            log("continuing from the first half")
        else:
            first = WordVotes.fit(train_texts[:half], train_labels[:half], num_labels, config, log)
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            progress.write_text(json.dumps(first.votes))
            if cls.stop_after_half:
                raise KeyboardInterrupt
        second = WordVotes.fit(train_texts[half:], train_labels[half:], num_labels, config, log)
        votes = {word: [a + b for a, b in zip(first.votes.get(word, [0.0] * num_labels),
                                              second.votes.get(word, [0.0] * num_labels))]
                 for word in set(first.votes) | set(second.votes)}
        cls.seen_label_info = label_info
        return cls(votes, num_labels)


def test_a_method_that_keeps_checkpoints_resumes_where_it_stopped(registry, dataset_dir, tmp_path):
    methods = build_registry(extra_plugins=[("checkpointed", votes_plugin(CheckpointedVotes, "checkpointed"))],
                             load_entry_points=False)
    the_plan = plan_run(methods, "checkpointed", str(dataset_dir), set_options=["validation_size=12"])
    reference = launch.run(the_plan, tmp_path / "reference", registry=methods, log=lambda line: None)
    CheckpointedVotes.stop_after_half = True
    with pytest.raises(KeyboardInterrupt):
        launch.run(the_plan, tmp_path / "run", registry=methods, log=lambda line: None)
    CheckpointedVotes.stop_after_half = False
    lines = []
    resumed = launch.run(plan_resume(tmp_path / "run"), tmp_path / "run", registry=methods, log=lines.append,
                         resume=True)
    assert "continuing from the first half" in lines
    assert json.loads((resumed / "metrics.json").read_text()) == json.loads((reference / "metrics.json").read_text())
    assert not (resumed / "checkpoints").exists(), "removed once finished (keep_checkpoint=false)"
    info = CheckpointedVotes.seen_label_info
    dataset = open_dataset(methods, str(dataset_dir))
    assert info.names == tuple(dataset.label_names[:dataset.num_labels]) and info.texts is None
    assert int(info.counts.sum()) == int(dataset.train_labels[:, :dataset.num_labels].sum()) - \
        int(dataset.train_labels[split_train_rows(dataset, the_plan.config)[1]][:, :dataset.num_labels].sum())
    assert (resumed / "model" / "label_info.json").is_file()


def test_a_whole_method_records_the_device_it_computed_on(run_dirs, registry, dataset_dir, tmp_path, monkeypatch):
    resolved = json.loads((run_dirs[0] / "config.json").read_text())["resolved"]
    assert resolved["device"] == "cpu"   # WordVotes computes on the CPU only, whatever the machine has

    class GpuFirst(WordVotes):
        devices = ("cuda", "cpu")

    class GpuOnly(WordVotes):
        devices = ("cuda",)

    monkeypatch.setattr(whole_methods.torch.cuda, "is_available", lambda: True)   # a machine with a GPU
    assert str(whole_methods.method_device("gpu-first", GpuFirst, TrainConfig())) == "cuda"
    with pytest.raises(XmcError, match="votes computes on cpu only; drop --set device=cuda"):
        whole_methods.method_device("votes", WordVotes, TrainConfig(device="cuda"))
    monkeypatch.setattr(whole_methods.torch.cuda, "is_available", lambda: False)   # and one without
    assert str(whole_methods.method_device("gpu-first", GpuFirst, TrainConfig())) == "cpu"
    gpu_only = build_registry(extra_plugins=[("gpu", votes_plugin(GpuOnly, "gpu-only"))], load_entry_points=False)
    with pytest.raises(XmcError, match="gpu-only computes on cuda only, and this machine has none of them"):
        launch.run(plan_run(gpu_only, "gpu-only", str(dataset_dir)), tmp_path / "gpu", registry=gpu_only)
    assert not (tmp_path / "gpu").exists(), "refused before the output folder was touched"
