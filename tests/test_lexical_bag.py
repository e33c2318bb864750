"""`transformer-cls` with options.lexical_buckets=F: the [CLS] states followed by a bag of the window's word pieces
(1 + log(count) per bucket of ids modulo F, padding and special tokens left out), which every head reads."""

from __future__ import annotations

import json
import math
from collections import Counter

import torch
from safetensors.torch import load_file

from xmcbench.registry import build_registry
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.testing import check_encoder, tiny_config, write_tiny_dataset
from xmcbench_lightxml.encoder import build_transformer_cls


def test_the_encoder_with_a_lexical_bag_passes_the_encoder_checks(tiny_model_dir):
    check_encoder(build_transformer_cls, tiny_config(tiny_model_dir, options={"lexical_buckets": "16"}))


def test_the_bag_counts_each_word_piece_of_the_window_once_per_occurrence(tiny_model_dir):
    config = tiny_config(tiny_model_dir, options={"lexical_buckets": "7"})
    encoder = build_transformer_cls(config).eval()
    plain = build_transformer_cls(tiny_config(tiny_model_dir))
    assert encoder.out_dim == plain.out_dim + 7
    batch = encoder.tokenizer(["apt apt apt cache", "cache"], padding=True, return_tensors="pt")
    with torch.no_grad():
        representation = encoder(batch["input_ids"], batch["attention_mask"])            # (2, D + 7)
    specials = set(encoder.tokenizer.all_special_ids)
    for row, (ids, mask) in enumerate(zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())):
        counts = Counter(token % 7 for token, kept in zip(ids, mask) if kept and token not in specials)
        expected = [1 + math.log(counts[bucket]) if counts[bucket] else 0.0 for bucket in range(7)]
        assert representation[row, plain.out_dim:].tolist() == torch.tensor(expected).tolist()
    assert representation[0, plain.out_dim:].sum() > representation[1, plain.out_dim:].sum() > 0


def test_a_run_with_a_lexical_bag_trains_heads_as_wide_as_the_representation(tiny_model_dir, tmp_path):
    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "data")
    plan = plan_run(registry, "lightxml", str(data), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32",
        "threads=1", "cluster_size=1", "options.lexical_buckets=32"])
    launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["config"]["options"]["lexical_buckets"] == 32
    encoder = build_transformer_cls(tiny_config(tiny_model_dir, num_layers=2))
    rows = load_file(tmp_path / "run" / "model" / "weights.safetensors")["recaller.linear.weight"]
    assert rows.shape[1] == encoder.out_dim + 32
    assert (tmp_path / "run" / "metrics.json").is_file()
