"""Ranking metrics for extreme multi-label classification: P@k, nDCG@k, PSP@k, PSnDCG@k, R@k, PSR@k, coverage,
and where P@k and PSP@k come from: their split over bins of training label frequency (head vs tail).

Definitions follow pyxclib and the Extreme Classification Repository, so numbers are comparable with
published tables. Everything works on a (N, K) array of predicted label ids and a sparse (N, L) truth
matrix; nothing dense of shape (N, L) is ever built, so N = 1e5 documents and L = 5e5 labels are fine.

The @k metrics come in families (MetricFamily: P is P@1, P@3, ...), each computed from one Ranking. xmcbench's
own are BUILTIN_FAMILIES, which its built-in plugin registers; a plugin adds one through the
xmcbench_register_metrics hook, and evaluate, format_metrics and selection_metrics take a registry's
`metric_families()` as `families` (the built-in ones when none are given).

Frequency bins (FREQUENCY_BINS), by the number of training documents of a label:
0 | 1 | 2-3 | 4-10 | 11-30 | 31-100 | 101-300 | 301-1000 | >1000.
XMC label frequencies follow a power law, so the bins are half-decades (each about sqrt(10) times the
last) on that log scale; "1" is the one-shot tail on its own and "0" holds the labels no training document
has: test-only labels, which no model can predict, so that bin shows the share of test positives lost
beforehand (and, in a run on part of the training set, labels whose documents were all left out). The edges are fixed rather than deciles of the labels, for two reasons: deciles collapse
when half the labels are seen once (debian-builddeps: 48 % of its 20,813 labels), and fixed edges cut
every method, seed and dataset the same way, so their contributions line up in one table.
"""

from __future__ import annotations

import functools
import numbers
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse

from xmcbench.errors import XmcError

__all__ = ["propensity_scores", "top_k", "evaluate", "relevant", "format_metrics", "FREQUENCY_BINS",
           "frequency_bin_names", "frequency_bin_of", "MetricFamily", "Ranking", "BUILTIN_FAMILIES",
           "selection_metrics", "metric_order", "parse_at_k"]

# (fewest, most) training documents of the labels in a bin; None: no upper end. See the module docstring.
FREQUENCY_BINS = ((0, 0), (1, 1), (2, 3), (4, 10), (11, 30), (31, 100), (101, 300), (301, 1000), (1001, None))


def propensity_scores(label_counts: np.ndarray, num_train_docs: int, a: float = 0.55, b: float = 1.5) -> np.ndarray:
    """Jain et al. (2016) propensity p_l = 1 / (1 + C * exp(-A * log(N_l + B))), C = (log N - 1) * (B + 1) ** A.

    label_counts: (L,) training documents per label (0 allowed, e.g. test labels unseen in training).
    num_train_docs: N, the number of training documents.
    Returns (L,) float64 propensities in (0, 1); the PSP weights are their inverses, 1 / p.
    Typical (a, b): (0.55, 1.5) in general, (0.5, 0.4) for Wikipedia, (0.6, 2.6) for Amazon datasets.
    """
    counts = np.asarray(label_counts)
    if counts.ndim != 1:
        raise XmcError(f"label_counts must be a 1-D (L,) array, got shape {counts.shape}")
    counts = counts.astype(np.float64)
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise XmcError("label_counts must be finite and non-negative")
    # log N - 1 must be positive or C flips sign and the "propensities" leave (0, 1).
    if num_train_docs < 3:
        raise XmcError(f"num_train_docs must be at least 3 for the propensity model, got {num_train_docs}")
    if b <= 0:
        raise XmcError(f"propensity parameter b must be positive (labels with 0 counts need log(0 + b)), got {b}")
    c = (np.log(num_train_docs) - 1.0) * (b + 1.0) ** a
    return 1.0 / (1.0 + c * np.power(counts + b, -a))


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """(N, L) dense scores -> (N, k) label ids sorted by descending score (ties: lower id first).

    Cost is a partition plus a sort of the few candidates per row, not a full (N, L) sort.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise XmcError(f"scores must be a 2-D (N, L) array, got shape {scores.shape}")
    num_docs, num_labels = scores.shape
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= num_labels:
        raise XmcError(f"k must be an integer in [1, {num_labels}] (the number of labels), got {k!r}")
    k = int(k)
    if not np.issubdtype(scores.dtype, np.floating):
        # Negating unsigned or bool scores below would wrap around or fail.
        scores = scores.astype(np.float64)
    if np.isnan(scores).any():
        raise XmcError("scores contain NaN; a model produced invalid scores")
    if num_docs == 0:
        return np.empty((0, k), dtype=np.int64)

    # argpartition alone would break ties at the k-th place arbitrarily, so take every label scoring at
    # least the k-th largest value (>= k per row) and order those exactly by (-score, id).
    kth_largest = np.partition(scores, num_labels - k, axis=1)[:, num_labels - k]  # (N,)
    rows, cols = np.nonzero(scores >= kth_largest[:, None])
    order = np.lexsort((cols, -scores[rows, cols], rows))
    rows, cols = rows[order], cols[order]
    per_row = np.bincount(rows, minlength=num_docs)
    rank = np.arange(rows.size) - (np.cumsum(per_row) - per_row)[rows]
    return cols[rank < k].reshape(num_docs, k).astype(np.int64, copy=False)


def _check_ks(ks: Iterable[int]) -> list[int]:
    try:
        ks = list(ks)
    except TypeError:
        raise XmcError(f"ks must be a sequence of positive integers, got {ks!r}") from None
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise XmcError(f"ks must be a non-empty sequence of positive integers, got {ks!r}")
    return sorted({int(k) for k in ks})


def _binary_csr(matrix, name: str) -> scipy.sparse.csr_matrix:
    """Canonical csr copy (sorted, no duplicates, no explicit zeros) with every stored value set to 1."""
    if not scipy.sparse.issparse(matrix):
        raise XmcError(f"{name} must be a scipy.sparse matrix, got {type(matrix).__name__}")
    # Copy: sum_duplicates / eliminate_zeros work in place and the caller's matrix must stay untouched.
    out = scipy.sparse.csr_matrix(matrix, copy=True)
    out.sum_duplicates()
    out.eliminate_zeros()
    out.data = np.ones_like(out.data, dtype=np.float64)
    return out


def _gather_hits(predicted: np.ndarray, truth: scipy.sparse.csr_matrix) -> np.ndarray:
    """(N, K) ids (-1 allowed) and canonical (N, L) csr -> (N, K) bool, True where the id is relevant."""
    num_docs, num_labels = truth.shape
    if truth.nnz == 0:
        return np.zeros(predicted.shape, dtype=bool)
    # A canonical csr lists (row, col) pairs in row-major order, so row * L + col is a sorted key array
    # that one searchsorted can probe for all N * K predictions at once.
    entry_rows = np.repeat(np.arange(num_docs, dtype=np.int64), np.diff(truth.indptr))
    truth_keys = entry_rows * num_labels + truth.indices.astype(np.int64)
    query = np.arange(num_docs, dtype=np.int64)[:, None] * num_labels + predicted
    pos = np.minimum(np.searchsorted(truth_keys, query), truth_keys.size - 1)
    # An id of -1 forms the key of (row - 1, L - 1), which may exist, so empty slots are masked explicitly.
    return (predicted >= 0) & (truth_keys[pos] == query)


def relevant(predicted: np.ndarray, truth) -> np.ndarray:
    """(N, K) label ids (-1 for an empty slot) and (N, L) sparse truth -> (N, K) bool, True where the id is one of
    its document's relevant labels: the hits every metric here counts."""
    return _gather_hits(np.asarray(predicted, dtype=np.int64), _binary_csr(truth, "truth"))


def _ideal_sums(truth: scipy.sparse.csr_matrix, weights: np.ndarray, ks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The ideal ranking's sums: each doc's relevant labels by descending weight, the best min(k, n_relevant).

    truth: canonical (N, L) csr; weights: (L,); ks: sorted cut-offs. Returns (N, len(ks)) twice: the sum of
    the best weights, and their discounted sum (weight / log2(rank + 1), rank from 1). Works on the nnz
    entries only, so no (N, max(ks)) array is built.
    """
    num_docs = truth.shape[0]
    entry_rows = np.repeat(np.arange(num_docs, dtype=np.int64), np.diff(truth.indptr))
    entry_weights = weights[truth.indices]
    order = np.lexsort((-entry_weights, entry_rows))
    entry_weights = entry_weights[order]
    rank = np.arange(entry_rows.size) - truth.indptr[entry_rows]          # 0-based rank inside its doc
    # prefix[e]: sum of the first e sorted entries over the whole matrix; a doc's best m are then
    # prefix[start + m] - prefix[start].
    prefix = np.concatenate(([0.0], np.cumsum(entry_weights)))
    discounted = np.concatenate(([0.0], np.cumsum(entry_weights / np.log2(rank + 2.0))))
    start = truth.indptr[:-1].astype(np.int64)                              # (N,)
    best = np.minimum(np.diff(truth.indptr)[:, None], np.asarray(ks)[None, :])   # (N, len(ks))
    ends = start[:, None] + best
    return prefix[ends] - prefix[start][:, None], discounted[ends] - discounted[start][:, None]


def _safe_ratio(numerator: float, denominator: float) -> float:
    return float(100.0 * numerator / denominator) if denominator > 0 else 0.0


def frequency_bin_names() -> list[str]:
    """The bins' names, in order: "0", "1", "2-3", ..., "301-1000", ">1000"."""
    names = []
    for low, high in FREQUENCY_BINS:
        names.append(f">{low - 1}" if high is None else str(low) if low == high else f"{low}-{high}")
    return names


def frequency_bin_of(counts: np.ndarray) -> np.ndarray:
    """(L,) training documents per label -> (L,) int64, the index of its FREQUENCY_BINS bin."""
    upper_ends = np.array([np.inf if high is None else high for _, high in FREQUENCY_BINS])
    return np.searchsorted(upper_ends, np.asarray(counts), side="left")


def _frequency_bins(predicted: np.ndarray, hits: np.ndarray, truth: scipy.sparse.csr_matrix,
                    label_counts: np.ndarray, k: int, gains: np.ndarray | None, ideal_total: float) -> dict:
    """P@k (and PSP@k) split over the bins of training label frequency; see evaluate()."""
    num_docs, num_labels = truth.shape
    counts = np.asarray(label_counts)
    if counts.shape != (num_labels,):
        raise XmcError(f"label_counts has shape {counts.shape} but truth has {num_labels} columns; "
                       f"expected ({num_labels},)")
    counts = counts.astype(np.float64)
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise XmcError("label_counts must be finite and non-negative")
    label_bin = frequency_bin_of(counts)                                  # (L,) bin index of every label
    num_bins = len(FREQUENCY_BINS)
    labels_per_bin = np.bincount(label_bin, minlength=num_bins)
    positives_per_bin = np.bincount(label_bin[truth.indices], minlength=num_bins)
    hit_bin = label_bin[np.maximum(predicted[:, :k], 0)][hits[:, :k]]  # (hits,) bin of every correct prediction
    hits_per_bin = np.bincount(hit_bin, minlength=num_bins)
    if gains is not None:
        gain_per_bin = np.bincount(label_bin[np.maximum(predicted[:, :k], 0)].ravel(),
                                   weights=gains[:, :k].ravel(), minlength=num_bins)
    bins = []
    for index, (name, (low, high)) in enumerate(zip(frequency_bin_names(), FREQUENCY_BINS)):
        entry = {"bin": name, "min_count": low, "max_count": high, "labels": int(labels_per_bin[index]),
                 "label_share": _safe_ratio(labels_per_bin[index], num_labels),
                 "test_positive_share": _safe_ratio(positives_per_bin[index], truth.nnz),
                 f"P@{k}_contribution": float(100.0 * hits_per_bin[index] / (k * num_docs))}
        if gains is not None:
            entry[f"PSP@{k}_contribution"] = _safe_ratio(gain_per_bin[index], ideal_total)
        bins.append(entry)
    return {"k": k, "bins": bins}


def evaluate(
    predicted: np.ndarray,
    truth: scipy.sparse.csr_matrix,
    ks=(1, 3, 5),
    inv_propensity: np.ndarray | None = None,
    recalled_truth: scipy.sparse.csr_matrix | None = None,
    label_counts: np.ndarray | None = None,
    zero_shot: np.ndarray | None = None,
    families: Sequence[MetricFamily] | None = None,
) -> dict:
    """Score a top-K prediction against sparse ground truth; all values are percentages in [0, 100].

    predicted: (N, K) int label ids, best first, K >= max(ks); -1 marks an empty slot (a miss). Ids
        index the columns of truth. Rows should not repeat an id (that is the caller's business).
    truth: (N, L_total) sparse, nonzero = relevant. L_total may exceed the largest predictable id: test
        labels unseen in training live in extra columns, can never be hit, and so lower nDCG and recall.
    ks: cut-offs k; each gives P@k, nDCG@k and R@k (plus PSP@k, PSnDCG@k and PSR@k when inv_propensity is
        given). Large k (R@100) is cheap: sums are taken only at the cut-offs asked for.
    inv_propensity: (L_total,) weights 1 / p_l (see propensity_scores).
    recalled_truth: (N, L_total) sparse marking the true labels that fell inside the recaller's
        shortlist; adds coverage = 100 * recalled positives / test positives.
    label_counts: (L_total,) training documents per label; adds "frequency_bins", the split of P@k (and
        PSP@k) over FREQUENCY_BINS at k = 5 when 5 is in ks, else at k = max(ks) (below).
    zero_shot: (L_total,) bool, True for the labels no training document of the model carried; adds "zero_shot"
        when some test positive has such a label (below).
    families: the metric families to compute, in the order of their keys in the result (a registry's
        `metric_families()`); None: BUILTIN_FAMILIES, the ones defined below. A family that needs propensities
        is left out without inv_propensity.

    Definitions (as in pyxclib and the Extreme Classification Repository):
    - P@k: mean over all N docs of hits in the top k / k.
    - nDCG@k: DCG@k / IDCG@k with DCG@k = sum_{r<=k} rel_r / log2(r + 1) and IDCG@k the same for
      min(k, n_relevant) hits. Docs with no relevant labels score 0 and still count in the mean over N.
    - PSP@k: the normalised propensity-scored precision reported by the XC repository and pyxclib:
      sum over docs of the inverse propensities of the top-k hits / k, divided by the same for the ideal
      ranking (each doc's relevant labels by descending inverse propensity, best k).
    - PSnDCG@k: normalised likewise (pyxclib): per doc, the propensity-weighted DCG@k divided by the
      unit-gain IDCG@k; the mean of that over docs, divided by the same mean for the ideal ranking.
    - R@k: hits in the top k / relevant labels of the doc, averaged over docs with >= 1 relevant label
      (0.0 when no doc has any).
    - PSR@k: pyxclib's psrecall, the propensity-scored recall normalised by the ideal ranking. With w_l the
      inverse propensity, y_i the relevant labels of doc i, top_k(i) its predicted top k and best_k(i) its
      min(k, |y_i|) relevant labels of largest w:
          PSR@k = [sum_i (sum_{l in top_k(i) & y_i} w_l) / max(|y_i|, 1)]
                  / [sum_i (sum_{l in best_k(i)} w_l) / max(|y_i|, 1)].
      For k >= |y_i| the ideal term of doc i is the sum of w over all its relevant labels, so PSR@k is then
      the propensity-weighted share of each doc's relevant labels found. Docs without labels add 0 to both.
    - coverage: 0.0 when truth holds no positives.
    - frequency_bins: {"k": k, "bins": [one dict per FREQUENCY_BINS entry, in order]}, each bin with
      "bin" (its name, e.g. "2-3"), "min_count", "max_count" (None: no upper end), "labels" (how many),
      "label_share" (100 * its labels / L_total), "test_positive_share" (100 * truth positives whose label is
      in it / all positives), "P@k_contribution" = 100 * (hits in the top k whose label is in the bin) /
      (k * N), and with inv_propensity "PSP@k_contribution" = 100 * (those hits' inverse propensities) /
      (the ideal ranking's, as in PSP@k). The contributions of the bins sum to P@k and to PSP@k (pyxclib's
      and the XMC literature's "contribution by label frequency").
    - zero_shot: {"labels": zero-shot labels among the test positives, "documents": test documents with at least
      one, "positives": their zero-shot positives, and per k "P@k" (mean over those documents of the zero-shot
      labels among the top k / k) and "R@k" (mean over them of the zero-shot positives found in the top k / their
      zero-shot positives)}: the generalised zero-shot figures, every label competing with every other. A method
      that cannot score a label without training documents scores 0 there.
    Returns a dict with keys 'P@k', 'nDCG@k', ['PSP@k', 'PSnDCG@k'], 'R@k', ['PSR@k'] (with families given: each
    family's keys, family by family), ['coverage'], ['frequency_bins'], ['zero_shot'];
    every value but frequency_bins and zero_shot is a float.
    """
    ks = _check_ks(ks)
    truth = _binary_csr(truth, "truth")
    predicted = np.asarray(predicted)
    if predicted.ndim != 2:
        raise XmcError(f"predicted must be a 2-D (N, K) array of label ids, got shape {predicted.shape}")
    if predicted.shape[0] != truth.shape[0]:
        raise XmcError(f"predicted has shape {predicted.shape} but truth has shape {truth.shape}: row counts differ")
    num_docs, num_labels = truth.shape
    if num_docs == 0:
        raise XmcError("cannot evaluate an empty test set")
    if not np.issubdtype(predicted.dtype, np.integer):
        raise XmcError(f"predicted must hold integer label ids, got dtype {predicted.dtype}")
    k_max = ks[-1]
    if predicted.shape[1] < k_max:
        raise XmcError(f"predicted has {predicted.shape[1]} columns but ks asks for the top {k_max}")
    predicted = predicted[:, :k_max].astype(np.int64, copy=False)
    low, high = int(predicted.min()), int(predicted.max())
    if low < -1 or high >= num_labels:
        raise XmcError(f"predicted label ids must lie in [-1, {num_labels - 1}] (truth columns), got {low}..{high}")

    weights = None
    if inv_propensity is not None:
        weights = np.asarray(inv_propensity, dtype=np.float64)
        if weights.shape != (num_labels,):
            raise XmcError(f"inv_propensity has shape {weights.shape} but truth has {num_labels} columns; expected ({num_labels},)")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0):
            raise XmcError("inv_propensity must be finite and non-negative")

    ranking = Ranking(predicted, _gather_hits(predicted, truth), truth, ks, weights)
    metrics: dict = {}
    for family in BUILTIN_FAMILIES if families is None else families:
        if weights is not None or not family.needs_propensities:
            metrics.update(_values_of(family, ranking))

    bins_k = 5 if 5 in ks else k_max   # the head/tail split of P@5 (see FREQUENCY_BINS) when 5 is asked for
    gains = ideal_total = None
    if weights is not None:
        gains, ideal_total = ranking.gains, float(np.sum(ranking.ideal_at[:, ks.index(bins_k)]))

    if recalled_truth is not None:
        recalled = _binary_csr(recalled_truth, "recalled_truth")
        if recalled.shape != truth.shape:
            raise XmcError(f"recalled_truth has shape {recalled.shape} but truth has shape {truth.shape}")
        metrics["coverage"] = _safe_ratio(recalled.nnz, truth.nnz)
    if label_counts is not None:
        metrics["frequency_bins"] = _frequency_bins(predicted, ranking.hits, truth, label_counts, bins_k, gains,
                                                    ideal_total)
    if zero_shot is not None:
        figures = _zero_shot(predicted, ranking.hits, truth, np.asarray(zero_shot, dtype=bool), ks)
        if figures is not None:
            metrics["zero_shot"] = figures
    return metrics


def _zero_shot(predicted: np.ndarray, hits: np.ndarray, truth: scipy.sparse.csr_matrix, zero_shot: np.ndarray,
               ks: list[int]) -> dict | None:
    """evaluate's "zero_shot" figures; None when no test positive has a zero-shot label."""
    if zero_shot.shape != (truth.shape[1],):
        raise XmcError(f"zero_shot has shape {zero_shot.shape} but truth has {truth.shape[1]} columns")
    unseen_truth = truth.multiply(zero_shot[None, :]).tocsr()
    unseen_truth.eliminate_zeros()
    positives = np.diff(unseen_truth.indptr)                                   # (N,)
    documents = positives > 0
    if not documents.any():
        return None
    unseen_hits = hits & zero_shot[np.maximum(predicted, 0)] & (predicted >= 0)   # (N, k_max)
    found = np.cumsum(unseen_hits, axis=1)[documents]                         # (D, k_max)
    figures: dict = {"labels": int(np.unique(unseen_truth.indices).size), "documents": int(documents.sum()),
                     "positives": int(positives.sum())}
    for k in ks:
        figures[f"P@{k}"] = float(100.0 * np.mean(found[:, k - 1] / k))
    for k in ks:
        figures[f"R@{k}"] = float(100.0 * np.mean(found[:, k - 1] / positives[documents]))
    return figures


# -- metric families ------------------------------------------------------------------------------------

class Ranking:
    """What a metric family computes from (MetricFamily.compute): one evaluation's predictions and truth, and
    the sums the built-in families share, each computed once, on first use.

    predicted: (N, k_max) int64 label ids, best first, -1 for an empty slot; k_max = ks[-1].
    hits: (N, k_max) bool, True where the predicted label is relevant (never for -1).
    truth: (N, L) canonical csr, every stored value 1.
    ks: the cut-offs, ascending, without repeats.
    inv_propensity: (L,) float64 inverse propensities, or None (then no family that needs them is computed).
    num_relevant: (N,) relevant labels per document.
    discounts: (k_max,) the DCG discount 1 / log2(rank + 1) of each rank (from 1).
    hits_at, dcg_at: (N, len(ks)) per document, the hits and the DCG of the top k for each k in ks.
    gains, gain_at, psdcg_at: (N, k_max) inverse propensity of each hit (0 elsewhere); (N, len(ks)) their sums
        and their DCG at each k. ideal_at, ideal_psdcg_at: (N, len(ks)) the same for the ideal ranking (each
        document's relevant labels by descending inverse propensity). These need inv_propensity.
    """

    def __init__(self, predicted: np.ndarray, hits: np.ndarray, truth: scipy.sparse.csr_matrix, ks: list[int],
                 inv_propensity: np.ndarray | None) -> None:
        self.predicted, self.hits, self.truth, self.ks, self.inv_propensity = predicted, hits, truth, ks, inv_propensity
        self.num_relevant = np.diff(truth.indptr)
        self.discounts = 1.0 / np.log2(np.arange(2, ks[-1] + 2))
        # unit_idcg[j] = IDCG of a doc with j relevant labels at a cut-off >= j
        self._unit_idcg = np.concatenate(([0.0], np.cumsum(self.discounts)))   # (k_max + 1,)

    def at_ks(self, values: np.ndarray) -> np.ndarray:
        """(N, k_max) -> (N, len(ks)): per doc, the sum of the first k columns for each k in ks.

        Sums the column blocks between consecutive cut-offs and accumulates those, so a large k (R@100) costs
        no (N, k_max) cumulative array."""
        return np.cumsum(np.add.reduceat(values, [0] + self.ks[:-1], axis=1, dtype=np.float64), axis=1)

    def mean_ndcg(self, dcg: np.ndarray, k: int) -> float:
        """Mean over all N docs of dcg (N,) / the unit IDCG@k; docs without relevant labels count as 0."""
        norm = self._unit_idcg[np.minimum(self.num_relevant, k)]
        return float(np.mean(np.divide(dcg, norm, out=np.zeros(len(self.num_relevant)), where=norm > 0)))

    @functools.cached_property
    def hits_at(self) -> np.ndarray:
        return self.at_ks(self.hits)

    @functools.cached_property
    def dcg_at(self) -> np.ndarray:
        return self.at_ks(self.hits * self.discounts)

    def _weights(self) -> np.ndarray:
        if self.inv_propensity is None:
            raise XmcError("a metric family read the inverse propensities of an evaluation that has none; such a "
                           "family is a MetricFamily(..., needs_propensities=True)")
        return self.inv_propensity

    @functools.cached_property
    def gains(self) -> np.ndarray:
        return np.where(self.hits, self._weights()[np.maximum(self.predicted, 0)], 0.0)

    @functools.cached_property
    def gain_at(self) -> np.ndarray:
        return self.at_ks(self.gains)

    @functools.cached_property
    def psdcg_at(self) -> np.ndarray:
        return self.at_ks(self.gains * self.discounts)

    @functools.cached_property
    def _ideal(self) -> tuple[np.ndarray, np.ndarray]:
        return _ideal_sums(self.truth, self._weights(), self.ks)

    @property
    def ideal_at(self) -> np.ndarray:
        return self._ideal[0]

    @property
    def ideal_psdcg_at(self) -> np.ndarray:
        return self._ideal[1]


@dataclass(frozen=True)
class MetricFamily:
    """A family of metrics that evaluate() computes, e.g. P: P@1, P@3, ... A plugin registers one with
    `registry.add_metric_family` (hook xmcbench_register_metrics); BUILTIN_FAMILIES are xmcbench's own.

    name: the stem of its keys, NAME@K (letters, digits, _), or the key itself when not at_k.
    description: one line, for `xmcbench plugins`.
    compute: compute(ranking: Ranking) -> {key: number}, exactly the family's keys: NAME@K for each k in
        ranking.ks, or NAME alone.
    at_k: one value per cut-off k; else one value per evaluation.
    higher_is_better: reports mark the highest mean as best (else the lowest).
    needs_propensities: computed only when the evaluation has inverse propensities (PSP@k).
    selectable: NAME@1, NAME@3 and NAME@5 may be config.selection_metric, the validation metric that selects the
        epoch (an at_k family only).
    """

    name: str
    description: str
    compute: Callable[[Ranking], dict]
    at_k: bool = True
    higher_is_better: bool = True
    needs_propensities: bool = False
    selectable: bool = False

    def keys(self, ks: Sequence[int]) -> list[str]:
        """Its keys in evaluate()'s result, in order, at the cut-offs ks (ascending)."""
        return [f"{self.name}@{k}" for k in ks] if self.at_k else [self.name]


def _values_of(family: MetricFamily, ranking: Ranking) -> dict[str, float]:
    """family.compute(ranking) in the order of family.keys, each value a float; XmcError when it returns other keys."""
    values = family.compute(ranking)
    expected = family.keys(ranking.ks)
    if not isinstance(values, dict) or set(values) != set(expected):
        got = sorted(map(str, values)) if isinstance(values, dict) else type(values).__name__
        raise XmcError(f"metric family {family.name!r} returned {got}; it must return a dict of exactly "
                       f"{', '.join(expected)}")
    wrong = next((key for key in expected if not isinstance(values[key], numbers.Real)
                  or isinstance(values[key], bool)), None)
    if wrong is not None:
        raise XmcError(f"metric family {family.name!r} returned {values[wrong]!r} for {wrong}; give a number")
    return {key: float(values[key]) for key in expected}


# The built-in families; the definitions are evaluate()'s docstring.

def _precision(ranking: Ranking) -> dict[str, float]:
    return {f"P@{k}": float(100.0 * np.mean(ranking.hits_at[:, j] / k)) for j, k in enumerate(ranking.ks)}


def _ndcg(ranking: Ranking) -> dict[str, float]:
    return {f"nDCG@{k}": 100.0 * ranking.mean_ndcg(ranking.dcg_at[:, j], k) for j, k in enumerate(ranking.ks)}


def _psp(ranking: Ranking) -> dict[str, float]:
    # The 1/k and 1/N of the pyxclib form cancel in the ratio; kept for a one-to-one reading.
    return {f"PSP@{k}": _safe_ratio(np.mean(ranking.gain_at[:, j] / k), np.mean(ranking.ideal_at[:, j] / k))
            for j, k in enumerate(ranking.ks)}


def _psndcg(ranking: Ranking) -> dict[str, float]:
    return {f"PSnDCG@{k}": _safe_ratio(ranking.mean_ndcg(ranking.psdcg_at[:, j], k),
                                       ranking.mean_ndcg(ranking.ideal_psdcg_at[:, j], k))
            for j, k in enumerate(ranking.ks)}


def _recall(ranking: Ranking) -> dict[str, float]:
    has_labels = ranking.num_relevant > 0
    values = {}
    for j, k in enumerate(ranking.ks):
        recall = ranking.hits_at[has_labels, j] / ranking.num_relevant[has_labels]
        values[f"R@{k}"] = float(100.0 * np.mean(recall)) if recall.size else 0.0
    return values


def _psrecall(ranking: Ranking) -> dict[str, float]:
    denominator = np.maximum(ranking.num_relevant, 1)   # (N,): 1 for docs without labels (their sums are 0)
    return {f"PSR@{k}": _safe_ratio(np.mean(ranking.gain_at[:, j] / denominator),
                                    np.mean(ranking.ideal_at[:, j] / denominator))
            for j, k in enumerate(ranking.ks)}


# In the order of evaluate()'s keys. The built-in plugin (plugins/xmcbench_metrics) registers these very objects.
BUILTIN_FAMILIES = (
    MetricFamily("P", "precision: hits in the top k / k, mean over documents", _precision, selectable=True),
    MetricFamily("nDCG", "normalised discounted cumulative gain of the top k", _ndcg, selectable=True),
    MetricFamily("PSP", "propensity-scored precision, normalised by the ideal ranking's", _psp,
                 needs_propensities=True, selectable=True),
    MetricFamily("PSnDCG", "propensity-scored nDCG, normalised by the ideal ranking's", _psndcg,
                 needs_propensities=True, selectable=True),
    MetricFamily("R", "recall: hits in the top k / relevant labels, mean over documents with labels", _recall,
                 selectable=True),
    MetricFamily("PSR", "propensity-scored recall, normalised by the ideal ranking's", _psrecall,
                 needs_propensities=True),
)
SELECTION_KS = (1, 3, 5)   # the cut-offs at which a selectable family may select the epoch
# evaluate()'s keys that no family makes: no family may be named so
OTHER_KEYS = ("coverage", "frequency_bins", "zero_shot")
_AT_K = re.compile(r"^(\w+)@(\d+)$")


def parse_at_k(key: str) -> tuple[str, int] | None:
    """("P", 5) for "P@5"; None for a key that is not NAME@K."""
    match = _AT_K.match(key)
    return (match.group(1), int(match.group(2))) if match else None


def selection_metrics(families: Sequence[MetricFamily] | None = None) -> tuple[str, ...]:
    """What config.selection_metric may name: NAME@k for k in SELECTION_KS of each selectable family, in family
    order (families: a registry's `metric_families()`; None: BUILTIN_FAMILIES)."""
    families = BUILTIN_FAMILIES if families is None else families
    return tuple(f"{family.name}@{k}" for family in families if family.selectable for k in SELECTION_KS)


def metric_order(families: Sequence[MetricFamily] | None = None) -> Callable[[str], tuple]:
    """A sort key for metric names: the families' keys, family by family (in the order given) and by ascending k;
    then coverage; then NAME@K keys of other families (a plugin's, read where its family is not at hand), by
    name and k; then any other key by name. families: a registry's `metric_families()`; None: BUILTIN_FAMILIES."""
    families = BUILTIN_FAMILIES if families is None else families
    position = {family.name: (index, family.at_k) for index, family in enumerate(families)}

    def order(key: str) -> tuple:
        parsed = parse_at_k(key)
        if parsed and position.get(parsed[0], (0, False))[1]:
            return (0, position[parsed[0]][0], parsed[1])
        if key in position and not position[key][1]:
            return (0, position[key][0], 0)
        if key == "coverage":
            return (1,)
        return (2, parsed[0], parsed[1]) if parsed else (3, key)

    return order


def format_metrics(metrics: dict, families: Sequence[MetricFamily] | None = None) -> str:
    """One-line human summary, e.g. 'P@1 82.31  P@3 55.10  P@5 40.02  nDCG@3 ...', in a fixed order, only keys present.

    Order: metric_order(families): P, nDCG, PSP, PSnDCG, R, PSR (each by ascending k) with families None, then
    coverage, then any other keys. Values that are not numbers (frequency_bins, names, flags) are left out.
    """
    metrics = {name: value for name, value in metrics.items()
               if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)}
    return "  ".join(f"{name} {metrics[name]:.2f}" for name in sorted(metrics, key=metric_order(families)))
