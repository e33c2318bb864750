"""Model directories fail safely: a truncated, damaged, tampered or mismatched file ends in one XmcError
line that names the file, says what is wrong and what to do; nothing is ever unpickled."""

from __future__ import annotations

import ast
import dataclasses
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

from xmcbench.errors import XmcError
from xmcbench.modelio import REDO, SCHEMA_VERSION, SELF_CHECKSUM, file_digest, load_model_dir, model_size, \
    save_model_dir, signed_description
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.saved import predict_texts

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
        plan = plan_run(registry, "lightxml", str(dataset),
                               set_options=[f"{k}={v}" for k, v in options.items()])
        return launch.run(plan, base / "run", registry=registry, log=lambda line: None)


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


# -- corruptions (each takes the model/ folder) ------------------------------------------------------

def edit_json(path: Path, change) -> None:
    """Rewrite a JSON file with change(value): its result, or the value it changed in place (None). An edited
    model.json gets its own checksum recomputed, as a consistent (or hostile) edit would: each case then
    reaches the check it is about (test_an_edited_model_json_is_refused covers unsigned edits)."""
    value = json.loads(path.read_text())
    result = change(value)
    value = value if result is None else result
    if path.name == "model.json" and isinstance(value, dict):
        value.pop(SELF_CHECKSUM, None)
        value = signed_description(value)
    path.write_text(json.dumps(value, indent=2))


def without(key):
    return lambda mapping: {k: v for k, v in mapping.items() if k != key}


def drop_checksums(model: Path) -> None:
    """What a directory saved before checksums were recorded looks like (or one whose checks were removed)."""
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


def remove_encoder_file(name):
    def corrupt(model):
        (model / "encoder" / name).unlink()
    return corrupt


def damage_tokenizer_consistently(model):
    """A damaged tokenizer.json whose checksum was recorded as it is: the tokenizer itself must refuse it."""
    (model / "encoder" / "tokenizer.json").write_text('{"version": "1.0", "truncat')
    refresh_checksums(model)


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
    "weights-other-shape-consistent-checksums": (resize_tensor("recaller.linear.weight", 1, refresh_checksums),
                                                 ["weights.safetensors", "does not match", "recaller.linear.weight"],
                                                 True),
    "weights-other-shape-of-the-ranker": (resize_tensor("ranker.label_embedding.weight", 3, refresh_checksums),
                                          ["weights.safetensors", "does not match", "ranker.label_embedding.weight",
                                           "[11, 8]", "[8, 8]"], True),
    "checksums-removed": (drop_checksums, ["model.json", "'files'"], True),
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
    "tokenizer-damaged-consistent-checksums": (damage_tokenizer_consistently, ["encoder", "damaged"], True),
    "tokenizer-tampered": (retouch_tokenizer, ["encoder/tokenizer.json", "checksum"], True),
    "encoder-config-missing": (remove_encoder_file("config.json"), ["encoder/config.json", "missing"], True),
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
def test_an_edited_model_json_is_refused(run_copy, registry):
    path = run_copy / "model" / "model.json"
    meta = json.loads(path.read_text())
    meta["config"]["hidden_size"] = 9   # by hand: the checksum of model.json itself no longer matches
    path.write_text(json.dumps(meta))
    with pytest.raises(XmcError, match="does not match its own checksum"):
        load_model_dir(run_copy, registry)
    del meta[SELF_CHECKSUM]
    path.write_text(json.dumps(meta))
    with pytest.raises(XmcError, match="has no checksum of its own"):
        load_model_dir(run_copy, registry)


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



# -- weights stored in half precision ----------------------------------------------------------------

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TEXTS = ["package - audio sound mixer", "database sql query web proxy", "window desktop toolkit manual"]


def resave(run_dir: Path, registry, storage_dtype: str) -> None:
    """Rewrite run_dir's model directory with its floating-point weights stored in `storage_dtype`."""
    model, config, labels = load_model_dir(run_dir, registry)
    save_model_dir(run_dir / "model", model, dataclasses.replace(config, storage_dtype=storage_dtype), labels)


@pytest.fixture(params=list(HALF_DTYPES))
def half_run(request, run_copy, registry) -> tuple[Path, str]:
    resave(run_copy, registry, request.param)
    return run_copy, request.param


def data_bytes(weights: Path) -> int:
    """Bytes of tensor data in a safetensors file (its size less the 8-byte length and the header)."""
    data = weights.read_bytes()
    return len(data) - 8 - int.from_bytes(data[:8], "little")


@slow
def test_half_precision_round_trip(half_run, trained_run, registry):
    run_dir, name = half_run
    dtype = HALF_DTYPES[name]
    full_file, half_file = trained_run / "model" / "weights.safetensors", run_dir / "model" / "weights.safetensors"
    original, config, _ = load_model_dir(trained_run, registry)
    loaded, loaded_config, _ = load_model_dir(run_dir, registry)

    size = model_size(original)
    assert size["parameters"] == sum(p.numel() for p in original.parameters())
    assert data_bytes(full_file) == size["bytes"]["float32"] and data_bytes(half_file) == size["bytes"][name]
    assert half_file.stat().st_size < 0.6 * full_file.stat().st_size

    meta = json.loads((run_dir / "model" / "model.json").read_text())
    assert meta["storage_dtype"] == meta["config"]["storage_dtype"] == loaded_config.storage_dtype == name
    header = json.loads(half_file.read_bytes()[8:8 + int.from_bytes(half_file.read_bytes()[:8], "little")])
    stored = {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}
    # label clusters stay integers, the flag that a recaller's PIFA rows were set stays a bool
    assert stored == {{"float16": "F16", "bfloat16": "BF16"}[name], "I64", "BOOL"}

    expected, found = original.state_dict(), loaded.state_dict()
    assert expected.keys() == found.keys()
    for key, tensor in expected.items():
        assert found[key].dtype == tensor.dtype, key          # upcast back to the model's float32
        rounded = tensor.to(dtype).float() if tensor.is_floating_point() else tensor
        assert torch.equal(found[key], rounded), key
    assert any(not torch.equal(found[k], t) for k, t in expected.items() if t.is_floating_point())

    full = predict_texts(trained_run, TEXTS, top_k=3, registry=registry)
    half = predict_texts(run_dir, TEXTS, top_k=3, registry=registry)
    for a, b in zip(full, half):
        assert a["labels"][0] == b["labels"][0], (a, b)
        assert max(abs(x - y) for x, y in zip(a["scores"], b["scores"])) < 5e-3, (a, b)


@slow
def test_a_float32_save_writes_the_same_file_as_before(run_copy, trained_run, registry):
    resave(run_copy, registry, "float32")
    meta = json.loads((run_copy / "model" / "model.json").read_text())
    assert meta["storage_dtype"] == "float32"
    assert (run_copy / "model" / "weights.safetensors").read_bytes() == \
        (trained_run / "model" / "weights.safetensors").read_bytes()


@slow
def test_a_directory_saved_before_storage_dtypes_loads_as_float32(run_copy, registry):
    def forget(meta):
        del meta["storage_dtype"], meta["config"]["storage_dtype"]
    edit_json(run_copy / "model" / "model.json", forget)
    model, config, _ = load_model_dir(run_copy, registry)
    assert config.storage_dtype == "float32"
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())


def half_stored_as_float32(model):
    """model.json claims float32 weights for a file that holds half ones."""
    edit_json(model / "model.json", lambda meta: meta.update(storage_dtype="float32"))


def one_tensor_in_float32(model):
    """One tensor written back in float32, with checksums recorded for the new file."""
    weights = model / "weights.safetensors"
    tensors = load_file(str(weights))
    tensors["recaller.linear.bias"] = tensors["recaller.linear.bias"].float()
    save_file(tensors, str(weights))
    refresh_checksums(model)


def unreadable_storage_dtype(model):
    edit_json(model / "model.json", lambda meta: meta.update(storage_dtype="float8"))


HALF_CORRUPTIONS = {
    "weights-truncated": CORRUPTIONS["weights-truncated"],
    "weights-tampered": CORRUPTIONS["weights-tampered"],
    "weights-other-shape-consistent-checksums": CORRUPTIONS["weights-other-shape-consistent-checksums"],
    "weights-other-model": CORRUPTIONS["weights-other-model"],
    "dtype-other-than-recorded": (half_stored_as_float32, ["weights.safetensors", "does not match model.json",
                                                           "storage_dtype float32", "F32"], True),
    "one-tensor-in-float32": (one_tensor_in_float32, ["weights.safetensors", "'recaller.linear.bias'",
                                                      "stored as F32"], True),
    "storage-dtype-unreadable": (unreadable_storage_dtype, ["model.json", "'float8'", "float16", "upgrade"], True),
}


@slow
@pytest.mark.parametrize("case", list(HALF_CORRUPTIONS))
def test_a_damaged_half_precision_directory_ends_in_one_line(case, half_run, registry):
    run_dir, _ = half_run
    corrupt, words, says_redo = HALF_CORRUPTIONS[case]
    corrupt(run_dir / "model")
    with pytest.raises(XmcError) as raised:
        load_model_dir(run_dir, registry)
    message = str(raised.value)
    assert "\n" not in message and "\r" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert (REDO in message) == says_redo, message


@slow
def test_a_bad_storage_dtype_ends_in_one_line_and_writes_nothing(trained_run, registry, tmp_path):
    model, config, labels = load_model_dir(trained_run, registry)
    with pytest.raises(XmcError) as raised:
        save_model_dir(tmp_path / "model", model, dataclasses.replace(config, storage_dtype="half"), labels)
    message = str(raised.value)
    assert "\n" not in message and "'half'" in message, message
    assert all(name in message for name in ("float32", "float16", "bfloat16")), message
    assert not (tmp_path / "model").exists()


@slow
def test_weights_beyond_float16s_range_end_in_one_line(trained_run, registry, tmp_path):
    model, config, labels = load_model_dir(trained_run, registry)
    with torch.no_grad():
        model.recaller.linear.bias[0] = 1e6
    with pytest.raises(XmcError) as raised:
        save_model_dir(tmp_path / "half", model, dataclasses.replace(config, storage_dtype="float16"), labels)
    assert "recaller.linear.bias" in str(raised.value) and "bfloat16" in str(raised.value)
    assert not (tmp_path / "half").exists()
    save_model_dir(tmp_path / "bf16", model, dataclasses.replace(config, storage_dtype="bfloat16"), labels)
    loaded, _, _ = load_model_dir(tmp_path / "bf16", registry)
    assert loaded.recaller.linear.bias[0] == torch.tensor(1e6).to(torch.bfloat16).float()


def test_a_bad_storage_dtype_setting_is_one_line():
    from xmcbench.config import TrainConfig, apply_overrides
    from xmcbench.modelio import storage_dtype

    assert storage_dtype(apply_overrides(TrainConfig(), {"storage_dtype": "bfloat16"}, "--set").storage_dtype) \
        is torch.bfloat16
    with pytest.raises(XmcError) as raised:
        storage_dtype(apply_overrides(TrainConfig(), {"storage_dtype": "fp16"}, "--set").storage_dtype)
    assert str(raised.value).count("\n") == 0 and "float32, float16, bfloat16" in str(raised.value)
    with pytest.raises(XmcError, match="storage_dtype must be str"):
        apply_overrides(TrainConfig(), {"storage_dtype": 16}, "config.toml")

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


def test_a_bad_storage_dtype_is_refused_before_any_data_is_read():
    from xmcbench.registry import build_registry

    with pytest.raises(XmcError, match="storage_dtype='half'.*float16"):
        plan_run(build_registry(), "lightxml", "debian-debtags-mini", set_options=["storage_dtype=half"])
