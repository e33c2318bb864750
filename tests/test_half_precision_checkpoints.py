"""Encoders published in half precision: float32 master weights whatever dtype the files hold."""

import json

import pytest
import torch

from xmcbench.registry import build_registry
from xmcbench.testing import make_tiny_transformer, tiny_config
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run

HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", params=list(HALF))
def half_checkpoint(request, tmp_path_factory):
    """A tiny BERT whose model.safetensors holds `dtype` weights, as checkpoints are often published."""
    from transformers import AutoConfig, AutoModel

    folder = make_tiny_transformer(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(folder)).to(HALF[request.param]).save_pretrained(folder)
    return folder, request.param


def test_half_precision_weights_load_as_float32_master_weights(half_checkpoint):
    from safetensors.torch import load_file

    folder, name = half_checkpoint
    config = tiny_config(folder, pretrained_weights=True)
    encoder = build_registry().component("encoder", "transformer-cls")(config)
    assert encoder.loaded_dtype == name
    parameters = dict(encoder.transformer.named_parameters())
    assert {p.dtype for p in parameters.values()} == {torch.float32}
    stored = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {HALF[name]}
    for key, tensor in stored.items():   # the stored values, exactly, upcast
        if key in parameters:
            assert torch.equal(parameters[key], tensor.float()), key
    ids = encoder.tokenizer(["a short text", "another one"], return_tensors="pt", padding=True)
    out = encoder(ids["input_ids"], ids["attention_mask"])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.slow
def test_a_run_records_the_loaded_dtype(half_checkpoint, tiny_dataset, tmp_path):
    folder, name = half_checkpoint
    registry = build_registry()
    options = {"model_name": str(folder), "pretrained_weights": "true", "num_layers": 2, "epochs": 1,
               "batch_size": 8, "max_length": 32, "threads": 1}
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=[f"{k}={v}" for k, v in options.items()])
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    resolved = json.loads((run_dir / "config.json").read_text())["resolved"]
    assert resolved["encoder_loaded_dtype"] == name and resolved["parameter_dtype"] == "float32"
    steps = json.loads((run_dir / "training_log.json").read_text())["steps"]
    assert all(torch.isfinite(torch.tensor(step["loss"])) for step in steps)
