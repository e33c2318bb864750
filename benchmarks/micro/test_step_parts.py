"""Micro-benchmarks of what a LightXML step adds to the encoder, at the Wiki-500K preset's sizes
(B = 32 documents, b = 32 recalled clusters of ~62 labels, h = 500, K = 8,192 clusters, L = 501,008 labels).

    python -m pytest benchmarks/micro --benchmark-enable --benchmark-only          # measure
    python -m pytest benchmarks/micro                                               # the suite: run once, tiny

The test suite collects these with benchmarking disabled (pyproject's --benchmark-disable): each body runs
once at tiny sizes, so they cannot rot, and nothing is timed or asserted about time; each checks what it
measures (shapes, the rows an update moves, the real prediction against a step-by-step reference).
"""

from __future__ import annotations

import pytest
import torch

from xmcbench.candidates import candidates_with_positives, expand_clusters
from xmcbench.interfaces import LabelClusters
from xmcbench.optim import RowAdam
from xmcbench.model import SCORE_DTYPE, XMCModel
from xmcbench_lightxml.ranker import BottleneckRanker
from xmcbench_lightxml.sampler import DynamicSampler

WIKI500K = {"batch": 32, "labels": 501_008, "clusters": 8_192, "top": 32, "hidden": 500, "dim": 3_840,
            "positives": 5}
TINY = {"batch": 4, "labels": 1_000, "clusters": 64, "top": 4, "hidden": 8, "dim": 16, "positives": 3}


@pytest.fixture
def sizes(benchmark) -> dict:
    torch.set_num_threads(int(__import__("os").environ.get("XMCBENCH_BENCH_THREADS", "2")))
    return TINY if benchmark.disabled else WIKI500K


def balanced_clusters(num_labels: int, num_clusters: int) -> LabelClusters:
    return LabelClusters.from_assignment(torch.randperm(num_labels, generator=torch.Generator().manual_seed(0))
                                         % num_clusters, num_clusters)


def step_inputs(sizes: dict):
    generator = torch.Generator().manual_seed(0)
    clusters = balanced_clusters(sizes["labels"], sizes["clusters"])
    recall_logits = torch.randn(sizes["batch"], sizes["clusters"], generator=generator)
    positives = torch.randint(0, sizes["labels"], (sizes["batch"], sizes["positives"]), generator=generator)
    return clusters, recall_logits, positives


def test_candidate_gathering(benchmark, sizes):
    """Dynamic sampler: top-b clusters + positives' clusters, deduplicated, expanded to labels, targets."""
    clusters, recall_logits, positives = step_inputs(sizes)

    def sample():
        top = recall_logits.topk(sizes["top"], dim=1).indices
        return candidates_with_positives(top, positives, clusters)

    candidates = benchmark(sample)
    assert candidates.targets[candidates.mask].sum() == (positives >= 0).sum()


def test_ranker_scoring_forward_backward(benchmark, sizes):
    """Bottleneck ranker over the candidates: hidden layer, label-embedding gather, scores, BCE, backward."""
    clusters, recall_logits, positives = step_inputs(sizes)
    candidates = candidates_with_positives(recall_logits.topk(sizes["top"], dim=1).indices, positives, clusters)
    ranker = BottleneckRanker(sizes["dim"], sizes["labels"], sizes["hidden"])
    representation = torch.randn(sizes["batch"], sizes["dim"], requires_grad=True)

    def score_and_backward():
        ranker.zero_grad(set_to_none=True)
        logits = ranker(representation, candidates.labels)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[candidates.mask],
                                                                    candidates.targets[candidates.mask])
        loss.backward()
        return logits

    logits = benchmark(score_and_backward)
    assert logits.shape == candidates.labels.shape and ranker.label_embedding.weight.grad.is_sparse


class Fixed(torch.nn.Module):
    """An encoder or recaller stand-in that returns a fixed tensor: what predict_top does after them is timed."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value

    def forward(self, *inputs) -> torch.Tensor:
        return self.value


def test_prediction_top_k(benchmark, sizes):
    """Prediction after the encoder and recaller (XMCModel.predict_top itself): recall top-b, expansion, ranker
    scores, recall x rank, top-10."""
    clusters, recall_logits, _ = step_inputs(sizes)
    ranker = BottleneckRanker(sizes["dim"], sizes["labels"], sizes["hidden"]).eval()
    representation = torch.randn(sizes["batch"], sizes["dim"])
    model = XMCModel(Fixed(representation), Fixed(recall_logits), ranker, DynamicSampler(sizes["top"]),
                     clusters).eval()
    input_ids = attention_mask = torch.ones(sizes["batch"], 1, dtype=torch.long)   # unread by the stand-ins

    (labels, scores), recalled = benchmark(model.predict_top, input_ids, attention_mask, sizes["top"], 10)

    assert labels.shape == scores.shape == (sizes["batch"], 10) and recalled.shape == (sizes["batch"], sizes["top"])
    with torch.no_grad():   # the same scores computed step by step, in the dtype the model ranks them in
        recall_scores = torch.sigmoid(recall_logits.to(SCORE_DTYPE))
        expected_recalled = recall_scores.topk(sizes["top"], dim=1).indices
        candidates = expand_clusters(expected_recalled, torch.ones_like(expected_recalled, dtype=torch.bool),
                                     clusters)
        expected = torch.where(candidates.mask, recall_scores.gather(1, candidates.clusters)
                               * torch.sigmoid(ranker(representation, candidates.labels).to(SCORE_DTYPE)), -1.0)
        expected_scores, slots = expected.topk(10, dim=1)
    assert torch.equal(recalled, expected_recalled)
    assert torch.allclose(scores, expected_scores)
    assert torch.equal(labels, candidates.labels.gather(1, slots))


@pytest.mark.parametrize("update", ["sparse", "torch-sparseadam", "dense"])
def test_label_embedding_update(benchmark, sizes, update):
    """One optimizer step of the (L, h) label-embedding table after a step's gradient: xmcbench's RowAdam
    over the touched rows, torch's SparseAdam (same semantics), and fused AdamW over the whole table (what
    the original code does)."""
    clusters, recall_logits, positives = step_inputs(sizes)
    candidates = candidates_with_positives(recall_logits.topk(sizes["top"], dim=1).indices, positives, clusters)
    embedding = torch.nn.Embedding(sizes["labels"], sizes["hidden"], sparse=update != "dense")
    optimizer = {"sparse": lambda: RowAdam(embedding.parameters(), lr=1e-3),
                 "torch-sparseadam": lambda: torch.optim.SparseAdam(embedding.parameters(), lr=1e-3),
                 "dense": lambda: torch.optim.AdamW(embedding.parameters(), lr=1e-3, fused=True)}[update]()

    def gradient():
        embedding.zero_grad(set_to_none=True)
        embedding(candidates.labels).sum().backward()

    gradient()
    optimizer.step()   # the optimizer state exists before timing, as in a running training
    before = embedding.weight.detach().clone()
    benchmark.pedantic(optimizer.step, setup=gradient, rounds=5 if not benchmark.disabled else 1)
    after = embedding.weight.detach()
    touched = torch.zeros(sizes["labels"], dtype=torch.bool)
    touched[candidates.labels.flatten()] = True
    moved = (after != before).any(dim=1)
    assert moved[touched].all(), "every row with a gradient takes the step"
    if update != "dense":   # sparse updates leave the other rows as they were; AdamW's decay moves them all
        assert not moved[~touched].any()
    assert torch.isfinite(after).all()
