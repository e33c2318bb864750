"""xmcbench-dual: its components pass the conformance suite, its methods compose (check_method: shared towers,
save -> load -> predict, the retriever path, exact resume), its losses match counts made by hand, its sampler mines
on schedule, and its presets and derived settings resolve."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from xmcbench import label_index
from xmcbench.config import Stage
from xmcbench.interfaces import EpochContext, LabelClusters, LabelInfo
from xmcbench.registry import build_registry
from xmcbench.testing import check_component, check_method, make_tiny_transformer, tiny_config, write_tiny_dataset, \
    write_tiny_label_texts
from xmcbench_dual.components import IndexNegatives, build_dual_tower, build_index_negatives, build_label_index
from xmcbench_dual.encoder import build_transformer_mean
from xmcbench_dual.losses import decoupled_softmax, triplet_margin
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.saved import predict_texts


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_transformer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def registry():
    registry = build_registry()
    assert not registry.failures_of("dual"), registry.failures_of("dual")
    return registry


def tiny(tiny_model, *extra):
    return [f"model_name={tiny_model}", "pretrained_weights=false", *extra]


# -- components and methods -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, factory", [("encoder", build_transformer_mean), ("recaller", build_label_index),
                                           ("ranker", build_dual_tower), ("sampler", build_index_negatives)])
def test_each_component_conforms(kind, factory, tiny_model):
    check_component(kind, factory, tiny_config(tiny_model))


@pytest.mark.parametrize("options", [{}, {"options.free_vectors": "true"}, {"options.loss": "triplet"}])
def test_the_dual_encoder_composes(registry, tiny_model, options):
    check_method(registry, "dual", tiny(tiny_model, "options.mine_from_epoch=0", "options.refresh_every=1",
                                        *(f"{key}={value}" for key, value in options.items())))


def test_ngame_composes_with_its_classifier_stage(registry, tiny_model):
    check_method(registry, "dual-ngame", tiny(tiny_model, "refit_epochs=1"))


def test_above_the_exact_threshold_the_index_is_a_saved_graph(registry, tiny_model, monkeypatch, tmp_path):
    pytest.importorskip("faiss", reason="the approximate index needs the `ann` extra (faiss-cpu)")
    monkeypatch.setattr(label_index, "EXACT_BELOW", 0)   # the tiny label set is searched through the HNSW graph
    check_method(registry, "dual", tiny(tiny_model))     # save -> load -> the same predictions, search included
    data = write_tiny_dataset(tmp_path / "data")
    write_tiny_label_texts(data)
    plan = plan_run(registry, "dual", str(data), set_options=tiny(tiny_model, "epochs=1", "threads=1"), seed=0)
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    saved = json.loads((run_dir / "model" / "model.json").read_text())["files"]
    assert {"components/recaller/label_index.faiss", "components/recaller/label_index.json"} <= set(saved)


def test_validations_search_exactly_and_the_graph_is_built_once_training_ends(monkeypatch, tiny_model):
    pytest.importorskip("faiss", reason="the approximate index needs the `ann` extra (faiss-cpu)")
    monkeypatch.setattr(label_index, "EXACT_BELOW", 0)
    retriever = build_label_index(tiny_config(tiny_model), 32, 40, encoder=type("E", (), {"out_dim": 8})())
    context = epoch_context(None, torch.randn(6, 8), torch.randn(40, 8))
    retriever.finalize(context)                                  # before a validation
    assert retriever.index.exact
    retriever.finalize(dataclasses.replace(context, final=True))   # training has ended: the saved model's graph
    assert not retriever.index.exact


def test_with_free_vectors_the_index_and_the_miner_use_the_vectors_the_tower_scores_with(tiny_model):
    # DEXA: a label's score is against text + free vector; an index of the text embeddings alone would shortlist
    # (and mine) by another similarity than the one scored
    config = dataclasses.replace(tiny_config(tiny_model), options={"free_vectors": True})
    encoder = build_transformer_mean(config)
    names = [f"label{i}" for i in range(12)]
    info = LabelInfo(names=tuple(names), texts=None, counts=np.ones(12, dtype=np.int64),
                     inverse_propensities=np.ones(12))
    tower = build_dual_tower(config, encoder.out_dim, 12, encoder=encoder, label_info=info)
    torch.manual_seed(0)
    with torch.no_grad():
        tower.free.weight.normal_()
    text = torch.randn(12, encoder.out_dim)
    context = dataclasses.replace(epoch_context(0, torch.randn(5, encoder.out_dim), text), ranker=tower)
    scored = tower.all_label_vectors(text)
    assert not torch.allclose(scored, torch.nn.functional.normalize(text, dim=1), atol=1e-3)

    retriever = build_label_index(config, encoder.out_dim, 12, encoder=encoder)
    retriever.finalize(context)
    assert torch.allclose(retriever.label_vectors, scored, atol=1e-6)
    sampler = IndexNegatives(positives_per_document=0, hard_negatives=4, negatives_per_document=1,
                             mine_from_epoch=0, refresh_every=1)
    sampler.start_epoch(context)
    documents = torch.nn.functional.normalize(context.document_embeddings(), dim=1)
    assert torch.equal(sampler.mined, (documents @ scored.T).topk(4, dim=1).indices)


# -- losses --------------------------------------------------------------------------------------------------

SIMILARITY = torch.tensor([[0.9, 0.1, 0.5, 0.0], [0.2, 0.8, 0.3, 0.7], [0.4, 0.3, 0.2, 0.1]])
TARGETS = torch.tensor([[1., 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
MASK = torch.tensor([[True, True, True, False], [True, True, True, True], [True, True, True, True]])


def test_decoupled_softmax_by_hand():
    # row 0: positives 0.9 and 0.5 each against the one real negative 0.1 (tau 0.05: 18, 10, 2); row 1: 0.8 (16)
    # against 0.2, 0.3, 0.7 (4, 6, 14); row 2 has no positive and counts for nothing
    row0 = (math.log1p(math.exp(2 - 18)) + math.log1p(math.exp(2 - 10))) / 2
    row1 = -(16 - math.log(math.exp(16) + math.exp(4) + math.exp(6) + math.exp(14)))
    assert decoupled_softmax(SIMILARITY, TARGETS, MASK, 0.05).item() == pytest.approx((row0 + row1) / 2, rel=1e-5)


def test_triplet_margin_by_hand():
    # row 0: the one real negative, 0.1, violates no margin of 0.3 (0.1 - 0.5 + 0.3 < 0); row 1: of the two hardest
    # negatives, 0.7 and 0.3, only 0.7 violates (0.7 - 0.8 + 0.3 = 0.2) and takes all the softmax weight
    assert triplet_margin(SIMILARITY, TARGETS, MASK, 0.3, 2).item() == pytest.approx(0.2 / 2)
    assert triplet_margin(SIMILARITY, TARGETS, MASK, 0.0, 2).item() == 0.0


# -- the sampler ---------------------------------------------------------------------------------------------

def epoch_context(epoch: int, documents: torch.Tensor, labels: torch.Tensor) -> EpochContext:
    return EpochContext(Stage("contrastive"), epoch, len(documents), None, map_documents=lambda f, d: documents,
                        map_labels=lambda f, d: labels, recalled_clusters=lambda top: None,
                        encoder=type("E", (), {"out_dim": documents.shape[1]})())


def test_hard_negatives_are_mined_on_schedule_and_shared_in_batch():
    torch.manual_seed(0)
    documents, labels = torch.randn(6, 4), torch.randn(10, 4)
    sampler = IndexNegatives(positives_per_document=0, hard_negatives=3, negatives_per_document=1, mine_from_epoch=1,
                             refresh_every=2)
    mined = []
    for epoch in range(5):
        sampler.start_epoch(epoch_context(epoch, documents, labels * (epoch + 1)))
        mined.append(None if sampler.mined is None else sampler.mined.clone())
    assert mined[0] is None, "no mining before mine_from_epoch"
    assert mined[1] is not None and torch.equal(mined[2], mined[1]) and mined[3] is not None
    expected = (torch.nn.functional.normalize(documents, dim=1) @ torch.nn.functional.normalize(labels, dim=1).T
                ).topk(3, dim=1).indices
    assert torch.equal(mined[1], expected)

    clusters = LabelClusters.from_assignment(torch.arange(10), 10)
    positives = torch.tensor([[0, -1], [5, 6]])
    candidates = sampler(None, positives, clusters, torch.tensor([0, 3]))
    for row in range(2):
        chosen = set(candidates.labels[row][candidates.mask[row]].tolist())
        assert {0, 5, 6} <= chosen, "every positive of the batch is a candidate of every document"
        assert len(chosen) <= 3 + 2, "the batch's positives and one mined negative per document"
    real = candidates.mask[0]   # padding slots hold label 0 too
    assert candidates.targets[0][(candidates.labels[0] == 0) & real].item() == 1.0
    assert candidates.targets[0][(candidates.labels[0] == 5) & real].item() == 0.0


def test_one_positive_drawn_per_document_is_shared_in_batch():
    sampler = IndexNegatives(positives_per_document=1, hard_negatives=0, negatives_per_document=0, mine_from_epoch=0,
                             refresh_every=1)
    assert sampler.samples_positives
    clusters = LabelClusters.from_assignment(torch.arange(10), 10)
    positives = torch.tensor([[0, 1, 2], [5, -1, -1], [1, 7, -1]])
    torch.manual_seed(0)
    candidates = sampler(None, positives, clusters, torch.tensor([0, 1, 2]))
    drawn = []
    for row in range(3):
        chosen = candidates.labels[row][candidates.mask[row]].tolist()
        own = [label for label in chosen if label in positives[row].tolist()]
        assert own, "a document keeps at least one of its positives"
        assert len(chosen) <= 3, "three documents draw one positive each, shared in-batch"
        targets = candidates.targets[row][candidates.mask[row]].tolist()
        assert targets == [float(label in positives[row].tolist()) for label in chosen]
        drawn.append(chosen)
    assert drawn[0] == drawn[1] == drawn[2], "every document sees the batch's drawn positives"


# -- settings -------------------------------------------------------------------------------------------------

def test_presets_name_their_published_settings(registry):
    plan = plan_run(registry, "dual", "LF-AmazonTitles-131K")   # a preset: no data read
    assert plan.preset == "lfamazontitles131k"
    config = plan.config
    assert (config.model_name, config.max_length, config.batch_size, config.lr, config.epochs) == \
        ("distilbert-base-uncased", 32, 3000, 3e-4, 100)
    assert config.options["tau"] == 0.05 and config.options["mine_from_epoch"] == 5
    ngame = plan_run(registry, "dual-ngame", "LF-WikiSeeAlso-320K").config
    assert (ngame.max_length, ngame.batch_size, ngame.options["loss"], ngame.options["margin"]) == \
        (128, 350, "triplet", 0.3)


def test_a_dataset_without_preset_derives_its_mining_schedule(registry, tiny_model, tmp_path):
    data = write_tiny_dataset(tmp_path / "data")
    plan = plan_run(registry, "dual", str(data), set_options=tiny(tiny_model))
    assert plan.config.options["mine_from_epoch"] == 1 and plan.config.options["refresh_every"] == 2
    assert {"options.mine_from_epoch", "options.refresh_every"} <= set(plan.derived)
    mine = plan_run(registry, "dual", str(data), set_options=tiny(tiny_model, "options.refresh_every=3"))
    assert mine.config.options["refresh_every"] == 3, "what the user sets wins over what is derived"


@pytest.mark.slow
def test_a_run_predicts_from_label_texts(registry, tiny_model, tmp_path):
    data = write_tiny_dataset(tmp_path / "data")
    write_tiny_label_texts(data)
    plan = plan_run(registry, "dual", str(data), set_options=tiny(tiny_model, "epochs=2", "threads=1"), seed=0)
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resolved"]["components"] == {"encoder": "transformer-mean", "recaller": "label-index",
                                                "ranker": "dual-tower", "sampler": "index-negatives"}
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100
    found = predict_texts(run_dir, ["python interpreter module script"], top_k=3, registry=registry)[0]
    assert len(found["labels"]) == 3 and np.all(np.diff(found["scores"]) <= 0)
    # an exact index writes no file: a copy of the model that drops the empty folder (git does) predicts the same
    (run_dir / "model" / "components" / "recaller").rmdir()
    again = predict_texts(run_dir, ["python interpreter module script"], top_k=3, registry=registry)[0]
    assert again["labels"] == found["labels"]
