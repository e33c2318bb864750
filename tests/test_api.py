"""The Python API (xmcbench.api, docs/api.md): its examples run, a model loads once, bad inputs fail in one line."""

import re
from pathlib import Path

import pytest

import xmcbench
from xmcbench import api, ensemble
from xmcbench import saved as saved_models
from xmcbench.errors import XmcError
from xmcbench.testing import write_tiny_dataset
from xmcbench.data import IN_MEMORY
from xmcbench.models import load_model
from xmcbench.saved import predict_texts

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"
WORDS = {"graphics": "image png jpeg pixel", "network": "socket http server tcp", "database": "sql query table index"}


def tiny_settings(model_dir):
    return dict(model_name=str(model_dir), pretrained_weights=False, num_layers=2, epochs=1, max_length=16,
                threads=1, hidden_size=8)


def tiny_data(train=24, test=6):
    names = sorted(WORDS)

    def document(i):
        chosen = [names[i % 3]] + ([names[(i + 1) % 3]] if i % 2 else [])
        return " ".join(WORDS[name] for name in chosen), chosen

    rows = [document(i) for i in range(train + test)]
    return ([t for t, _ in rows[:train]], [labels for _, labels in rows[:train]],
            [t for t, _ in rows[train:]], [labels for _, labels in rows[train:]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("api")
    data = tiny_data()
    run = xmcbench.train("lightxml", data, output=root / "run", log=None, **tiny_settings(tiny_model_dir))
    return {"run": run, "data": data, "root": root}


def test_the_examples_in_docs_api_md_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path / "cache"))
    namespace = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"{DOCS}:block{number + 1}", "exec"), namespace)
    assert (tmp_path / "runs" / "tiny" / "metrics.json").is_file()


def test_train_on_data_in_memory_writes_a_run(trained):
    run = trained["run"]
    assert isinstance(run, xmcbench.Run)
    assert (run.path / "metrics.json").is_file() and "P@1" in run.metrics
    assert run.config["dataset"].startswith(IN_MEMORY)
    assert run.config["dataset"] == f"{IN_MEMORY}{run.config['dataset_version']}"
    assert run.config["config"]["epochs"] == 1 and run.config["config"]["pretrained_weights"] is False


def test_a_predictor_loads_the_model_once_and_predicts_many_times(trained, monkeypatch):
    calls = []
    original = load_model
    monkeypatch.setattr(saved_models, "load_model", lambda *args: calls.append(args) or original(*args))
    predictor = xmcbench.load(trained["run"].path)
    texts = ["png image pixel", "sql table query", "tcp socket"]
    first = predictor.predict(texts, top_k=3)
    for _ in range(3):
        assert predictor.predict(texts, top_k=3) == first
    predictor.predict(texts[:1], top_k=1)
    predictor.evaluate(trained["data"])
    assert len(calls) == 1
    assert len(first) == 3 and all(len(r["labels"]) == len(r["scores"]) == 3 for r in first)
    assert all(r["scores"] == sorted(r["scores"], reverse=True) for r in first)
    assert set(predictor.label_names) == set(WORDS)
    assert first == predict_texts(trained["run"].path, texts, top_k=3)   # what `xmcbench predict` writes


def test_threshold_drops_the_labels_scoring_below_it(trained):
    predictor = trained["run"].predictor()
    everything = predictor.predict(["png image pixel"], top_k=3)[0]
    middle = sorted(everything["scores"])[1]
    kept = predictor.predict(["png image pixel"], top_k=3, threshold=middle)[0]
    assert kept["scores"] == [s for s in everything["scores"] if s >= middle]
    assert len(kept["labels"]) == 2
    assert predictor.predict(["png image pixel"], top_k=3, threshold=2.0)[0] == {"labels": [], "scores": []}


def test_evaluate_gives_the_run_metrics_again(trained):
    run = trained["run"]
    metrics = xmcbench.evaluate(run.path, trained["data"])
    assert metrics["P@1"] == pytest.approx(run.metrics["P@1"])
    assert run.evaluate()["P@1"] == pytest.approx(run.metrics["P@1"])   # the data kept in memory
    assert xmcbench.evaluate(run.predictor(), dict(zip(api.IN_MEMORY_KEYS, trained["data"])))["P@5"] == \
        pytest.approx(run.metrics["P@5"])


def test_a_run_on_data_in_memory_asks_for_the_data_again(trained):
    with pytest.raises(XmcError, match="pass the data again") as caught:
        xmcbench.evaluate(trained["run"].path)
    assert "\n" not in str(caught.value)


def test_an_ensemble_directory_loads_as_one_predictor(tmp_path, tiny_model_dir, monkeypatch):
    dataset = write_tiny_dataset(tmp_path / "tiny-topics")
    settings = {**tiny_settings(tiny_model_dir), "max_length": 32, "cluster_size": 2, "top_clusters": 2}
    members = [xmcbench.train("lightxml", dataset, output=tmp_path / f"seed{seed}", seed=seed, log=None,
                              **settings).path for seed in (1, 2)]
    directory = ensemble.build_ensemble(members, tmp_path / "ens", log=lambda line: None)
    calls = []
    original = load_model
    monkeypatch.setattr(saved_models, "load_model", lambda *args: calls.append(args) or original(*args))
    predictor = xmcbench.load(directory)
    texts = ["library for sql databases", "gtk widgets"]
    first = predictor.predict(texts, top_k=4)
    assert predictor.predict(texts, top_k=4) == first
    assert len(calls) == 2   # each member once
    monkeypatch.setattr(saved_models, "load_model", original)
    assert first == saved_models.predict_texts(directory, texts, top_k=4)
    assert xmcbench.evaluate(predictor)["P@1"] == pytest.approx(saved_models.evaluate(directory)["P@1"])


def one_line_error(call):
    with pytest.raises(XmcError) as caught:
        call()
    message = str(caught.value)
    assert message and "\n" not in message
    return message


def test_bad_inputs_end_in_one_line(trained, tiny_model_dir, tmp_path):
    train_texts, train_labels, test_texts, test_labels = tiny_data()
    settings = tiny_settings(tiny_model_dir)
    assert "rows for" in one_line_error(lambda: xmcbench.train(
        "lightxml", (train_texts, train_labels[:-1], test_texts, test_labels), output=tmp_path / "a", **settings))
    assert "unknown method" in one_line_error(lambda: xmcbench.train(
        "lightxmll", tiny_data(), output=tmp_path / "b", **settings))
    assert "unknown setting" in one_line_error(lambda: xmcbench.train(
        "lightxml", tiny_data(), output=tmp_path / "c", epochz=1))
    assert "list of label names" in one_line_error(lambda: xmcbench.train(
        "lightxml", (train_texts, ["graphics"] * len(train_texts), test_texts, test_labels), **settings))
    assert "4 parts" in one_line_error(lambda: xmcbench.train("lightxml", (train_texts, train_labels), **settings))
    predictor = trained["run"].predictor()
    assert "list of strings" in one_line_error(lambda: predictor.predict("one text"))
    assert "top-k" in one_line_error(lambda: predictor.predict(["x"], top_k=0))
    assert "does not exist" in one_line_error(lambda: xmcbench.load(tmp_path / "missing"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_errors_say_their_kind_and_keep_their_one_line(trained, tmp_path):
    from xmcbench.errors import BadData, DamagedModel, RefusedSetting, UnknownName

    def raised(action):
        with pytest.raises(XmcError) as caught:
            action()
        assert "\n" not in str(caught.value)
        return type(caught.value)

    assert raised(lambda: xmcbench.resolved_config("lightxmll")) is UnknownName
    assert raised(lambda: xmcbench.resolved_config("lightxml", set_options=["epochz=1"])) is UnknownName
    assert raised(lambda: xmcbench.resolved_config("lightxml", set_options=["epochs=three"])) is RefusedSetting
    assert raised(lambda: xmcbench.resolved_config("lightxml", tmp_path / "no-such-dataset")) is UnknownName
    (tmp_path / "empty").mkdir()
    assert raised(lambda: xmcbench.resolved_config("lightxml", tmp_path / "empty")) is BadData
    damaged = tmp_path / "damaged"
    (damaged / "model").mkdir(parents=True)
    (damaged / "model" / "model.json").write_text("[1, 2]")
    assert raised(lambda: xmcbench.load(damaged)) is DamagedModel
    assert all(issubclass(kind, XmcError) for kind in (BadData, DamagedModel, RefusedSetting, UnknownName))


def test_settings_become_set_options():
    assert api._set_options({"epochs": 1, "pretrained_weights": False, "eval_ks": (1, 3), "options": {"a": 2}}) == \
        ["epochs=1", "pretrained_weights=false", "eval_ks=1,3", "options.a=2"]
