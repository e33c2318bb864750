"""`transformer-cls` with options.lexical_buckets=F: the [CLS] states followed by a bag of the window's word pieces
(1 + log(count) per bucket of ids modulo F, padding and special tokens left out), which every head reads; with
options.lexical_window=W the bag reads W tokens of each document and the transformer max_length of them."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from xmcbench.errors import XmcError
from xmcbench.models import load_model, predict_documents
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


LONG_TEXTS = ["apt cache " * 20 + "tail words only the bag sees", "short text", "dpkg " * 9]


def test_with_a_longer_window_the_encoder_passes_the_encoder_checks(tiny_model_dir):
    check_encoder(build_transformer_cls, tiny_config(tiny_model_dir, max_length=8,
                                                     options={"lexical_buckets": "16", "lexical_window": "64"}))


def test_the_transformer_reads_what_the_tokenizer_gives_at_max_length_and_the_bag_reads_the_window(tiny_model_dir):
    windowed = build_transformer_cls(tiny_config(tiny_model_dir, max_length=16, options={
        "lexical_buckets": "7", "lexical_window": "256"})).eval()
    plain = build_transformer_cls(tiny_config(tiny_model_dir, max_length=16, options={"lexical_buckets": "7"})).eval()
    plain.load_state_dict(windowed.state_dict())
    assert windowed.tokens_to_read(16) == 256 and plain.tokens_to_read(16) == 16
    tokenizer = windowed.tokenizer
    whole = tokenizer(LONG_TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")
    cut = tokenizer(LONG_TEXTS, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    assert whole["input_ids"].shape[1] > 16
    ids, mask = windowed.transformer_window(whole["input_ids"], whole["attention_mask"])
    assert ids.tolist() == cut["input_ids"].tolist() and mask.tolist() == cut["attention_mask"].tolist()
    with torch.no_grad():
        read_whole = windowed(whole["input_ids"], whole["attention_mask"])
        read_cut = plain(cut["input_ids"], cut["attention_mask"])
    summary = plain.out_dim - 7
    assert torch.allclose(read_whole[:, :summary], read_cut[:, :summary], atol=1e-5)
    specials = set(tokenizer.all_special_ids)
    for row, (document, kept) in enumerate(zip(whole["input_ids"].tolist(), whole["attention_mask"].tolist())):
        counts = Counter(token % 7 for token, on in zip(document, kept) if on and token not in specials)
        expected = [1 + math.log(counts[bucket]) if counts[bucket] else 0.0 for bucket in range(7)]
        assert read_whole[row, summary:].tolist() == torch.tensor(expected).tolist()
    assert read_whole[0, summary:].sum() > read_cut[0, summary:].sum()   # the words past the window count


def test_a_normed_bag_has_the_set_length_whatever_the_text_length(tiny_model_dir):
    raw = build_transformer_cls(tiny_config(tiny_model_dir, options={"lexical_buckets": "7"})).eval()
    normed = build_transformer_cls(tiny_config(tiny_model_dir, options={"lexical_buckets": "7",
                                                                         "lexical_norm": "3"})).eval()
    summary = raw.out_dim - 7
    batch = raw.tokenizer(["apt apt apt cache " * 5, "cache", ""], padding=True, return_tensors="pt")
    with torch.no_grad():
        raw_bag = raw(batch["input_ids"], batch["attention_mask"])[:, summary:]         # (3, 7)
        normed_bag = normed(batch["input_ids"], batch["attention_mask"])[:, summary:]
    assert raw_bag[0].norm() > raw_bag[1].norm() > 0
    assert normed_bag[:2].norm(dim=1).tolist() == pytest.approx([3.0, 3.0])
    assert torch.allclose(normed_bag[0] / 3, raw_bag[0] / raw_bag[0].norm())   # the same direction
    assert normed_bag[2].abs().sum() == 0                                         # a text with no word piece


@pytest.mark.parametrize("options, message", [
    ({"lexical_window": "64"}, "there is no bag"),
    ({"lexical_norm": "1"}, "there is no bag"),
    ({"lexical_window": "64", "lexical_buckets": "8", "padding": "left"}, "pads and truncates on the right"),
])
def test_a_bag_setting_the_encoder_cannot_honour_ends_in_one_line(tiny_model_dir, options, message):
    options = dict(options)   # the parameters are shared between runs of the test
    padding = options.pop("padding", None)
    config = tiny_config(tiny_model_dir, options=options)
    if padding:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        tokenizer.padding_side = padding
        config_dir = tiny_model_dir.parent / "left-padded"
        if not config_dir.exists():
            import shutil
            shutil.copytree(tiny_model_dir, config_dir)
            tokenizer.save_pretrained(config_dir)
        config = tiny_config(config_dir, options=options)
    with pytest.raises(XmcError, match=message):
        build_transformer_cls(config)


def test_a_run_with_a_longer_window_tokenizes_to_it_and_predicts_from_its_saved_model(tiny_model_dir, tmp_path):
    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "data")
    plan = plan_run(registry, "lightxml", str(data), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=8",
        "threads=1", "cluster_size=1", "options.lexical_buckets=32", "options.lexical_window=64"])
    launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["config"]["options"]["lexical_window"] == 64
    model, saved_config, _ = load_model(tmp_path / "run", registry)
    assert model.encoder.tokens_to_read(saved_config.max_length) == 64
    found = predict_documents(model, LONG_TEXTS, None, saved_config, model_dir=tmp_path / "run")   # its tail slots
    assert len(found.labels) == len(LONG_TEXTS)
