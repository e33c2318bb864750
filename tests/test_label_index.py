"""The label index a retriever searches (xmcbench.label_index): exact search below EXACT_BELOW labels, a faiss
HNSW graph above it, the same answers as brute force, reproducible builds, and files that load or fail in one
line."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from xmcbench import label_index
from xmcbench.errors import XmcError
from xmcbench.interfaces import Retriever
from xmcbench.label_index import LabelIndex, ann_library
from xmcbench.testing import check_recaller, tiny_config

faiss = ann_library()
needs_faiss = pytest.mark.skipif(faiss is None, reason="the approximate index needs the `ann` extra (faiss-cpu)")
# exact_below values: 0 builds the graph at any size, 10,000 searches these small sets exactly
GRAPH_OR_EXACT = [pytest.param(0, marks=needs_faiss, id="graph"), pytest.param(10_000, id="exact")]


def clustered(rows: int, dim: int, seed: int, centres: int = 30) -> torch.Tensor:
    """(rows, dim) unit vectors around `centres` random directions: structured as real embeddings are."""
    generator = torch.Generator().manual_seed(seed)
    middle = torch.randn(centres, dim, generator=generator)
    vectors = middle[torch.randint(0, centres, (rows,), generator=generator)] + 0.5 * torch.randn(rows, dim,
                                                                                                  generator=generator)
    return nn.functional.normalize(vectors, dim=1)


def brute_force(vectors: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = (queries @ vectors.T).topk(k, dim=1)
    return top.indices, top.values


@pytest.fixture(scope="module")
def vectors() -> torch.Tensor:
    return clustered(2000, 32, seed=0)


@pytest.fixture(scope="module")
def queries() -> torch.Tensor:
    return clustered(50, 32, seed=1)


@pytest.fixture(scope="module")
def approximate(vectors) -> LabelIndex:
    return LabelIndex.build(vectors, seed=0, threads=1, exact_below=0)


def recall(found: torch.Tensor, truth: torch.Tensor) -> float:
    return sum(len(set(a) & set(b)) for a, b in zip(found.tolist(), truth.tolist())) / truth.numel()


def test_exact_search_is_brute_force(vectors, queries):
    index = LabelIndex.build(vectors, threads=1)
    assert index.exact
    labels, scores = index.search(queries, 10)
    expected_labels, expected_scores = brute_force(vectors, queries, 10)
    assert labels.dtype == torch.long and torch.equal(labels, expected_labels)
    assert torch.equal(scores, expected_scores)


def test_exact_search_over_label_chunks_is_brute_force(vectors, queries, monkeypatch):
    monkeypatch.setattr(label_index, "CHUNK", 300)   # 7 chunks, the last one of 200 labels
    labels, scores = LabelIndex.build(vectors, threads=1).search(queries, 250)
    expected_labels, expected_scores = brute_force(vectors, queries, 250)
    assert torch.equal(labels, expected_labels)
    torch.testing.assert_close(scores, expected_scores)


@needs_faiss
def test_the_approximate_index_finds_the_true_neighbours_and_scores_them_exactly(vectors, queries, approximate):
    assert not approximate.exact
    labels, scores = approximate.search(queries, 100)
    assert labels.shape == scores.shape == (50, 100) and labels.dtype == torch.long
    assert recall(labels, brute_force(vectors, queries, 100)[0]) >= 0.95
    assert all(len(set(row)) == len(row) for row in labels.tolist())
    assert bool((scores[:, 1:] <= scores[:, :-1]).all())
    torch.testing.assert_close(scores, torch.einsum("bd,bkd->bk", queries, vectors[labels]))
    assert torch.equal(labels[:, 0], brute_force(vectors, queries, 1)[0][:, 0])


@needs_faiss
def test_the_graph_is_used_from_exact_below_labels_on(vectors):
    assert LabelIndex.build(vectors, exact_below=len(vectors)).graph is not None
    assert LabelIndex.build(vectors, exact_below=len(vectors) + 1).exact
    assert LabelIndex.build(vectors[:100]).exact and label_index.EXACT_BELOW > 100


def test_without_faiss_the_search_is_exact_with_a_note(vectors, queries, monkeypatch, caplog):
    monkeypatch.setattr(label_index, "ann_library", lambda: None)
    with caplog.at_level(logging.WARNING, logger="xmcbench.label_index"):
        index = LabelIndex.build(vectors, exact_below=0)
    assert index.exact
    assert [record.getMessage() for record in caplog.records] == [
        "note: searching 2000 labels exactly; install faiss for a faster approximate search "
        "(pip install 'xmcbench[ann]')"]
    assert torch.equal(index.search(queries, 5)[0], brute_force(vectors, queries, 5)[0])


@needs_faiss
def test_the_same_seed_builds_the_same_graph_and_another_seed_another(vectors):
    def graph_bytes(seed):
        return bytes(faiss.serialize_index(LabelIndex.build(vectors, seed=seed, threads=2, exact_below=0).graph))

    assert graph_bytes(3) == graph_bytes(3)
    assert graph_bytes(3) != graph_bytes(4)


@pytest.mark.parametrize("exact_below", GRAPH_OR_EXACT)
def test_k_larger_than_the_label_count_returns_every_label(exact_below):
    vectors = clustered(30, 8, seed=2)
    queries = clustered(4, 8, seed=3)
    labels, scores = LabelIndex.build(vectors, exact_below=exact_below).search(queries, 100)
    assert labels.shape == scores.shape == (4, 30)
    assert all(sorted(row) == list(range(30)) for row in labels.tolist())
    torch.testing.assert_close(scores, brute_force(vectors, queries, 30)[1])


@pytest.mark.parametrize("exact_below", GRAPH_OR_EXACT)
def test_an_empty_batch_of_queries_finds_nothing(vectors, exact_below):
    labels, scores = LabelIndex.build(vectors[:200], exact_below=exact_below).search(torch.zeros(0, 32), 7)
    assert labels.shape == scores.shape == (0, 7) and labels.dtype == torch.long


@pytest.mark.parametrize("exact_below", GRAPH_OR_EXACT)
def test_save_and_load_give_the_same_search(vectors, queries, tmp_path, exact_below):
    index = LabelIndex.build(vectors, exact_below=exact_below)
    index.save(tmp_path)
    loaded = LabelIndex.load(tmp_path, threads=1)
    assert loaded.exact == index.exact
    for found, expected in zip(loaded.search(queries, 20), index.search(queries, 20)):
        assert torch.equal(found, expected)
    assert not any(path.suffix in (".pkl", ".pickle", ".pt") for path in tmp_path.iterdir())


@needs_faiss
def test_a_saved_graph_is_searched_exactly_where_faiss_is_missing(vectors, queries, approximate, tmp_path,
                                                                   monkeypatch):
    approximate.save(tmp_path)
    monkeypatch.setattr(label_index, "ann_library", lambda: None)
    loaded = LabelIndex.load(tmp_path)
    assert loaded.exact and torch.equal(loaded.search(queries, 5)[0], brute_force(vectors, queries, 5)[0])


@needs_faiss
@pytest.mark.parametrize("damage", ["flip a byte of the graph", "truncate the vectors", "remove the layout",
                                    "remove the graph"])
def test_a_damaged_or_missing_file_ends_in_one_line(approximate, tmp_path, damage):
    approximate.save(tmp_path)
    graph, vectors, layout = (tmp_path / name for name in (label_index.GRAPH_FILE, label_index.VECTORS_FILE,
                                                           label_index.LAYOUT_FILE))
    if damage == "flip a byte of the graph":
        data = bytearray(graph.read_bytes())
        data[len(data) // 2] ^= 0xFF
        graph.write_bytes(bytes(data))
    elif damage == "truncate the vectors":
        vectors.write_bytes(vectors.read_bytes()[:-100])
    elif damage == "remove the layout":
        layout.unlink()
    else:
        graph.unlink()
    with pytest.raises(XmcError) as raised:
        LabelIndex.load(tmp_path)
    assert "\n" not in str(raised.value) and str(tmp_path) in str(raised.value)


class IndexedRetriever(Retriever):
    """A retriever over fixed label vectors whose search is the label index's (as a dual encoder's would be)."""

    def __init__(self, in_dim, num_labels, exact_below):
        super().__init__()
        self.num_clusters = num_labels
        self.register_buffer("label_vectors", clustered(num_labels, in_dim, seed=5))
        self.index = LabelIndex.build(self.label_vectors, threads=1, exact_below=exact_below)

    def forward(self, representation):
        return representation @ self.label_vectors.T

    def search(self, representation, top):
        return self.index.search(representation, top)


@pytest.mark.parametrize("exact_below", GRAPH_OR_EXACT)
def test_a_retriever_searching_the_index_meets_the_retriever_contract(tiny_model_dir, exact_below):
    check_recaller(lambda config, in_dim, num_labels: IndexedRetriever(in_dim, num_labels, exact_below),
                   tiny_config(tiny_model_dir), num_clusters=40)
