"""Label features and balanced label clustering (the label tree of LightXML / AttentionXML / PECOS).

LightXML groups labels into K clusters of near-equal size; its "meta" classifier first predicts clusters,
then ranks the labels inside the top clusters. The clusters come from recursive balanced 2-means on label
representations, where a label is represented by the L2-normalised sum of the TF-IDF / BoW feature rows
of its training documents. Both steps are sparse and run at the scale of Wiki-500K and Amazon-670K
(benchmarks/clustering_vs_pecos.py compares them with PECOS's).

Shapes: N documents, F features, L labels, K clusters.
"""

from __future__ import annotations

import contextlib
import lzma
import io
import math
import mmap
import multiprocessing
import multiprocessing.connection
import os
import signal
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np
import scipy.sparse as sp
from sklearn.datasets import load_svmlight_file
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.preprocessing import normalize
from sklearn.utils.extmath import row_norms

from xmcbench.data import open_binary
from xmcbench.errors import XmcError, error_line
from xmcbench.formats import parse_xc_header, read_xc_sparse
from xmcbench.progress import progress_bar

__all__ = [
    "tfidf_features",
    "read_sparse_features",
    "label_features",
    "balanced_clusters",
    "num_clusters_for",
    "cluster_members",
]


# --------------------------------------------------------------------------------------------------
# Document features
# --------------------------------------------------------------------------------------------------


def tfidf_features(train_texts: list[str], max_features: int | None = None) -> sp.csr_matrix:
    """TF-IDF features of the training texts, used only to build label representations.

    train_texts: N strings.
    Returns (N, F) csr float32, rows L2-normalised (sublinear tf, unigrams, lowercase,
    min_df=2, or 1 when N < 50 because on tiny corpora min_df=2 would drop almost every term).
    """
    n = len(train_texts)
    vectorizer = TfidfVectorizer(
        lowercase=True,
        ngram_range=(1, 1),
        min_df=2 if n >= 50 else 1,
        sublinear_tf=True,
        max_features=max_features,
        dtype=np.float32,
    )
    try:
        x = vectorizer.fit_transform(train_texts)
    except ValueError as exc:  # sklearn says "empty vocabulary" when no text has a usable token
        raise XmcError(
            f"TF-IDF found no terms in the {n} training texts ({exc}); check that the training text file "
            "is not empty and holds words"
        ) from None
    x = sp.csr_matrix(x, dtype=np.float32)
    x.sort_indices()
    return x


@contextlib.contextmanager
def _open_text(path: Path):
    with open_binary(path) as stream:
        yield io.TextIOWrapper(stream, encoding="utf-8", errors="replace")


def _parse_lines(
    lines: Iterable[str], path: Path, first_lineno: int, num_features: int | None, skip_blank: bool
) -> tuple[sp.csr_matrix, int]:
    """Parse 'labels feat:val ...' lines (labels part optional) into a (rows, F) csr float32 matrix.

    num_features: D from a header (indices must be < D) or None (F = max index + 1).
    skip_blank: svmlight semantics (blank lines are not documents) vs. XC semantics (one line per document).
    Returns (matrix, number of data rows). Raises XmcError naming the file and 1-based line number.
    Duplicate feature indices on a line are summed.
    """
    indptr = [0]
    indices: list[int] = []
    values: list[float] = []
    max_index = -1
    lineno = first_lineno - 1
    for lineno, raw in enumerate(lines, start=first_lineno):
        line = raw.split("#", 1)[0]  # svmlight allows trailing comments
        tokens = line.split()
        if not tokens and skip_blank:
            continue
        where = f"{path}:{lineno}"
        if tokens and ":" not in tokens[0]:
            # first token is the comma-separated label list (unused here, but must be well-formed)
            try:
                for lab in tokens[0].split(","):
                    if lab:
                        float(lab)
            except ValueError:
                raise XmcError(
                    f"{where}: malformed label list {tokens[0]!r}; expected comma-separated label ids "
                    "like '3,17,42' followed by 'feature:value' pairs"
                ) from None
            tokens = tokens[1:]
        for tok in tokens:
            key, sep, val = tok.partition(":")
            if key == "qid":
                continue
            try:
                if not sep:
                    raise ValueError
                idx = int(key)
                value = float(val)
            except ValueError:
                raise XmcError(
                    f"{where}: malformed feature {tok!r}; expected 'index:value' with an integer index "
                    "and a number value"
                ) from None
            if idx < 0 or (num_features is not None and idx >= num_features):
                bound = f"[0, {num_features})" if num_features is not None else ">= 0"
                raise XmcError(
                    f"{where}: feature index {idx} out of range {bound}; indices are 0-based"
                    + (", and the header's second number is the feature count" if num_features is not None else "")
                )
            if not math.isfinite(value):
                raise XmcError(f"{where}: feature value {val!r} is not a finite number; fix or drop that feature")
            indices.append(idx)
            values.append(value)
            max_index = max(max_index, idx)
        indptr.append(len(indices))
    rows = len(indptr) - 1
    width = num_features if num_features is not None else max_index + 1
    x = sp.csr_matrix(
        (np.asarray(values, dtype=np.float32), np.asarray(indices, dtype=np.int64), np.asarray(indptr, dtype=np.int64)),
        shape=(rows, width),
    )
    x.sum_duplicates()
    return x, rows


def _read_svmlight(path: Path) -> sp.csr_matrix:
    """LightXML's train_v1.txt. sklearn's C parser is fast but its errors carry no line number, so on
    failure (or on non-finite values, which it accepts) we re-read with the Python parser to locate the line."""
    try:
        with open_binary(path) as fh:
            x, _ = load_svmlight_file(fh, multilabel=True, zero_based=True, dtype=np.float32)
        x = sp.csr_matrix(x, dtype=np.float32)
        if np.isfinite(x.data).all():
            return x
    except ValueError:
        pass
    with _open_text(path) as fh:
        x, _ = _parse_lines(fh, path, first_lineno=1, num_features=None, skip_blank=True)
    return x


def _read_xc(path: Path, header: tuple[int, int, int]) -> sp.csr_matrix:
    """An Extreme Classification Repository file through scikit-learn's C parser (read_xc_sparse); on failure
    re-read with the Python parser, which names the bad line (or accepts what only it reads, such as unsorted
    feature ids)."""
    try:
        return read_xc_sparse(path).features
    except XmcError:
        pass
    n_header, d_header, _ = header
    with _open_text(path) as fh:
        fh.readline()
        x, rows = _parse_lines(fh, path, first_lineno=2, num_features=d_header, skip_blank=False)
    if rows != n_header:
        raise XmcError(
            f"{path}: header line 1 says {n_header} documents but the file has {rows} data lines; "
            "fix the header or re-export the file"
        )
    return x


def read_sparse_features(path: Path, num_docs: int | None = None) -> sp.csr_matrix:
    """Read training-document sparse features (BoW / TF-IDF) from a file.

    Formats, detected from the first line:
    - Extreme Classification Repository BoW file: header 'N D L', then one line per document
      'l1,l2,... f:v f:v ...' (the label list may be empty);
    - LightXML's svmlight-style train_v1.txt: no header, 'labels f:v f:v ...' per line, 0-based indices.
    .gz / .xz / .bz2 files are decompressed by extension.

    num_docs: expected N (the number of training texts); a mismatch raises XmcError.
    Returns (N, F) csr float32 with L2-normalised rows (all-zero rows stay zero).
    """
    path = Path(path)
    if not path.is_file():
        raise XmcError(f"{path}: feature file not found; check the dataset directory or the features path")
    try:
        with _open_text(path) as fh:
            header = parse_xc_header(fh.readline())
        x = _read_svmlight(path) if header is None else _read_xc(path, header)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise XmcError(f"{path}: cannot read feature file ({exc}); check that it is a valid, complete file") from None
    if num_docs is not None and x.shape[0] != num_docs:
        raise XmcError(
            f"{path}: has {x.shape[0]} feature rows but {num_docs} training documents are expected; "
            "use the feature file that belongs to this dataset's training split"
        )
    x = normalize(x, norm="l2", axis=1, copy=False)
    x = sp.csr_matrix(x, dtype=np.float32)
    x.sort_indices()
    return x


# --------------------------------------------------------------------------------------------------
# Label representations and clustering
# --------------------------------------------------------------------------------------------------


def label_features(doc_features: sp.csr_matrix, labels: sp.csr_matrix, threads: int = 0) -> sp.csr_matrix:
    """Label representation: row l = L2-normalised sum of the feature rows of the documents carrying label l.

    doc_features: (N, F); labels: (N, L) 0/1 csr.
    threads: worker processes (forked) that share the product by label rows; 0 means one per available
    core, or none for small inputs. The result does not depend on it.
    Returns (L, F) csr float32; labels with no document get an all-zero row. The column indices within a row
    are not sorted: nothing downstream needs them sorted, and sorting 10^8 entries costs seconds.
    """
    if doc_features.shape[0] != labels.shape[0]:
        raise ValueError(
            f"doc_features has {doc_features.shape[0]} rows but labels has {labels.shape[0]}; they must match"
        )
    if threads < 0:
        raise XmcError(f"threads={threads} must be >= 0 (0 means one per available core)")
    label_docs = sp.csr_matrix(labels).T.tocsr()  # (L, N), a new matrix: the caller's labels stay untouched
    if not np.all(label_docs.data):
        label_docs.eliminate_zeros()
    # float32 ones: a label counts once per document whatever weight it is stored with, and int or float64
    # labels would turn the product into float64 (twice the memory).
    label_docs = sp.csr_matrix((np.ones(label_docs.nnz, dtype=np.float32), label_docs.indices, label_docs.indptr),
                               shape=label_docs.shape)
    docs = doc_features
    if not (sp.issparse(docs) and docs.format == "csr" and docs.dtype == np.float32):
        docs = sp.csr_matrix(docs, dtype=np.float32)
    # products that form each label's row: its number of entries before repeated features merge
    work = label_docs @ np.diff(docs.indptr).astype(np.float64)
    workers = threads or (_available_cores() if work.sum() >= _MIN_WORK_FOR_WORKERS else 1)
    if workers > 1 and _fork_available() and hasattr(mmap, "MADV_REMOVE"):
        return _label_features_in_workers(label_docs, docs, work, workers)
    feats = sp.csr_matrix(label_docs @ docs)
    normalize(feats, norm="l2", axis=1, copy=False)  # in place: no second (L, F) matrix
    return feats


def _label_features_in_workers(label_docs: sp.csr_matrix, docs: sp.csr_matrix, work: np.ndarray,
                               workers: int) -> sp.csr_matrix:
    """label_docs @ docs with normalised rows, by label pieces in forked workers (scipy's product holds the
    GIL, so threads would not help). label_docs: (L, N); docs: (N, F); work: (L,) products per label.

    Each piece of labels gets a region of shared memory as large as its products (virtual memory: only
    what the workers write takes pages). The parent then moves the pieces together in place and frees the
    rest: the returned matrix's data and indices live in that shared memory (a process forked later shares
    them rather than copying them on write), freed with the matrix.
    """
    num_labels, num_features = label_docs.shape[0], docs.shape[1]
    # pieces of about equal work, several per worker: a worker's own product stays small and the bar moves
    # A label on most documents carries most of the work, so several cut points can fall on the same label:
    # repeated bounds are dropped, so that no piece is empty (fewer pieces than asked for, never an empty one).
    cumulative = np.concatenate([[0.0], np.cumsum(work)])
    cuts = np.searchsorted(cumulative, np.linspace(0, cumulative[-1], workers * _PIECES_PER_WORKER + 1)[1:-1])
    bounds = np.unique(np.concatenate([[0], cuts, [num_labels]]).astype(np.int64))
    num_pieces = len(bounds) - 1
    workers = max(1, min(workers, num_pieces))
    capacity = np.minimum(cumulative[bounds[1:]] - cumulative[bounds[:-1]], np.diff(bounds) * float(num_features))
    offsets = np.concatenate([[0], np.cumsum(capacity.astype(np.int64))])
    index_dtype = np.int32 if max(offsets[-1], num_features) < np.iinfo(np.int32).max else np.int64
    data_memory = mmap.mmap(-1, max(int(offsets[-1]) * 4, 1))
    indices_memory = mmap.mmap(-1, max(int(offsets[-1]) * np.dtype(index_dtype).itemsize, 1))
    layout_memory = mmap.mmap(-1, 8 * (num_labels + 1 + num_pieces))
    data = indices = ends = sizes = None
    try:
        data = np.frombuffer(data_memory, dtype=np.float32, count=int(offsets[-1]))
        indices = np.frombuffer(indices_memory, dtype=index_dtype, count=int(offsets[-1]))
        ends = np.frombuffer(layout_memory, dtype=np.int64, count=num_labels + 1)  # row ends in the regions
        sizes = np.frombuffer(layout_memory, dtype=np.int64, count=num_pieces, offset=8 * (num_labels + 1))

        def work_pieces(worker: int, advance) -> None:
            for piece in range(worker, num_pieces, workers):
                start, end, offset = bounds[piece], bounds[piece + 1], offsets[piece]
                part = sp.csr_matrix(label_docs[start:end] @ docs)
                normalize(part, norm="l2", axis=1, copy=False)
                data[offset:offset + part.nnz] = part.data
                indices[offset:offset + part.nnz] = part.indices
                ends[start + 1:end + 1] = offset + part.indptr[1:]
                sizes[piece] = part.nnz
                advance(1)

        _run_forked(workers, work_pieces, "label features", num_pieces)

        indptr = np.zeros(num_labels + 1, dtype=np.int64)
        position = 0
        for piece in range(num_pieces):
            start, end, offset, size = bounds[piece], bounds[piece + 1], int(offsets[piece]), int(sizes[piece])
            for chunk in range(0, size if position < offset else 0, _MOVE_CHUNK):
                # leftwards, a chunk at a time: an overlapping chunk costs numpy a temporary of its size only
                length = min(_MOVE_CHUNK, size - chunk)
                data[position + chunk:position + chunk + length] = data[offset + chunk:offset + chunk + length]
                indices[position + chunk:position + chunk + length] = indices[offset + chunk:offset + chunk + length]
            indptr[start + 1:end + 1] = ends[start + 1:end + 1] - offset + position
            position += size
        for memory, itemsize in ((data_memory, 4), (indices_memory, indices.itemsize)):
            first_free_page = -(-position * itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
            if first_free_page < len(memory):
                memory.madvise(mmap.MADV_REMOVE, first_free_page)
        return sp.csr_matrix((data[:position], indices[:position], indptr), shape=(num_labels, num_features))
    finally:
        # the returned matrix holds its own views; these must go before the layout memory closes
        data = indices = ends = sizes = None
        layout_memory.close()


# Part of the cluster cache's key (xmcbench.indexing): change it whenever balanced_clusters gives other clusters
# for the same inputs and seed.
ALGORITHM_VERSION = "balanced-2means-random-start-2"

# The label tree is numbered heap-style: the root is node 1 and node h has children 2h and 2h + 1, so node h
# sits at depth h.bit_length() - 1 and leaf k (of K = 2^D) is node K + k. The clustering runs as tasks fixed
# by (L, K) alone: every node above depth _TASK_DEPTH is a task of one split, and every node at that depth
# is a task that splits its whole subtree, its rows moving from parent to children in memory. A task starts
# from its labels' rows of the full label-feature matrix and each node draws its own random numbers, so the
# result does not depend on how many worker processes share the tasks (or in which order they run them).
_TASK_DEPTH = 5  # 32 subtree tasks: enough to balance a handful of workers
_MIN_NNZ_FOR_WORKERS = 1_000_000  # below this, forking costs more than it saves (when threads is automatic)
_MIN_WORK_FOR_WORKERS = 10_000_000  # the same for label features' products
_PIECES_PER_WORKER = 8  # see _label_features_in_workers
_MOVE_CHUNK = 1 << 22  # see _label_features_in_workers
_NUMPY_GATHER_ENTRIES = 1 << 18  # see _add_rows
_POWER_ITERATIONS = 3  # see _principal_direction
_POWER_SAMPLE = 2048  # rows of a larger node that its power iterations use (see _principal_direction)
_COMPACT_MIN_SHARE = 32  # see _compacted
_PENDING, _RUNNING, _DONE = 0, 1, 2


def _node_depth(node: int) -> int:
    return node.bit_length() - 1


class _LabelTree:
    """The balanced binary tree over L labels: its shape, its tasks, and where each node's labels sit.

    order (filled as nodes split): (L,) label ids in tree order; node h holds order[start:end] for
    (start, end) = span(h), ascending within each node, its first child taking the first n // 2 positions.
    """

    def __init__(self, x: sp.csr_matrix, num_clusters: int, seed: int, max_iter: int, tol: float):
        self.x = x
        self.seed = seed
        self.depth = num_clusters.bit_length() - 1
        self.task_depth = min(_TASK_DEPTH, self.depth - 1)
        self.max_iter = max_iter
        self.tol = tol
        # bounds[d]: (2^d + 1,) start of each node of depth d, then L
        self.bounds = [np.array([0, x.shape[0]], dtype=np.int64)]
        for _ in range(self.depth):
            above = self.bounds[-1]
            below = np.empty(2 * len(above) - 1, dtype=np.int64)
            below[0::2] = above
            below[1::2] = above[:-1] + np.diff(above) // 2
            self.bounds.append(below)

    def span(self, node: int) -> tuple[int, int]:
        depth = _node_depth(node)
        index = node - (1 << depth)
        return int(self.bounds[depth][index]), int(self.bounds[depth][index + 1])

    def tasks(self) -> range:
        return range(1, 1 << (self.task_depth + 1))

    def num_subtree_tasks(self) -> int:
        return 1 << self.task_depth

    def leaf_assignment(self, order: np.ndarray) -> np.ndarray:
        leaves = self.bounds[self.depth]
        label_to_cluster = np.empty(len(order), dtype=np.int64)
        label_to_cluster[order] = np.repeat(np.arange(len(leaves) - 1, dtype=np.int64), np.diff(leaves))
        return label_to_cluster

    def run_task(self, task: int, order: np.ndarray, advance) -> None:
        """Split node `task` (one level above the task depth, its whole subtree at it), writing `order`."""
        last_depth = _node_depth(task) + 1 if _node_depth(task) < self.task_depth else self.depth
        start, end = self.span(task)
        block = self.x if task == 1 else self.x[order[start:end]]  # the root needs no copy
        stack = [(task, *_compacted(block, _row_sum(block))[:2])]
        while stack:  # depth first: only the pending siblings of one path are held in memory
            node, block, total = stack.pop()
            rng = np.random.default_rng([self.seed, node])  # the node's own: the same in any worker
            in_first, first_sum = _balanced_split(block, total, rng, self.max_iter, self.tol)
            start, end = self.span(node)
            members = order[start:end]
            order[start:end] = np.concatenate((members[in_first], members[~in_first]))
            advance(1)
            if _node_depth(node) + 1 < last_depth:
                for child, rows, child_total in ((2 * node + 1, ~in_first, total - first_sum),
                                                 (2 * node, in_first, first_sum)):
                    stack.append((child, *_compacted(block[rows], child_total)[:2]))


def _compacted(block: sp.csr_matrix, total: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray | None]:
    """The same rows over only the columns they use, renumbered in their order, when at least half of the
    block's columns are unused (as counted from total, the (m,) sum of the rows) and there are more unused
    columns than 1/_COMPACT_MIN_SHARE of its entries: dense centroids then cost O(columns used), not O(F),
    which outweighs the O(entries + columns) renumbering.

    Returns (block, total) over the columns kept, and the (m,) bool mask of the columns kept (None: all).
    """
    num_rows, width = block.shape
    unused = width - np.count_nonzero(total)
    if 2 * unused < width or unused * _COMPACT_MIN_SHARE <= block.nnz:
        return block, total, None
    # Nonnegative rows use exactly the columns of positive sum, but float32 rounding may have zeroed the sum
    # of a column used only by tiny values, and rows may be negative: a used column outside `kept` is
    # renumbered -1 below, and then the columns are marked from the entries instead.
    kept = total > 0
    new_ids = np.cumsum(kept, dtype=block.indices.dtype)
    new_ids -= 1
    new_ids[~kept] = -1
    new_indices = new_ids[block.indices]
    if new_indices.min(initial=0) < 0:
        kept = np.zeros(width, dtype=bool)
        kept[block.indices] = True
        new_ids = np.cumsum(kept, dtype=block.indices.dtype)
        new_ids -= 1
        new_indices = new_ids[block.indices]
    compact = sp.csr_matrix((block.data, new_indices, block.indptr), shape=(num_rows, int(np.count_nonzero(kept))))
    return compact, total[kept], kept


def _row_sum(block: sp.csr_matrix, rows: np.ndarray | None = None) -> np.ndarray:
    """(m,) float32 sum of the block's rows (all, or those where the (n,) bool mask `rows` is True)."""
    weights = np.ones(block.shape[0], dtype=np.float32) if rows is None else rows.astype(np.float32)
    return block.T @ weights  # a product with the (m, n) csc view: one pass, no copy


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # einsum, not BLAS: its sum does not depend on BLAS threads, so neither do the clusters
    return float(np.einsum("i,i->", a, b))


def _inverse_norm(vector: np.ndarray) -> float:
    norm2 = _dot(vector, vector)
    return 1 / np.sqrt(norm2) if norm2 > 0 else 0.0


def _add_rows(target: np.ndarray, block: sp.csr_matrix, rows: np.ndarray, lengths: np.ndarray,
              signs: np.ndarray) -> None:
    """target += sum_i signs[i] * block[rows[i]], in place; target (m,) float32; rows, their entry counts
    `lengths` and signs (+1 or -1): (k,).

    Few entries: gathered with numpy (scipy's indexing costs ~0.1 ms a call, which adds up over 10^4 small
    nodes). Many: through scipy's row gather, whose temporaries are 8 bytes an entry instead of ~30.
    """
    if lengths.sum() > _NUMPY_GATHER_ENTRIES:
        target += block[rows].T @ signs
        return
    starts = block.indptr[rows]
    entries = np.arange(lengths.sum()) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    np.add.at(target, block.indices[entries], block.data[entries] * np.repeat(signs, lengths))


def _principal_direction(block: sp.csr_matrix, total: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(m,) unit float32 direction whose ranking gives a split its first assignment: a few power iterations
    towards the principal direction of the centred rows, from a random +-1 combination of them.

    2-means from there, rather than from two random rows as PECOS starts, ends in better clusters: mean
    cosine of a label to its cluster's centroid +12% on the amazon670k shape, +10% on wiki500k's (800K
    documents), +0.05% on a flat one; from two rows, the power iterations stay near those two rows in
    sparse high-dimensional data. A large block (n > _POWER_SAMPLE) uses a random sample of its rows.
    """
    n, width = block.shape
    kept = None
    if n > _POWER_SAMPLE:
        rows = block[np.sort(rng.choice(n, _POWER_SAMPLE, replace=False))]
        rows, total, kept = _compacted(rows, _row_sum(rows))
        block, n = rows, _POWER_SAMPLE
    signs = rng.integers(0, 2, n).astype(np.float32) * 2 - 1
    signs -= signs.mean()
    direction = _power_iterations(block, total, block.T @ signs)
    if kept is None:
        return direction
    full = np.zeros(width, dtype=np.float32)
    full[kept] = direction
    return full


def _power_iterations(block: sp.csr_matrix, total: np.ndarray, direction: np.ndarray) -> np.ndarray:
    mean = total / np.float32(block.shape[0])
    columns = block.T
    direction *= np.float32(_inverse_norm(direction))
    for _ in range(_POWER_ITERATIONS):
        projections = block @ direction
        projections -= np.float32(_dot(mean, direction))  # (n,): of the centred rows
        direction = columns @ projections
        direction *= np.float32(_inverse_norm(direction))
    return direction


def _centroid_direction(total: np.ndarray, first_sum: np.ndarray) -> tuple[np.ndarray, float]:
    """c2 - c1 for the unit centroids c1 = S1 / |S1| and c2 = S2 / |S2| of the two halves (S2 = total - S1),
    and <total, c2>; all (m,) float32."""
    direction = total - first_sum
    second_scale = _inverse_norm(direction)
    total_dot_second = _dot(total, direction) * second_scale
    direction *= np.float32(second_scale)
    direction -= first_sum * np.float32(_inverse_norm(first_sum))
    return direction, total_dot_second


def _balanced_split(
    block: sp.csr_matrix, total: np.ndarray, rng: np.random.Generator, max_iter: int, tol: float
) -> tuple[np.ndarray, np.ndarray]:
    """One balanced spherical 2-means split.

    block: (n, m) csr float32 with L2-normalised (or zero) rows, n >= 2; total: (m,) float32, the sum of its
    rows; rng: the node's own random numbers (see _principal_direction).
    Returns in_first (n,) bool, True for the n // 2 rows of the first child, and first_sum (m,) float32, the
    sum of those rows. Stops when the assignment no longer changes, when the mean cosine of the rows to
    their centroids gains less than tol, or after max_iter assignments.
    """
    n = block.shape[0]
    half = n // 2
    direction = _principal_direction(block, total, rng)
    in_first = first_sum = None
    objective = total_dot_second = -np.inf
    for _ in range(max_iter):
        # The n // 2 rows lowest along the direction go first, which is what keeps the split balanced. Along
        # c2 - c1, that is cos(x, c2) - cos(x, c1). Everything is float32 like the block: a float64 vector
        # would make scipy copy the block.
        scores = block @ direction
        chosen = np.argpartition(scores, half)[:half]
        assignment = np.zeros(n, dtype=bool)
        assignment[chosen] = True
        if in_first is None:
            first_sum = _row_sum(block, assignment)
        else:
            moved = np.flatnonzero(assignment != in_first)
            if len(moved) == 0:
                break
            lengths = block.indptr[moved + 1] - block.indptr[moved]
            if lengths.sum() > block.nnz // 4:
                first_sum = _row_sum(block, assignment)
            else:  # after the first rounds only a few rows move: add and remove just theirs
                _add_rows(first_sum, block, moved, lengths, np.where(assignment[moved], 1, -1).astype(np.float32))
            # mean cosine of each row to the centroid it was assigned by: every row's cos(x, c2), less the
            # first rows' scores
            new_objective = (total_dot_second - np.add.reduce(scores[chosen], dtype=np.float64)) / n
            if new_objective - objective < tol:
                in_first = assignment
                break
            objective = new_objective
        in_first = assignment
        direction, total_dot_second = _centroid_direction(total, first_sum)
    return in_first, first_sum


def _available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _unit_rows(label_feats) -> sp.csr_matrix:
    """(L, F) csr float32 with L2-normalised (or zero) rows: the input itself when it already is one."""
    x = label_feats
    if not (sp.issparse(x) and x.format == "csr" and x.dtype == np.float32):
        x = sp.csr_matrix(x, dtype=np.float32)
    norms = row_norms(x)
    if np.all((np.abs(norms - 1) <= 1e-4) | (norms == 0)):
        return sp.csr_matrix(x)
    return sp.csr_matrix(normalize(x, norm="l2", axis=1), dtype=np.float32)


def balanced_clusters(
    label_feats: sp.csr_matrix, num_clusters: int, seed: int = 0, max_iter: int = 20, tol: float = 1e-5,
    threads: int = 0,
) -> np.ndarray:
    """Recursive balanced 2-means down to num_clusters leaves (AttentionXML / LightXML / PECOS style).

    label_feats: (L, F) csr label representations (rows are L2-normalised here, into a copy unless they
    already are; zero rows are fine).
    num_clusters: K, a power of two with K <= L.
    max_iter, tol: per split, at most max_iter assignments; it stops earlier when the assignment no longer
    changes or the mean cosine of the rows to their centroids gains less than tol.
    threads: worker processes (forked, sharing label_feats copy-on-write); 0 means one per available core,
    or none for small inputs. The result does not depend on it.
    Every node splits into halves of sizes n//2 and n - n//2 and all leaves sit at depth log2(K), so every
    cluster has floor(L/K) or ceil(L/K) labels. Leaf i of the last level is cluster i (children of node i
    are 2i and 2i+1), so cluster ids follow the tree.
    Each split is spherical 2-means with a balanced cut, started from the node's principal direction (see
    _principal_direction). Sparse throughout: a node's centroids are dense over the columns its rows use
    only. Memory beyond label_feats: at most about one more copy of it (the first levels' tasks), then a
    subtree's rows per worker.
    Returns (L,) int64 label -> cluster id in [0, K); deterministic for a given seed.
    """
    num_labels = label_feats.shape[0]
    if num_clusters < 1 or num_clusters & (num_clusters - 1):
        lower = 1 << max(0, int(num_clusters).bit_length() - 1)
        raise XmcError(
            f"num_clusters={num_clusters} is not a power of two; use {lower} or {lower * 2}"
        )
    if num_clusters > num_labels:
        raise XmcError(
            f"num_clusters={num_clusters} is larger than the number of labels ({num_labels}); "
            "use a larger cluster size or fewer clusters"
        )
    if max_iter < 1:
        raise XmcError(f"max_iter={max_iter} must be >= 1")
    if threads < 0:
        raise XmcError(f"threads={threads} must be >= 0 (0 means one per available core)")
    if num_clusters == 1:
        return np.zeros(num_labels, dtype=np.int64)
    tree = _LabelTree(_unit_rows(label_feats), num_clusters, seed, max_iter, tol)
    workers = threads or (_available_cores() if tree.x.nnz >= _MIN_NNZ_FOR_WORKERS else 1)
    workers = min(workers, tree.num_subtree_tasks())
    if workers > 1 and _fork_available():
        order = _cluster_in_workers(tree, workers)
    else:
        order = np.arange(num_labels, dtype=np.int64)
        with progress_bar("clustering labels", total=num_clusters - 1) as advance:
            for task in tree.tasks():
                tree.run_task(task, order, advance)
    return tree.leaf_assignment(order)


def _cluster_in_workers(tree: _LabelTree, workers: int) -> np.ndarray:
    """Run the tree's tasks in `workers` forked processes; returns the tree order (L,) int64.

    The tree order and the task states live in shared memory; the workers only read the label features.
    """
    num_labels = tree.x.shape[0]
    num_slots = 1 + len(tree.tasks())  # task states by node id; slot 0 unused
    shared = mmap.mmap(-1, 8 * (num_labels + num_slots))
    try:
        order = np.frombuffer(shared, dtype=np.int64, count=num_labels)
        states = np.frombuffer(shared, dtype=np.int64, count=num_slots, offset=8 * num_labels)
        order[:] = np.arange(num_labels)
        states[:] = _PENDING
        condition = multiprocessing.get_context("fork").Condition()

        def work(worker: int, advance) -> None:
            _claim_and_run_tasks(tree, order, states, condition, advance)

        _run_forked(workers, work, "clustering labels", (1 << tree.depth) - 1)
        if not np.all(states[1:] == _DONE):
            raise RuntimeError("clustering workers exited with tasks left undone")
        return order.copy()
    finally:
        order = states = None  # views of the shared memory must go before it closes
        shared.close()


def _claim_and_run_tasks(tree: _LabelTree, order: np.ndarray, states: np.ndarray, condition, advance) -> None:
    """A worker's loop: claim a ready task (pending, its parent done), lowest node first, until none is left."""
    parent = os.getppid()
    while True:
        with condition:
            while True:
                ready = [node for node in tree.tasks()
                         if states[node] == _PENDING and (node == 1 or states[node >> 1] == _DONE)]
                if ready:
                    task = ready[0]
                    states[task] = _RUNNING
                    break
                if not np.any(states[1:] == _PENDING) or os.getppid() != parent:
                    return
                condition.wait(timeout=1.0)
        tree.run_task(task, order, advance)
        with condition:
            states[task] = _DONE
            condition.notify_all()


# --------------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------------


def _fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _run_forked(workers: int, work, description: str, total: int) -> None:
    """Run work(worker, advance) in `workers` forked processes, with a progress bar of `total` steps that
    counts what they pass to advance(n). When one fails, the others are ended and one line names the
    stage (`description`) and the cause. Forked, the workers inherit the parent's arrays without a copy and
    nothing is pickled; they must use numpy and scipy only (no threads, and no locks that the parent may
    have held when it forked)."""
    counters_memory = mmap.mmap(-1, 8 * workers)
    errors_memory = mmap.mmap(-1, _ERROR_BYTES * workers)   # each worker's one-line cause, if it fails
    counters = np.frombuffer(counters_memory, dtype=np.int64, count=workers)
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_forked_main,
                                 args=(work, worker, counters[worker:worker + 1], errors_memory),
                                 name=f"xmcbench-{worker}", daemon=True) for worker in range(workers)]
    try:
        # Started before the progress bar opens: no display thread of ours runs while the process forks.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for process in processes:
                process.start()
        with progress_bar(description, total=total) as advance:
            shown = 0
            while True:
                done = int(counters.sum())
                advance(done - shown)
                shown = done
                _raise_if_failed(processes, description, errors_memory)
                running = [process.sentinel for process in processes if process.exitcode is None]
                if not running:
                    _raise_if_failed(processes, description, errors_memory)   # one may have failed last
                    break
                multiprocessing.connection.wait(running, timeout=0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
        counters = None  # a view of the shared memory must go before it closes
        counters_memory.close()
        errors_memory.close()


_ERROR_BYTES = 1024
_WORKER_FAILED = 3   # the exit code of a worker that recorded its error


def _forked_main(work, worker: int, counter: np.ndarray, errors_memory: mmap.mmap) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the workers

    def advance(n: int = 1) -> None:
        counter[0] += n

    try:
        work(worker, advance)
    except BaseException as error:  # noqa: BLE001 -- reported by the parent in one line, not a traceback
        cause = error_line(error).encode("utf-8", "replace")[:_ERROR_BYTES]
        errors_memory[worker * _ERROR_BYTES:worker * _ERROR_BYTES + len(cause)] = cause
        os._exit(_WORKER_FAILED)


def _raise_if_failed(processes, description: str, errors_memory: mmap.mmap) -> None:
    for worker, process in enumerate(processes):
        code = process.exitcode
        if code is not None and code < 0:
            raise XmcError(
                f"{description}: worker process {worker} of {len(processes)} was killed by signal {-code} (the "
                f"system may be out of memory); use fewer threads or a machine with more memory"
            )
        if code:
            recorded = errors_memory[worker * _ERROR_BYTES:(worker + 1) * _ERROR_BYTES].rstrip(b"\0")
            cause = recorded.decode("utf-8", "replace") or f"it exited with code {code}"
            raise XmcError(f"{description}: worker process {worker} of {len(processes)} failed: {cause}")


def num_clusters_for(num_labels: int, cluster_size: int) -> int:
    """Number of clusters K for a target cluster size s.

    Smallest power of two K with ceil(num_labels / K) <= s (1 when num_labels <= s). s = 1 means a flat
    model with one label per cluster: returns num_labels (not necessarily a power of two); callers then use
    the identity label -> cluster mapping.
    """
    if cluster_size < 1:
        raise XmcError(f"cluster_size={cluster_size} must be >= 1 (1 means one label per cluster)")
    if num_labels < 1:
        raise XmcError(f"num_labels={num_labels}: the dataset has no labels; check the label files")
    if cluster_size == 1:
        return num_labels
    k = 1
    while -(-num_labels // k) > cluster_size:  # integer ceil, exact for huge label counts
        k *= 2
    return k


def cluster_members(label_to_cluster: np.ndarray, num_clusters: int) -> list[np.ndarray]:
    """Inverse of a label -> cluster mapping.

    label_to_cluster: (L,) ints in [0, K).
    Returns K int64 arrays of label ids, each sorted ascending (empty for clusters with no label).
    """
    l2c = np.asarray(label_to_cluster, dtype=np.int64)
    if l2c.size and (l2c.min() < 0 or l2c.max() >= num_clusters):
        raise ValueError(f"cluster ids must lie in [0, {num_clusters}), got [{l2c.min()}, {l2c.max()}]")
    # A stable sort keeps label ids ascending within each cluster, in O(L log L) rather than O(L K).
    order = np.argsort(l2c, kind="stable")
    counts = np.bincount(l2c, minlength=num_clusters)
    return np.split(order, np.cumsum(counts)[:-1])
