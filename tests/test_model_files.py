"""Model directories fail safely: a truncated, damaged, tampered or mismatched file ends in one XmcError
line that names the file, says what is wrong and what to do; nothing is ever unpickled."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from xmcbench import runner
from xmcbench.errors import XmcError
from xmcbench.modelio import REDO, SCHEMA_VERSION, file_digest, load_model_dir
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset

REPO = Path(__file__).resolve().parents[1]
slow = pytest.mark.slow


# -- one tiny trained model per module ---------------------------------------------------------------

@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.fixture(scope="module")
def trained_run(registry, tiny_model_dir, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("model-files")
    dataset = write_tiny_dataset(base / "tiny-topics")
    options = {"model_name": str(tiny_model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
               "max_length": 32, "threads": 1, "cluster_size": 2, "top_clusters": 2, "hidden_size": 8}
    with pytest.MonkeyPatch.context() as patch:   # the autouse cache fixture is function-scoped
        patch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        plan = runner.plan_run(registry, "lightxml", str(dataset),
                               set_options=[f"{k}={v}" for k, v in options.items()])
        return runner.run(plan, base / "run", registry=registry, log=lambda line: None)


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


# -- corruptions (each takes the model/ folder) ------------------------------------------------------

def edit_json(path: Path, change) -> None:
    """Rewrite a JSON file with change(value): its result, or the value it changed in place (None)."""
    value = json.loads(path.read_text())
    result = change(value)
    path.write_text(json.dumps(value if result is None else result, indent=2))


def without(key):
    return lambda mapping: {k: v for k, v in mapping.items() if k != key}


def drop_checksums(model: Path) -> None:
    """What a directory saved before checksums were recorded looks like."""
    edit_json(model / "model.json", without("files"))


def refresh_checksums(model: Path) -> None:
    """Record the current files, as if model.json had been written for them."""
    def change(meta):
        meta["files"] = {name: file_digest(model / name) for name in meta["files"] if (model / name).exists()}
    edit_json(model / "model.json", change)


def truncate_weights(model):
    weights = model / "weights.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])


def garbage_weights(model):
    (model / "weights.safetensors").write_bytes(b"\x89 these are not tensors \x00\xff\n" * 300)


def remove_weights(model):
    (model / "weights.safetensors").unlink()


def flip_weight_byte(model):
    weights = model / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data_start = 8 + int.from_bytes(data[:8], "little")
    data[data_start + (len(data) - data_start) // 2] ^= 0x01   # inside the tensor data, header untouched
    weights.write_bytes(bytes(data))


def resize_tensor(name, extra_rows, checksums):
    def corrupt(model):
        weights = model / "weights.safetensors"
        tensors = load_file(str(weights))
        old = tensors[name]
        tensors[name] = torch.zeros(old.shape[0] + extra_rows, *old.shape[1:], dtype=old.dtype)
        save_file(tensors, str(weights), metadata={"format": "pt"})
        checksums(model)
    return corrupt


def drop_last_label(model):
    edit_json(model / "labels.json", lambda labels: labels[:-1])


def labels_not_strings(model):
    edit_json(model / "labels.json", lambda labels: list(range(len(labels))))


def remove_labels(model):
    (model / "labels.json").unlink()


def truncate_model_json(model):
    text = (model / "model.json").read_text()
    (model / "model.json").write_text(text[:len(text) // 2])


def model_json_without(key):
    return lambda model: edit_json(model / "model.json", without(key))


def model_json_list(model):
    (model / "model.json").write_text("[1, 2, 3]\n")


def newer_schema(model):
    edit_json(model / "model.json", lambda meta: meta.update(schema=SCHEMA_VERSION + 1, xmcbench_version="9.0"))


def unknown_setting(model):
    edit_json(model / "model.json", lambda meta: meta["config"].update(setting_from_the_future=1))


def unknown_component(kind, name):
    return lambda model: edit_json(model / "model.json", lambda meta: meta["config"].update({kind: name}))


def remove_encoder(model):
    shutil.rmtree(model / "encoder")


def remove_encoder_file(name, checksums=True):
    def corrupt(model):
        (model / "encoder" / name).unlink()
        if not checksums:
            drop_checksums(model)
    return corrupt


def damage_tokenizer(checksums):
    def corrupt(model):
        (model / "encoder" / "tokenizer.json").write_text('{"version": "1.0", "truncat')
        if not checksums:
            drop_checksums(model)
    return corrupt


def retouch_tokenizer(model):
    """Same size, one character changed: only the checksum can tell."""
    path = model / "encoder" / "tokenizer.json"
    text = path.read_text()
    index = text.index('"[UNK]"')
    path.write_text(text[:index] + '"[UNX]"' + text[index + 7:])


CORRUPTIONS = {
    # id: (corrupt, words the message holds, whether it says to re-run training / copy again)
    "weights-truncated": (truncate_weights, ["weights.safetensors", "truncated"], True),
    "weights-garbage": (garbage_weights, ["weights.safetensors", "not a safetensors file"], True),
    "weights-missing": (remove_weights, ["weights.safetensors", "missing"], True),
    "weights-tampered": (flip_weight_byte, ["weights.safetensors", "checksum"], True),
    "weights-other-shape-old-format": (resize_tensor("ranker.label_embedding.weight", 3, drop_checksums),
                                       ["weights.safetensors", "does not match", "ranker.label_embedding.weight",
                                        "[11, 8]", "[8, 8]"], True),
    "weights-other-shape-consistent-checksums": (resize_tensor("recaller.linear.weight", 1, refresh_checksums),
                                                 ["weights.safetensors", "does not match", "recaller.linear.weight"],
                                                 True),
    "weights-other-model": (resize_tensor("recaller.linear.bias", 2, lambda model: None),
                            ["weights.safetensors", "model.json recorded", "another model"], True),
    "labels-count": (drop_last_label, ["labels.json", "7 labels", "8", "does not match"], True),
    "labels-not-strings": (labels_not_strings, ["labels.json", "list of label names"], True),
    "labels-missing": (remove_labels, ["labels.json", "missing"], True),
    "model-json-invalid": (truncate_model_json, ["model.json", "not valid JSON"], True),
    "model-json-not-object": (model_json_list, ["model.json", "JSON object"], True),
    "model-json-no-num-labels": (model_json_without("num_labels"), ["model.json", "'num_labels'"], True),
    "model-json-no-config": (model_json_without("config"), ["model.json", "'config'"], True),
    "model-json-newer-schema": (newer_schema, ["model.json", f"schema {SCHEMA_VERSION + 1}", "newer xmcbench 9.0",
                                               "upgrade xmcbench"], False),
    "model-json-unknown-setting": (unknown_setting, ["model.json", "setting_from_the_future", "upgrade"], True),
    "unknown-encoder": (unknown_component("encoder", "fancy-encoder"),
                        ["model.json", "encoder 'fancy-encoder'", "install the plugin"], False),
    "unknown-ranker": (unknown_component("ranker", "fancy-ranker"),
                       ["ranker 'fancy-ranker'", "install the plugin"], False),
    "encoder-folder-missing": (remove_encoder, ["encoder", "missing"], True),
    "tokenizer-missing": (remove_encoder_file("tokenizer.json"), ["encoder/tokenizer.json", "missing"], True),
    "tokenizer-missing-old-format": (remove_encoder_file("tokenizer.json", checksums=False),
                                     ["encoder", "no tokenizer vocabulary"], True),
    "tokenizer-damaged-old-format": (damage_tokenizer(checksums=False), ["encoder", "damaged"], True),
    "tokenizer-tampered": (retouch_tokenizer, ["encoder/tokenizer.json", "checksum"], True),
    "encoder-config-missing": (remove_encoder_file("config.json"), ["encoder/config.json", "missing"], True),
    "encoder-config-missing-old-format": (remove_encoder_file("config.json", checksums=False),
                                          ["encoder/config.json", "missing"], True),
}


@slow
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_damaged_model_directory_ends_in_one_line(case, run_copy, registry):
    corrupt, words, says_redo = CORRUPTIONS[case]
    corrupt(run_copy / "model")
    with pytest.raises(XmcError) as raised:
        load_model_dir(run_copy, registry)
    message = str(raised.value)
    assert "\n" not in message and "\r" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert (REDO in message) == says_redo, message


@slow
def test_an_intact_copy_loads_and_records_checksums(run_copy, registry):
    meta = json.loads((run_copy / "model" / "model.json").read_text())
    assert {"weights.safetensors", "labels.json", "encoder/config.json", "encoder/tokenizer.json"} <= set(meta["files"])
    assert all(len(record["sha256"]) == 64 and record["bytes"] > 0 for record in meta["files"].values())
    model, config, labels = load_model_dir(run_copy, registry)
    assert len(labels) == meta["num_labels"] == 8 and config.hidden_size == 8
    assert not model.training


@slow
def test_a_directory_saved_without_checksums_still_loads(run_copy, registry):
    drop_checksums(run_copy / "model")
    _, _, labels = load_model_dir(run_copy / "model", registry)
    assert len(labels) == 8


@slow
def test_loading_never_unpickles(run_copy, registry, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something unpickled while loading a model directory")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load_model_dir(run_copy, registry)


@slow
@pytest.mark.parametrize("case", ["weights-truncated", "model-json-newer-schema", "unknown-encoder"])
def test_predict_reports_a_damaged_model_in_one_line(case, run_copy):
    CORRUPTIONS[case][0](run_copy / "model")
    result = subprocess.run([sys.executable, "-m", "xmcbench", "predict", str(run_copy)], input="text\n",
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xmcbench: error: "), result.stderr
    assert result.stdout == ""


# -- no pickle anywhere in the package ---------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """`file:line what` for each import of a pickle module, each torch.load without weights_only=True, and
    each numpy load with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLE_MODULES:
                found.append(f"{where} from {node.module} import ...")
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where} from torch import load")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            parts = name.split(".")
            if name.endswith("torch.load") and not _keyword_is_true(node, "weights_only"):
                found.append(f"{where} {name}( without weights_only=True")
            elif parts[0] in PICKLE_MODULES and parts[-1] in ("load", "loads", "Unpickler"):
                found.append(f"{where} {name}(")
            elif parts[-1] == "read_pickle":
                found.append(f"{where} {name}(")
            elif parts[-1] == "load" and parts[0] in ("np", "numpy") and _keyword_is_true(node, "allow_pickle"):
                found.append(f"{where} {name}( with allow_pickle=True")
    return found


def test_the_scanner_finds_unsafe_loads():
    source = ("import pickle\nimport torch\nfrom dill import loads\n"
              "a = torch.load(path)\nb = torch.load(path, weights_only=False)\nc = pickle.loads(data)\n"
              "d = np.load(path, allow_pickle=True)\n"
              "ok = torch.load(path, weights_only=True)\nok2 = np.load(path, allow_pickle=False)\n")
    found = unsafe_loads(source)
    assert len(found) == 6, found
    assert not unsafe_loads("'''torch.load(x) and import pickle, in a docstring'''\n")


def test_no_pickle_and_no_unsafe_torch_load_in_the_package():
    files = sorted((REPO / "xmcbench").rglob("*.py")) + sorted((REPO / "plugins").rglob("*.py"))
    assert files
    found = []
    for path in files:
        found += unsafe_loads(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not found, "loading must never unpickle: " + "; ".join(found)
