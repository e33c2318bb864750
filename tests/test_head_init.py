"""`cluster-linear` with options.head_init=pifa: each label's row starts at the mean of its training documents'
centred, unit-length representations and its bias at its prior, once; only where a run is flat (the refusal on
label clusters is tested beside positive weights' in test_positive_weight)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from safetensors.torch import load_file

from xmcbench.config import Stage, TrainConfig
from xmcbench.errors import RefusedSetting, XmcError
from xmcbench.interfaces import EpochContext, LabelInfo
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench_lightxml.recaller import (ClusterLinearRecaller, PifaInitialisedRecaller, PifaPropensityRecaller,
                                        PropensityWeightedRecaller, build_cluster_linear, check_cluster_linear)

PIFA = dataclasses.replace(TrainConfig(), options={"head_init": "pifa"})


class CountingDocuments:
    """map_documents that returns fixed (N, D) representations and counts how often it was asked."""

    def __init__(self, documents: torch.Tensor) -> None:
        self.documents, self.calls = documents, 0

    def __call__(self, function, dim: int) -> torch.Tensor:
        self.calls += 1
        return self.documents


def context(documents: CountingDocuments, labels: sp.csr_matrix | None, epoch: int = 0) -> EpochContext:
    size = labels.shape[1] if labels is not None else 3
    info = LabelInfo(tuple(f"l{i}" for i in range(size)), None, np.ones(size, dtype=np.int64), np.ones(size))
    return EpochContext(Stage("joint"), epoch, len(documents.documents), info, map_documents=documents,
                        map_labels=None, recalled_clusters=None, encoder=type("E", (), {"out_dim": 4})(),
                        training_labels=labels)


def test_the_option_picks_the_recaller():
    assert type(build_cluster_linear(TrainConfig(), 4, 3)) is ClusterLinearRecaller
    assert type(build_cluster_linear(PIFA, 4, 3)) is PifaInitialisedRecaller
    both = dataclasses.replace(PIFA, options={"head_init": "pifa", "positive_weight": "propensity"})
    recaller = build_cluster_linear(both, 4, 3)
    assert type(recaller) is PifaPropensityRecaller and isinstance(recaller, PropensityWeightedRecaller)


def test_a_label_starts_at_its_documents_and_only_once():
    generator = torch.Generator().manual_seed(0)
    documents = CountingDocuments(torch.randn(6, 32, generator=generator) * 3 + 1)   # nearly orthogonal once centred
    # label 0: documents 0 and 1; label 1: document 2 only (seen once); label 2: no document
    labels = sp.csr_matrix(np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
                                    dtype=np.float32))
    recaller = build_cluster_linear(PIFA, 32, 3)
    recaller.start_epoch(context(documents, labels))
    mean = documents.documents.mean(dim=0)
    centred = documents.documents - mean
    with torch.no_grad():
        logits = recaller(documents.documents)                                            # (6, 3)
        at_mean = recaller(mean[None])[0]
    assert int(logits[:, 1].argmax()) == 2, "a label seen once scores its one document highest"
    cosine = torch.nn.functional.cosine_similarity(recaller.linear.weight[1].detach(), centred[2], dim=0)
    assert float(cosine) == pytest.approx(1.0, abs=1e-5)
    assert set(logits[:, 0].topk(2).indices.tolist()) == {0, 1}
    prior = (1 + 1.0) / (6 + 2.0)
    assert float(at_mean[1]) == pytest.approx(float(np.log(prior / (1 - prior))), abs=1e-5), \
        "the mean document scores a label at its prior's log-odds"
    assert torch.all(recaller.linear.weight[2] == 0), "a label with no document has no direction to start from"
    assert bool(recaller.state_dict()["initialised"]), "a checkpoint says it is done"

    before = recaller.linear.weight.detach().clone()
    recaller.start_epoch(context(documents, labels, epoch=1))
    assert documents.calls == 1 and torch.equal(recaller.linear.weight, before), "later epochs keep training's rows"
    resumed = build_cluster_linear(PIFA, 32, 3)
    resumed.load_state_dict(recaller.state_dict())
    resumed.start_epoch(context(documents, labels, epoch=0))   # e.g. the first epoch of a later stage
    assert documents.calls == 1 and torch.equal(resumed.linear.weight, before)


def test_auto_starts_a_flat_recaller_at_pifa_rows_and_leaves_cluster_rows_random():
    auto = dataclasses.replace(TrainConfig(), options={"head_init": "auto"})
    documents = CountingDocuments(torch.randn(6, 32, generator=torch.Generator().manual_seed(1)))
    labels = sp.csr_matrix(np.eye(6, 3, dtype=np.float32))
    flat = build_cluster_linear(auto, 32, 3)
    flat.start_epoch(context(documents, labels))
    assert documents.calls == 1 and torch.equal(flat.linear.weight, pifa_rows(documents, labels))
    clustered = build_cluster_linear(auto, 32, 2)   # 2 clusters of 3 labels: no row stands for one label
    random_rows = clustered.linear.weight.detach().clone()
    clustered.start_epoch(context(documents, labels))
    assert documents.calls == 1 and torch.equal(clustered.linear.weight, random_rows)
    assert bool(clustered.initialised), "decided once"


def pifa_rows(documents: CountingDocuments, labels: sp.csr_matrix) -> torch.Tensor:
    recaller = build_cluster_linear(PIFA, documents.documents.shape[1], labels.shape[1])
    recaller.start_epoch(context(CountingDocuments(documents.documents), labels))
    return recaller.linear.weight


def test_documents_that_barely_differ_do_not_give_rows_longer_than_their_length_allows():
    """An untrained encoder gives nearly equal representations: dividing by their spread alone would make rows so
    long that dropout's noise moved logits by hundreds."""
    from xmcbench_lightxml.options import PIFA_SCALE
    from xmcbench_lightxml.recaller import PIFA_MIN_SPREAD
    generator = torch.Generator().manual_seed(2)
    documents = CountingDocuments(torch.full((6, 32), 2.0) + 1e-3 * torch.randn(6, 32, generator=generator))
    labels = sp.csr_matrix(np.eye(6, 3, dtype=np.float32))
    recaller = build_cluster_linear(PIFA, 32, 3)
    recaller.start_epoch(context(documents, labels))
    length = float(documents.documents.norm(dim=1).mean())
    expected = PIFA_SCALE.default / (PIFA_MIN_SPREAD * length)
    assert recaller.linear.weight.norm(dim=1).detach().numpy() == pytest.approx(expected)


def test_without_the_training_labels_it_says_what_is_missing():
    recaller = build_cluster_linear(PIFA, 4, 3)
    with pytest.raises(XmcError, match="head_init=pifa needs the training documents' labels"):
        recaller.start_epoch(context(CountingDocuments(torch.zeros(2, 4)), None))


def test_a_flat_run_starts_from_pifa_rows_by_default_though_its_test_set_has_a_label_training_lacks(
        tiny_model_dir, tmp_path, monkeypatch):
    """lightxml's head_init=auto on a flat run: the rows start at PIFA, also where the dataset's label vocabulary
    is wider than the model's (a test-only label), which must not read as label clusters."""
    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "data")
    (data / "test_labels.txt").write_text((data / "test_labels.txt").read_text().replace("db:sql", "db:nosql", 1))
    started = []
    initialise = PifaInitialisedRecaller.initialise
    monkeypatch.setattr(PifaInitialisedRecaller, "initialise",
                        lambda self, context: (started.append(context.training_labels.shape), initialise(self, context)))
    plan = plan_run(registry, "lightxml", str(data), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32",
        "threads=1", "cluster_size=1"])
    assert plan.config.options["head_init"] == "auto"   # beside it, the derived lexical_buckets
    launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    names = json.loads((tmp_path / "run" / "model" / "labels.json").read_text())
    assert started == [(48, len(names))] and "db:nosql" not in names
    weights = load_file(tmp_path / "run" / "model" / "weights.safetensors")
    assert bool(weights["recaller.initialised"])


def test_logit_adjustment_offsets_the_loss_by_the_prior_and_starts_where_pifa_does():
    """options.logit_adjustment=tau (Menon et al.): the loss reads logit + tau x log-odds, prediction the logit; the
    bias keeps (1 - tau) of the log-odds, so the adjusted start equals the PIFA start."""
    generator = torch.Generator().manual_seed(3)
    documents = CountingDocuments(torch.randn(8, 16, generator=generator))
    labels = sp.csr_matrix(np.array([[1, 0], [1, 0], [1, 0], [1, 0], [1, 0], [0, 1], [1, 0], [0, 0]],
                                    dtype=np.float32))
    adjusted_config = dataclasses.replace(PIFA, options={"head_init": "pifa", "logit_adjustment": "0.5"})
    adjusted = build_cluster_linear(adjusted_config, 16, 2)
    adjusted.start_epoch(context(CountingDocuments(documents.documents), labels))
    plain = pifa_rows(documents, labels)   # the PIFA start's rows
    assert torch.equal(adjusted.linear.weight, plain), "the rows are PIFA's"
    prior = np.array([(6 + 1.0) / 10, (1 + 1.0) / 10])
    log_odds = torch.tensor(np.log(prior / (1 - prior)), dtype=torch.float32)
    assert adjusted.loss_offsets == pytest.approx(0.5 * log_odds)
    reference = build_cluster_linear(PIFA, 16, 2)
    reference.start_epoch(context(CountingDocuments(documents.documents), labels))
    with torch.no_grad():
        start, pifa_start = adjusted(documents.documents), reference(documents.documents)   # (8, 2)
    assert start + adjusted.loss_offsets == pytest.approx(pifa_start, abs=1e-5), "the adjusted start is PIFA's"
    lifted = -0.5 * (log_odds[1] - log_odds[0])   # > 0: label 1 is the rare one
    assert start[:, 1] - start[:, 0] == pytest.approx(pifa_start[:, 1] - pifa_start[:, 0] + lifted, abs=1e-5), \
        "prediction ranks the rare label higher by tau x the gap in log-odds"
    targets = torch.tensor(labels.toarray())
    assert adjusted.loss(start, targets).item() == pytest.approx(reference.loss(pifa_start, targets).item(), rel=1e-5)
    resumed = build_cluster_linear(adjusted_config, 16, 2)
    resumed.load_state_dict(adjusted.state_dict())
    assert torch.equal(resumed.loss_offsets, adjusted.loss_offsets), "a checkpoint keeps the offsets"
    assert "loss_offsets" not in reference.state_dict(), "a run without the option keeps its tensors"


def test_logit_adjustment_without_pifa_rows_is_refused():
    flat = dataclasses.replace(TrainConfig(), cluster_size=1,
                               options={"head_init": "random", "logit_adjustment": "0.5"})
    info = LabelInfo(("a", "b", "c"), None, np.ones(3, dtype=np.int64), np.ones(3))
    with pytest.raises(RefusedSetting, match="head_init pifa or auto"):
        check_cluster_linear(flat, info)
    check_cluster_linear(dataclasses.replace(flat, options={"head_init": "auto", "logit_adjustment": "0.5"}), info)


HOLD = dataclasses.replace(PIFA, options={"head_init": "pifa", "hold_prior": "true"})


def test_hold_prior_starts_where_pifa_does_and_training_cannot_move_the_score_at_the_mean():
    """options.hold_prior: logit = w . (x - centre) + held bias. It starts equal to the PIFA start; the bias is a
    buffer, so a label's many negatives can move its row but not its score at the mean document."""
    generator = torch.Generator().manual_seed(4)
    documents = CountingDocuments(torch.randn(8, 16, generator=generator) + 2)
    labels = sp.csr_matrix(np.array([[1, 0], [1, 0], [1, 0], [1, 0], [1, 0], [0, 1], [1, 0], [0, 0]],
                                    dtype=np.float32))
    held = build_cluster_linear(HOLD, 16, 2)
    assert "linear.bias" not in dict(held.named_parameters()), "no bias for the optimizer to train"
    held.start_epoch(context(CountingDocuments(documents.documents), labels))
    reference = build_cluster_linear(PIFA, 16, 2)
    reference.start_epoch(context(CountingDocuments(documents.documents), labels))
    held.eval()
    with torch.no_grad():
        assert held(documents.documents) == pytest.approx(reference(documents.documents), abs=1e-5)
    mean = documents.documents.mean(dim=0)
    assert torch.allclose(held.centre, mean) and torch.equal(held.linear.weight, reference.linear.weight)
    prior = np.array([(6 + 1.0) / 10, (1 + 1.0) / 10])
    log_odds = torch.tensor(np.log(prior / (1 - prior)), dtype=torch.float32)
    assert held.held_bias == pytest.approx(log_odds)

    held.train()
    shifted = documents.documents + 3   # the training representations drift: the centre follows them
    with torch.no_grad():
        assert held(shifted) == pytest.approx(held(documents.documents), abs=1e-4), \
            "in training a batch is centred on its own mean: moving every document changes no logit"
    held.centre.copy_(mean)
    optimizer = torch.optim.SGD(held.parameters(), lr=0.5)
    for _ in range(20):
        optimizer.zero_grad()
        held.loss(held(shifted[:7]), torch.zeros(7, 2)).backward()   # every document a negative of both labels
        optimizer.step()
    assert torch.equal(held.held_bias, log_odds.to(held.held_bias)), "the bias is not trained"
    moved = (held.centre - mean).norm() / (shifted[:7].mean(dim=0) - mean).norm()
    assert float(moved) == pytest.approx(1 - (1 - 0.01) ** 20, rel=1e-4), "the centre moves 1 % a batch"
    held.eval()
    centre = held.centre.clone()
    with torch.no_grad():
        assert held(centre[None])[0] == pytest.approx(log_odds, abs=1e-5), "the score at the centre is held"
        held(shifted)
    assert torch.equal(held.centre, centre), "prediction does not move the centre"
    resumed = build_cluster_linear(HOLD, 16, 2)
    resumed.load_state_dict(held.state_dict())
    assert torch.equal(resumed.centre, held.centre) and torch.equal(resumed.held_bias, held.held_bias)


def test_hold_prior_keeps_the_adjusted_share_of_the_prior():
    config = dataclasses.replace(PIFA, options={"head_init": "pifa", "hold_prior": "true", "logit_adjustment": "0.5"})
    documents = CountingDocuments(torch.randn(8, 16, generator=torch.Generator().manual_seed(5)))
    labels = sp.csr_matrix(np.eye(8, 2, dtype=np.float32))
    held = build_cluster_linear(config, 16, 2)
    held.start_epoch(context(documents, labels))
    log_odds = float(np.log(0.2 / 0.8))   # (1 + 1) / (8 + 2) for both labels
    assert held.held_bias == pytest.approx([0.5 * log_odds] * 2) and held.loss_offsets == pytest.approx([0.5 * log_odds] * 2)


def test_hold_prior_without_pifa_rows_or_on_label_clusters_is_refused():
    info = LabelInfo(("a", "b", "c"), None, np.ones(3, dtype=np.int64), np.ones(3))
    flat = dataclasses.replace(TrainConfig(), cluster_size=1, options={"head_init": "random", "hold_prior": "true"})
    with pytest.raises(RefusedSetting, match="options.hold_prior .* head_init pifa or auto"):
        check_cluster_linear(flat, info)
    clustered = dataclasses.replace(TrainConfig(), cluster_size=2, options={"head_init": "auto", "hold_prior": "true"})
    with pytest.raises(RefusedSetting, match="options.hold_prior .* flat run"):
        check_cluster_linear(clustered, info)
    check_cluster_linear(dataclasses.replace(flat, options={"head_init": "auto", "hold_prior": "true"}), info)


def test_a_run_that_holds_the_prior_saves_its_centre_and_predicts(tiny_model_dir, tmp_path):
    """End to end, with SWA averaging from the first step and rows that learn at their own rates: the saved model
    has its centre, held bias and row scales, no trained bias, and predicts."""
    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "data")
    plan = plan_run(registry, "lightxml", str(data), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=2", "max_length=32",
        "threads=1", "cluster_size=1", "options.hold_prior=true", "swa=true", "swa_start_epoch=0",
        "swa_every_steps=1", "options.row_lr_documents=1000"])
    launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    weights = load_file(tmp_path / "run" / "model" / "weights.safetensors")
    assert "recaller.linear.bias" not in weights and bool(weights["recaller.initialised"])
    assert weights["recaller.centre"].abs().sum() > 0 and weights["recaller.held_bias"].max() < 0
    assert 0 < weights["recaller.row_scales"].min() and weights["recaller.row_scales"].max() < 1
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100


ROW_LR = dataclasses.replace(PIFA, options={"head_init": "pifa", "row_lr_documents": "4"})


def test_row_lr_documents_starts_where_pifa_does_and_gives_each_row_its_own_step():
    """options.row_lr_documents=K: the scores start equal to PIFA's, and under Adam a row with n training
    documents moves min(1, max(1, n) / K) as far a step as the same row without the option."""
    documents = CountingDocuments(torch.randn(10, 16, generator=torch.Generator().manual_seed(6)) + 1)
    # label 0: 6 documents, label 1: 2, label 2: 1, label 3: none
    labels = sp.csr_matrix(np.array([[1, 0, 0, 0]] * 4 + [[1, 1, 0, 0]] * 2 + [[0, 0, 1, 0]] + [[0, 0, 0, 0]] * 3,
                                    dtype=np.float32))
    scaled = build_cluster_linear(ROW_LR, 16, 4)
    scaled.start_epoch(context(CountingDocuments(documents.documents), labels))
    reference = build_cluster_linear(PIFA, 16, 4)
    reference.start_epoch(context(CountingDocuments(documents.documents), labels))
    assert scaled.row_scales.tolist() == [1.0, 0.5, 0.25, 0.25]
    assert torch.allclose(scaled.rows(), reference.rows(), atol=1e-6)
    with torch.no_grad():
        assert scaled(documents.documents) == pytest.approx(reference(documents.documents), abs=1e-5)

    steps = []
    for recaller in (scaled, reference):
        before = recaller.rows().detach().clone()
        optimizer = torch.optim.Adam(recaller.parameters(), lr=1e-3)
        recaller.loss(recaller(documents.documents), torch.zeros(10, 4)).backward()   # every document a negative
        optimizer.step()
        steps.append((recaller.rows().detach() - before).norm(dim=1))
    assert (steps[0] / steps[1]).tolist() == pytest.approx([1.0, 0.5, 0.25, 0.25], rel=1e-3)

    resumed = build_cluster_linear(ROW_LR, 16, 4)
    resumed.load_state_dict(scaled.state_dict())
    assert torch.equal(resumed.rows(), scaled.rows()), "the scales travel with checkpoints"
    assert "row_scales" not in reference.state_dict(), "runs without the option keep their tensors"


def test_row_lr_documents_without_pifa_rows_is_refused():
    info = LabelInfo(("a", "b", "c"), None, np.ones(3, dtype=np.int64), np.ones(3))
    flat = dataclasses.replace(TrainConfig(), cluster_size=1,
                               options={"head_init": "random", "row_lr_documents": "10"})
    with pytest.raises(RefusedSetting, match="options.row_lr_documents .* head_init pifa or auto"):
        check_cluster_linear(flat, info)
    check_cluster_linear(dataclasses.replace(flat, options={"head_init": "auto", "row_lr_documents": "10"}), info)


def test_pifa_scale_sets_how_far_a_row_lifts_its_labels_documents_and_leaves_the_prior():
    """options.pifa_scale=S: rows of length S / spread, so the logits less the prior scale with S; 0 starts every
    label at its prior alone."""
    generator = torch.Generator().manual_seed(3)
    documents = CountingDocuments(torch.randn(6, 32, generator=generator) * 3 + 1)
    labels = sp.csr_matrix(np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0]],
                                    dtype=np.float32))
    starts = {}
    for scale in ("5", "2.5", "0"):
        recaller = build_cluster_linear(dataclasses.replace(PIFA, options={"head_init": "pifa", "pifa_scale": scale}),
                                        32, 3)
        recaller.start_epoch(context(documents, labels))
        with torch.no_grad():
            starts[scale] = recaller(documents.documents), recaller(documents.documents.mean(dim=0, keepdim=True))
    default, _ = starts["5"]
    for scale in ("2.5", "0"):
        logits, at_mean = starts[scale]
        assert torch.allclose(at_mean, starts["5"][1], atol=1e-5), "the score at the mean document is the prior's"
        assert torch.allclose(logits - at_mean, (default - starts["5"][1]) * float(scale) / 5, atol=1e-4)
    assert torch.allclose(starts["0"][0], starts["0"][1].expand(6, 3), atol=1e-6)


def test_pifa_scale_without_pifa_rows_is_refused():
    info = LabelInfo(("a", "b", "c"), None, np.ones(3, dtype=np.int64), np.ones(3))
    flat = dataclasses.replace(TrainConfig(), cluster_size=1, options={"head_init": "random", "pifa_scale": "2"})
    with pytest.raises(RefusedSetting, match="options.pifa_scale sets the length of each PIFA row, so it needs"):
        check_cluster_linear(flat, info)
    check_cluster_linear(dataclasses.replace(flat, options={"head_init": "auto", "pifa_scale": "2"}), info)


def test_pifa_length_agreement_keeps_a_label_seen_once_and_shortens_one_whose_documents_disagree():
    """options.pifa_length=agreement: a row's length is that of the mean of its documents' unit vectors, so a label
    seen once starts as with unit rows, and a label of two opposite documents starts at no direction at all."""
    documents = CountingDocuments(torch.tensor([[3.0, 0.0, 0.0], [-3.0, 0.0, 0.0], [0.0, 2.0, 0.0],
                                                [0.0, -2.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, -1.0]]))
    # label 0: documents 0 and 1 (opposite); label 1: documents 0 and 2 (at right angles); label 2: document 4 only
    labels = sp.csr_matrix(np.array([[1, 1, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0]],
                                    dtype=np.float32))
    rows = {}
    for length in ("unit", "agreement"):
        recaller = build_cluster_linear(dataclasses.replace(PIFA, options={"head_init": "pifa", "pifa_length": length}),
                                        3, 3)
        recaller.start_epoch(context(documents, labels))
        rows[length] = recaller.linear.weight.detach().norm(dim=1)
    assert rows["agreement"][2] == pytest.approx(float(rows["unit"][2]))
    assert rows["agreement"][1] == pytest.approx(float(rows["unit"][1]) / 2 ** 0.5)
    assert float(rows["agreement"][0]) == pytest.approx(0.0, abs=1e-6)
