"""Label features and balanced label clustering (the label tree of LightXML / AttentionXML / PECOS).

LightXML groups labels into K clusters of near-equal size; its "meta" classifier first predicts clusters,
then ranks the labels inside the top clusters. The clusters come from recursive balanced 2-means on label
representations, where a label is represented by the L2-normalised sum of the TF-IDF / BoW feature rows
of its training documents.

Shapes: N documents, F features, L labels, K clusters.
"""

from __future__ import annotations

import contextlib
import lzma
import io
import math
from pathlib import Path
from typing import Iterable

import numpy as np
import scipy.sparse as sp
from sklearn.datasets import load_svmlight_file
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.preprocessing import normalize

from xmcbench.data import open_binary
from xmcbench.errors import XmcError

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


def _parse_header(line: str) -> tuple[int, int, int] | None:
    """'N D L' of an Extreme Classification Repository BoW file, or None when the line is a data line."""
    parts = line.split()
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    n, d, l = (int(p) for p in parts)
    return n, d, l


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
            first = fh.readline()
            header = _parse_header(first)
            if header is not None:
                n_header, d_header, _ = header
                x, rows = _parse_lines(fh, path, first_lineno=2, num_features=d_header, skip_blank=False)
                if rows != n_header:
                    raise XmcError(
                        f"{path}: header line 1 says {n_header} documents but the file has {rows} data lines; "
                        "fix the header or re-export the file"
                    )
        if header is None:
            x = _read_svmlight(path)
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


def label_features(doc_features: sp.csr_matrix, labels: sp.csr_matrix) -> sp.csr_matrix:
    """Label representation: row l = L2-normalised sum of the feature rows of the documents carrying label l.

    doc_features: (N, F); labels: (N, L) 0/1 csr.
    Returns (L, F) csr float32; labels with no document get an all-zero row.
    """
    if doc_features.shape[0] != labels.shape[0]:
        raise ValueError(
            f"doc_features has {doc_features.shape[0]} rows but labels has {labels.shape[0]}; they must match"
        )
    y = sp.csr_matrix(labels, dtype=np.float32, copy=True)
    y.eliminate_zeros()
    y.data[:] = 1.0  # a label counts once per document even if stored with another weight
    x = sp.csr_matrix(doc_features, dtype=np.float32)
    feats = sp.csr_matrix(y.T @ x, dtype=np.float32)
    feats = normalize(feats, norm="l2", axis=1, copy=False)
    feats = sp.csr_matrix(feats, dtype=np.float32)
    feats.sort_indices()
    return feats


def _balanced_split(
    x: sp.csr_matrix, rng: np.random.Generator, max_iter: int, tol: float
) -> np.ndarray:
    """One balanced spherical 2-means split.

    x: (n, F) csr with L2-normalised (or zero) rows, n >= 2.
    Returns (n,) bool, True for the n//2 rows of cluster 0.
    """
    n = x.shape[0]
    half = n // 2
    seeds = rng.choice(n, size=2, replace=False)
    centroids = np.asarray(x[seeds].toarray().T, dtype=np.float32)  # (F, 2)
    in_first = np.zeros(n, dtype=bool)
    old_objective = -np.inf
    for _ in range(max_iter):
        sims = np.asarray(x @ centroids)  # (n, 2) cosines, rows and centroids being unit (or zero)
        # Ranking by the similarity difference, then cutting at n//2, is what keeps the split balanced.
        order = np.argsort(sims[:, 1] - sims[:, 0], kind="stable")
        in_first = np.zeros(n, dtype=bool)
        in_first[order[:half]] = True
        objective = (sims[in_first, 0].sum() + sims[~in_first, 1].sum()) / n
        if objective - old_objective < tol:
            break
        old_objective = objective
        for c, members in enumerate((in_first, ~in_first)):
            centre = np.asarray(x[members].mean(axis=0)).ravel()
            norm = np.linalg.norm(centre)
            # members that are all zero rows give a zero centroid: it scores 0 against everyone, which is fine
            centroids[:, c] = centre / norm if norm > 0 else 0.0
    return in_first


def balanced_clusters(
    label_feats: sp.csr_matrix, num_clusters: int, seed: int = 0, max_iter: int = 20, tol: float = 1e-4
) -> np.ndarray:
    """Recursive balanced 2-means down to num_clusters leaves (AttentionXML / LightXML / PECOS style).

    label_feats: (L, F) csr label representations (rows are L2-normalised here; zero rows are fine).
    num_clusters: K, a power of two with K <= L.
    Every node splits into halves of sizes n//2 and n - n//2 and all leaves sit at depth log2(K), so every
    cluster has floor(L/K) or ceil(L/K) labels. Leaf i of the last level is cluster i (children of node i
    are 2i and 2i+1), so cluster ids follow the tree.
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
    x = normalize(sp.csr_matrix(label_feats, dtype=np.float32), norm="l2", axis=1)
    x = sp.csr_matrix(x, dtype=np.float32)
    rng = np.random.default_rng(seed)

    # Level by level: each entry is the (sorted) label ids of one node, in tree order.
    nodes = [np.arange(num_labels, dtype=np.int64)]
    while len(nodes) < num_clusters:
        next_nodes = []
        for members in nodes:
            in_first = _balanced_split(x[members], rng, max_iter, tol)
            next_nodes.append(members[in_first])
            next_nodes.append(members[~in_first])
        nodes = next_nodes

    label_to_cluster = np.empty(num_labels, dtype=np.int64)
    for cluster_id, members in enumerate(nodes):
        label_to_cluster[members] = cluster_id
    return label_to_cluster


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
