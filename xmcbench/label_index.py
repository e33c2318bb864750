"""The label index a retriever searches: L label vectors, and each query's k labels of largest inner product.

Below EXACT_BELOW labels the search is exact: queries @ vectors.T and topk, over chunks of CHUNK labels so memory
stays (B, CHUNK + k), on the queries' device. From EXACT_BELOW labels on, when faiss is installed (the optional
extra `xmcbench[ann]`), a faiss HNSW graph (IndexHNSWFlat, inner product) finds the candidates, and their scores
are computed again exactly, so that each returned score is the exact inner product of its label (the Retriever
contract); without faiss the search stays exact at every size, and a one-line note says how to make it faster.

EXACT_BELOW is measured (benchmarks/label_index.py, BENCHMARKS.md section 8): on a 2-core CPU, one thread,
all-MiniLM-L6-v2 label embeddings queried by document embeddings in batches of 64 (eval_batch_size), exact search
costs 0.43 ms per document at debian-builddeps' 20,813 labels (D = 384) and 0.78 ms at 50,000, the HNSW graph
at efSearch 250 (recall@100 0.987 and 0.985) 0.54 and 0.76 ms: below 50,000 labels exact search is about as
fast and misses nothing; above, the graph is faster (2.1x at 100,000, 11x at 500,000). At batch size 1 the graph
is faster at every size measured: exact search reads every vector for each query.

Cosine similarity: normalize the vectors and the queries before (this module scores inner products only).
Reproducible: the graph is built on one thread (faiss's multi-threaded HNSW build depends on thread timing)
from a level generator seeded by `seed`; searching uses `threads` threads (TrainConfig.threads; 0: every core
available) and is deterministic.

Saved (`save(directory)`): `label_vectors.safetensors` (the (L, D) float32 vectors), `label_index.json` (the
layout, and the size and sha256 of the graph file) and, for an HNSW index, `label_index.faiss` (faiss's own
format, no pickle). `load` checks them and ends a missing or damaged file in one XmcError line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from xmcbench.errors import DamagedModel, first_line

EXACT_BELOW = 50_000        # labels: below this, exact search (see the module docstring)
CHUNK = 65_536              # labels scored at once by exact search
NEIGHBOURS = 16             # HNSW's M: links per node (2M on the lowest level)
BUILD_BREADTH = 200         # HNSW's efConstruction
SEARCH_BREADTH = 250        # HNSW's efSearch (at least k): recall@100 0.98-0.99 from 20,813 to 100,000 labels
VECTORS_FILE, LAYOUT_FILE, GRAPH_FILE = "label_vectors.safetensors", "label_index.json", "label_index.faiss"
FORMAT = 1

logger = logging.getLogger(__name__)


def ann_library():
    """The faiss module, or None when the `ann` extra is not installed."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


class LabelIndex:
    """Inner-product search over (L, D) label vectors, kept as float32 on the CPU (exact search copies them
    once to each device it is queried on). Made by `build` or `load`."""

    def __init__(self, vectors: torch.Tensor, graph=None, *, threads: int = 0):
        """Use `build`, or `load`: this keeps the parts as given (graph: a faiss index of `vectors`, or None)."""
        if vectors.dim() != 2:
            raise ValueError(f"LabelIndex needs (L, D) vectors, got shape {tuple(vectors.shape)}")
        self.vectors = vectors.detach().to("cpu", torch.float32).contiguous()
        self.graph = graph
        self.threads = threads or len(os.sched_getaffinity(0))
        self._on_device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def build(cls, vectors: torch.Tensor, *, seed: int = 0, threads: int = 0,
              exact_below: int = EXACT_BELOW) -> "LabelIndex":
        """The index of (L, D) `vectors`: exact below `exact_below` labels or without faiss, else an HNSW graph
        built on one thread with levels drawn from a generator seeded by `seed` (reproducible: faiss's
        multi-threaded build depends on thread timing). threads: search threads (TrainConfig.threads; 0: every
        core available)."""
        index = cls(vectors, threads=threads)
        if index.num_labels >= exact_below:
            faiss = ann_library()
            if faiss is None:
                logger.warning("note: searching %d labels exactly; install faiss for a faster approximate search "
                               "(pip install 'xmcbench[ann]')", index.num_labels)
            else:
                index.graph = _build_graph(faiss, index.vectors.numpy(), seed)
        return index

    @property
    def num_labels(self) -> int:
        return self.vectors.shape[0]

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    @property
    def exact(self) -> bool:
        return self.graph is None

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """queries (B, D) -> (labels (B, k') long, scores (B, k') float32) on the queries' device, best first,
        k' = min(k, L); each score is the exact inner product of the query and that label's vector."""
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"LabelIndex of dimension {self.dim} got queries of shape {tuple(queries.shape)}")
        k = min(k, self.num_labels)
        if self.exact or len(queries) == 0:
            return self._exact(queries.float(), k)
        faiss = ann_library()
        faiss.omp_set_num_threads(min(self.threads, len(queries)))   # faiss spreads the queries over its threads
        found = self.graph.search(queries.detach().to("cpu", torch.float32).contiguous().numpy(), k,
                                  params=faiss.SearchParametersHNSW(efSearch=max(SEARCH_BREADTH, k)))[1]
        labels = torch.from_numpy(found)
        host = queries.detach().to("cpu", torch.float32)
        incomplete = (labels < 0).any(dim=1)   # the graph found fewer than k labels: search these rows exactly
        scores = torch.einsum("bd,bkd->bk", host, self.vectors[labels.clamp_min(0)])
        scores, order = scores.sort(dim=1, descending=True, stable=True)
        labels = labels.gather(1, order)
        if incomplete.any():
            labels[incomplete], scores[incomplete] = self._exact(host[incomplete], k)
        return labels.to(queries.device), scores.to(queries.device)

    def _exact(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if queries.device not in self._on_device:
            self._on_device[queries.device] = self.vectors.to(queries.device)
        vectors = self._on_device[queries.device]
        best_scores = queries.new_empty(len(queries), 0)
        best_labels = torch.empty(len(queries), 0, dtype=torch.long, device=queries.device)
        for start in range(0, self.num_labels, CHUNK):
            top = (queries @ vectors[start:start + CHUNK].T).topk(min(k, len(vectors) - start), dim=1)
            merged = torch.cat([best_scores, top.values], 1).topk(min(k, best_scores.shape[1] + top.values.shape[1]),
                                                                  dim=1)
            best_labels = torch.cat([best_labels, top.indices + start], 1).gather(1, merged.indices)
            best_scores = merged.values
        return best_labels, best_scores

    def save(self, directory: Path) -> None:
        """Write the index into `directory` (which exists)."""
        directory = Path(directory)
        save_file({"vectors": self.vectors}, str(directory / VECTORS_FILE))
        layout = {"format": FORMAT, "num_labels": self.num_labels, "dim": self.dim, "graph": None}
        if self.graph is not None:
            ann_library().write_index(self.graph, str(directory / GRAPH_FILE))
            data = (directory / GRAPH_FILE).read_bytes()
            layout["graph"] = {"file": GRAPH_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: Path, *, threads: int = 0) -> "LabelIndex":
        """The index `save` wrote into `directory`; a missing or damaged file raises XmcError."""
        directory = Path(directory)
        redo = "save the label index again (re-run training)"
        try:
            layout = json.loads((directory / LAYOUT_FILE).read_text(encoding="utf-8"))
            vectors = load_file(str(directory / VECTORS_FILE))["vectors"]
            shape_ok = layout["format"] == FORMAT and tuple(vectors.shape) == (layout["num_labels"], layout["dim"])
        except Exception as error:   # missing, unreadable or damaged: JSON, key and safetensors errors alike
            raise DamagedModel(f"cannot read the label index in {directory} ({first_line(error)}): {redo}") from None
        if not shape_ok or vectors.dtype != torch.float32:
            raise DamagedModel(f"the label index in {directory} does not match its {LAYOUT_FILE}: {redo}")
        index = cls(vectors, threads=threads)
        if layout["graph"] is not None:
            index.graph = _read_graph(directory / GRAPH_FILE, layout["graph"], index, redo)
        return index


def _build_graph(faiss, vectors: np.ndarray, seed: int):
    """An IndexHNSWFlat of (L, D) `vectors` (inner product), built on one thread."""
    graph = faiss.IndexHNSWFlat(vectors.shape[1], NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
    graph.hnsw.efConstruction = BUILD_BREADTH
    graph.hnsw.rng = faiss.RandomGenerator(seed)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        graph.add(vectors)
    finally:
        faiss.omp_set_num_threads(threads)
    return graph


def _read_graph(path: Path, expected: dict, index: LabelIndex, redo: str):
    """The faiss index in `path`, checked against `expected` (its bytes and sha256) and `index`'s vectors; None
    without faiss (the search is then exact)."""
    faiss = ann_library()
    if faiss is None:
        logger.warning("note: the label index in %s is searched exactly; install faiss to use its approximate "
                       "index (pip install 'xmcbench[ann]')", path.parent)
        return None
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DamagedModel(f"cannot read {path} ({first_line(error)}): {redo}") from None
    if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise DamagedModel(f"{path} is damaged (its size or sha256 differs from {LAYOUT_FILE}): {redo}")
    graph = faiss.read_index(str(path))
    if graph.ntotal != index.num_labels or graph.d != index.dim:
        raise DamagedModel(f"{path} holds {graph.ntotal} vectors of dimension {graph.d}, not {index.num_labels} of "
                           f"{index.dim}: {redo}")
    return graph
