"""The balanced label tree of LightXML / AttentionXML / PECOS: recursive balanced 2-means on label features.

LightXML groups labels into K clusters of near-equal size; its "meta" classifier first predicts clusters,
then ranks the labels inside the top clusters. The clusters come from recursive balanced 2-means on label
representations (xmcbench.features.label_features). It is the built-in label indexer, "balanced-2means"
(xmcbench.indexing), sparse throughout and run at the scale of Wiki-500K and Amazon-670K
(benchmarks/clustering_vs_pecos.py compares it with PECOS's).

Shapes: L labels, F features, K clusters.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os

import numpy as np
import scipy.sparse as sp

from xmcbench.errors import XmcError
from xmcbench.features import unit_rows
from xmcbench.progress import progress_bar
from xmcbench.workers import available_cores, fork_available, run_forked

__all__ = ["balanced_clusters"]

# Part of the label clusters' cache key (xmcbench.indexing): change it whenever balanced_clusters gives other
# clusters for the same inputs and seed.
ALGORITHM_VERSION = "balanced-2means-random-start-2"

# The label tree is numbered heap-style: the root is node 1 and node h has children 2h and 2h + 1, so node h
# sits at depth h.bit_length() - 1 and leaf k (of K = 2^D) is node K + k. The clustering runs as tasks fixed
# by (L, K) alone: every node above depth _TASK_DEPTH is a task of one split, and every node at that depth
# is a task that splits its whole subtree, its rows moving from parent to children in memory. A task starts
# from its labels' rows of the full label-feature matrix and each node draws its own random numbers, so the
# result does not depend on how many worker processes share the tasks (or in which order they run them).
_TASK_DEPTH = 5  # 32 subtree tasks: enough to balance a handful of workers
_MIN_NNZ_FOR_WORKERS = 1_000_000  # below this, forking costs more than it saves (when threads is automatic)
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
    tree = _LabelTree(unit_rows(label_feats), num_clusters, seed, max_iter, tol)
    workers = threads or (available_cores() if tree.x.nnz >= _MIN_NNZ_FOR_WORKERS else 1)
    workers = min(workers, tree.num_subtree_tasks())
    if workers > 1 and fork_available():
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

        run_forked(workers, work, "clustering labels", (1 << tree.depth) - 1)
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
