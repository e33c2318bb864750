"""xmcbench-xmlcnn: the encoder against xmcbench's conformance suite, its own properties (short texts,
padding), the plugin as installed (entry point), and a tiny end-to-end run through the real pipeline.

Needs the package installed (`pip install -e plugins/xmcbench-xmlcnn`): xmcbench finds it only through
its entry point. Nothing is downloaded: the tokenizer is the bundled all-MiniLM-L6-v2's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from xmcbench.errors import XmcError
from xmcbench.registry import build_registry
from xmcbench.testing import check_component, check_encoder, make_tiny_transformer, tiny_config, write_tiny_dataset
from xmcbench_xmlcnn.encoder import XMLCNNEncoder, build_xmlcnn
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run

# small shapes so every test takes well under a second per forward pass
SMALL = {"xmlcnn_emb_dim": 16, "xmlcnn_num_filters": 4, "xmlcnn_pool_chunks": 3, "xmlcnn_hidden": 12}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_transformer(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def small_config(model_dir: Path, **options):
    return tiny_config(model_dir, options={**SMALL, **options})


def batch(encoder: XMLCNNEncoder, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = encoder.tokenizer(texts, padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def pad_right(ids: torch.Tensor, mask: torch.Tensor, extra: int, pad_id: int):
    return (torch.nn.functional.pad(ids, (0, extra), value=pad_id), torch.nn.functional.pad(mask, (0, extra)))


# -- conformance ------------------------------------------------------------------------------------

def test_encoder_conforms_with_default_shapes(model_dir):
    check_encoder(build_xmlcnn, tiny_config(model_dir))


def test_encoder_conforms_with_other_shapes(model_dir):
    check_encoder(build_xmlcnn, small_config(model_dir, xmlcnn_filter_sizes="3,5", xmlcnn_pool_chunks=4))


def test_encoder_component_conforms(model_dir):
    check_component("encoder", build_xmlcnn, small_config(model_dir))


# -- the encoder's own properties --------------------------------------------------------------------

def test_shapes_follow_the_options(model_dir):
    encoder = build_xmlcnn(small_config(model_dir, xmlcnn_filter_sizes=[2, 3, 4, 5]))
    assert encoder.out_dim == 12
    assert [conv.kernel_size[0] for conv in encoder.convs] == [2, 3, 4, 5]
    assert encoder.bottleneck.in_features == 4 * 4 * 3
    assert encoder.embedding.padding_idx == encoder.tokenizer.pad_token_id
    assert encoder.embedding.num_embeddings >= len(encoder.tokenizer)


def test_defaults_are_the_papers_shapes(model_dir):
    encoder = build_xmlcnn(tiny_config(model_dir))
    assert encoder.embedding.embedding_dim == 300
    assert encoder.filter_sizes == (2, 4, 8) and encoder.num_filters == 128 and encoder.pool_chunks == 8
    assert encoder.bottleneck.in_features == 3 * 128 * 8 and encoder.out_dim == 512


@pytest.mark.parametrize("value", ["0", "many", "2,x"])
def test_bad_options_end_in_one_line(model_dir, value):
    with pytest.raises(XmcError, match="options.xmlcnn_"):
        build_xmlcnn(small_config(model_dir, xmlcnn_filter_sizes=value, xmlcnn_num_filters=value))


def test_unknown_option_names_the_closest(model_dir):
    with pytest.raises(XmcError, match="xmlcnn_emb_dim"):
        build_xmlcnn(small_config(model_dir, xmlcnn_emb_dims=8))


@pytest.mark.parametrize("length", [1, 2, 3, 7])
def test_documents_shorter_than_the_widest_filter(model_dir, length):
    encoder = build_xmlcnn(small_config(model_dir)).eval()       # widest filter: 8
    torch.manual_seed(0)
    ids = torch.randint(1000, 2000, (2, length))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = encoder(ids, mask)
    assert out.shape == (2, encoder.out_dim) and torch.isfinite(out).all()
    encoder.train()
    encoder(ids, mask).sum().backward()                          # gradients flow for short texts too
    assert all(torch.isfinite(p.grad).all() for p in encoder.parameters() if p.grad is not None)


def test_padding_never_changes_the_representation(model_dir):
    encoder = build_xmlcnn(small_config(model_dir)).eval()
    texts = ["python", "a python interpreter module", "window desktop widget toolkit graphical " * 6]
    ids, mask = batch(encoder, texts)
    pad = encoder.tokenizer.pad_token_id
    with torch.no_grad():
        reference = encoder(ids, mask)
        for extra in (1, 5, 40):                                  # appended padding
            torch.testing.assert_close(encoder(*pad_right(ids, mask, extra, pad)), reference,
                                       atol=1e-5, rtol=1e-5)
        for row in range(len(texts)):                             # alone, padded only to its own length
            length = int(mask[row].sum())
            torch.testing.assert_close(encoder(ids[row:row + 1, :length], mask[row:row + 1, :length]),
                                       reference[row:row + 1], atol=1e-5, rtol=1e-5)
        ids_other = ids.clone()                                   # what sits under the mask is ignored
        ids_other[mask == 0] = 1000
        torch.testing.assert_close(encoder(ids_other, mask), reference, atol=1e-5, rtol=1e-5)


def test_left_padding_gives_the_same_representation(model_dir):
    encoder = build_xmlcnn(small_config(model_dir)).eval()
    ids, mask = batch(encoder, ["python", "a python interpreter module and its documentation"])
    left_ids, left_mask = torch.full_like(ids, encoder.tokenizer.pad_token_id), torch.zeros_like(mask)
    for row in range(len(ids)):
        length = int(mask[row].sum())
        left_ids[row, ids.shape[1] - length:] = ids[row, :length]
        left_mask[row, ids.shape[1] - length:] = 1
    with torch.no_grad():
        torch.testing.assert_close(encoder(left_ids, left_mask), encoder(ids, mask), atol=1e-5, rtol=1e-5)


def test_the_pad_row_stays_zero_and_gets_no_gradient(model_dir):
    encoder = build_xmlcnn(small_config(model_dir)).train()
    ids, mask = batch(encoder, ["python", "a python interpreter module"])
    encoder(ids, mask).sum().backward()
    pad = encoder.tokenizer.pad_token_id
    assert not encoder.embedding.weight[pad].any()
    assert not encoder.embedding.weight.grad[pad].any()


def test_initialisation_follows_the_seed(model_dir):
    config = small_config(model_dir)
    torch.manual_seed(3)
    first = build_xmlcnn(config).state_dict()
    torch.manual_seed(3)
    second = build_xmlcnn(config).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_export_rebuilds_the_same_shapes_whatever_the_config(model_dir, tmp_path):
    encoder = build_xmlcnn(small_config(model_dir, xmlcnn_filter_sizes="3,5")).eval()
    params = encoder.export(tmp_path / "encoder")
    assert json.loads(json.dumps(params)) == params               # stored in model.json
    saved = json.loads((tmp_path / "encoder" / "xmlcnn.json").read_text())
    assert saved["filter_sizes"] == [3, 5] and saved["hidden"] == 12
    rebuilt = build_xmlcnn(tiny_config(model_dir), **params).eval()   # config with default shapes
    rebuilt.load_state_dict(encoder.state_dict())
    ids, mask = batch(encoder, ["a python interpreter module", "sql"])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids, mask), encoder(ids, mask))


# -- as an installed plugin --------------------------------------------------------------------------

def test_plugin_is_found_through_its_entry_point(registry):
    plugins = {info.name: info for info in registry.plugins}
    assert "xmlcnn" in plugins, f"install the package: pip install -e plugins/xmcbench-xmlcnn ({registry.failed})"
    info = plugins["xmlcnn"]
    assert (info.package, info.version) == ("xmcbench-xmlcnn", "0.1.0")
    assert set(info.registered) == {"encoder 'xml-cnn'", "method 'xmlcnn'", "method 'xmlcnn-clusters'"}
    assert registry.component("encoder", "xml-cnn") is build_xmlcnn
    flat, clusters = registry.method("xmlcnn"), registry.method("xmlcnn-clusters")
    for method in (flat, clusters):
        for kind in ("encoder", "recaller", "ranker", "sampler"):
            registry.component(kind, method.defaults[kind])          # every named component exists
    assert flat.defaults["encoder"] == "xml-cnn" and "cluster_size" not in flat.defaults
    assert clusters.defaults["cluster_size"] == 8 and clusters.defaults["top_clusters"] == 16


# -- end to end ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("method, extra", [("xmlcnn", []), ("xmlcnn-clusters", ["cluster_size=2", "top_clusters=2"])])
def test_tiny_run_trains_scores_and_reloads(registry, tmp_path, method, extra):
    dataset = write_tiny_dataset(tmp_path / "tiny-topics")
    options = ["epochs=2", "batch_size=8", "max_length=32", "hidden_size=8", "threads=1", *extra,
               *(f"options.{key}={value}" for key, value in SMALL.items())]
    plan = plan_run(registry, method, str(dataset), set_options=options)
    assert plan.config.encoder == "xml-cnn"
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100 and "nDCG@3" in metrics and "PSP@5" in metrics
    assert ("coverage" in metrics) == (method == "xmlcnn-clusters")
    for name in ("model/weights.safetensors", "model/model.json", "model/encoder/xmlcnn.json",
                 "model/encoder/tokenizer.json"):
        assert (run_dir / name).is_file(), name
    # the saved model rebuilds offline from its own folder and scores the same
    assert saved_models.evaluate(run_dir, registry=registry)["P@1"] == pytest.approx(metrics["P@1"])
