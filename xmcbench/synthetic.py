"""Synthetic XMC datasets at the shapes of the paper's large benchmarks, for benchmarks and scale tests.

Synthetic data measures speed, memory and scaling only: it never replaces the real datasets in accuracy
claims, and the cards written here say so.

The generator imitates the structure that makes real XMC data learnable:

- label frequencies follow a power law (label id = frequency rank, so ``L0`` is the most frequent), with a
  long tail of rare labels;
- labels are grouped into latent topics of about ``LABELS_PER_TOPIC`` labels; a document picks one topic
  (topics are as frequent as their labels) and draws most of its labels from it, so labels co-occur;
- features follow the labels: every label owns ``SIGNATURE_FEATURES`` signature features and every topic a
  pool of ``TOPIC_POOL_SIZE`` features; a document's features are its labels' signatures, draws from its
  topic's pool and Zipf-distributed background features (the stop words of a real vocabulary), weighted
  TF-IDF-like and L2-normalised.

Randomness is drawn per block of ``DOCS_PER_BLOCK`` documents from ``np.random.default_rng([seed, block])``,
so documents ``[a, b)`` are the same whether they come from one call or from many: datasets of any size are
written block by block in bounded memory. Test documents are the documents of the same stream from
``TEST_FIRST_DOC`` on: the same labels and features, other documents, whatever the number of train documents.

Shapes: N documents, L labels, F features, T topics.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import scipy.sparse as sp

from xmcbench.errors import XmcError
from xmcbench.progress import progress_bar
from xmcbench.storage import atomic_write, write_json

__all__ = [
    "SyntheticShape",
    "SHAPES",
    "get_shape",
    "generate_matrices",
    "iter_blocks",
    "label_names",
    "feature_texts",
    "write_dataset",
]


@dataclass(frozen=True)
class SyntheticShape:
    """The size of a synthetic dataset; the per-document figures are means."""

    name: str
    train_docs: int
    test_docs: int
    num_labels: int  # L
    num_features: int  # F
    labels_per_doc: float
    features_per_doc: float  # nonzeros of a sparse feature row
    words_per_doc: float  # words of a rendered text


# Documents, labels, features and labels/doc are the published statistics of the datasets (LightXML's Table 1);
# features_per_doc and words_per_doc are our choices, not the datasets' statistics.
SHAPES: dict[str, SyntheticShape] = {
    "amazon670k": SyntheticShape("amazon670k", train_docs=490_449, test_docs=153_025, num_labels=670_091,
                                 num_features=135_909, labels_per_doc=5.45, features_per_doc=75, words_per_doc=120),
    "wiki500k": SyntheticShape("wiki500k", train_docs=1_779_881, test_docs=769_421, num_labels=501_008,
                               num_features=2_381_304, labels_per_doc=4.77, features_per_doc=100, words_per_doc=200),
    "tiny": SyntheticShape("tiny", train_docs=400, test_docs=100, num_labels=100, num_features=500,
                           labels_per_doc=3.0, features_per_doc=30, words_per_doc=50),
}

GENERATOR = "xmcbench.synthetic"  # stats.json["generator"] of a folder write_dataset may overwrite
DOCS_PER_BLOCK = 8192
TEST_FIRST_DOC = 1 << 40  # test documents: this document of the stream onwards, far past any train set
_STRUCTURE_STREAM = 1 << 62  # rng key of the label/feature structure; block indices never reach it

LABEL_ZIPF_EXPONENT = 0.6  # label weight ∝ (rank+1)^-a: flat enough that most labels occur at the real sizes
FEATURE_ZIPF_EXPONENT = 1.0  # background features: word frequencies
LABELS_PER_TOPIC = 50
TOPIC_LABEL_SHARE = 0.8  # chance that a label draw comes from the document's topic, else from all labels
SIGNATURE_FEATURES = 3  # per label
SIGNATURE_COUNT = 2  # a signature feature counts as two occurrences: labels are what documents are about
TOPIC_POOL_SIZE = 64  # features per topic
TOPIC_FEATURE_SHARE = 0.25  # of features_per_doc
LENGTH_SIGMA = 0.5  # documents vary in length: feature draws scale with a lognormal factor of mean 1
VALUE_DECIMALS = 6  # of the values in train_v1.txt


def get_shape(name: str) -> SyntheticShape:
    if name not in SHAPES:
        raise XmcError(f"unknown synthetic shape '{name}'; choose one of: {', '.join(SHAPES)}")
    return SHAPES[name]


def label_names(num_labels: int) -> list[str]:
    """["L0", "L1", ...]: label id i is named L{i}; L0 is the most frequent label."""
    return [f"L{i}" for i in range(num_labels)]


# ---------------------------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class _Structure:
    """Everything the documents share, drawn once from the seed."""

    shape: SyntheticShape
    seed: int
    labels_by_topic: np.ndarray  # (L,) int32: label ids, topic after topic
    label_cdf: np.ndarray  # (L,) float64: cumulative label weights in labels_by_topic order
    topic_bounds: np.ndarray  # (T+1,) int64: topic t is labels_by_topic[topic_bounds[t]:topic_bounds[t+1]]
    topic_cdf_start: np.ndarray  # (T+1,) float64: label_cdf just before each topic, then the total
    signatures: np.ndarray  # (L, SIGNATURE_FEATURES) int32 feature ids
    topic_pools: np.ndarray  # (T, TOPIC_POOL_SIZE) int32 feature ids
    feature_cdf: np.ndarray  # (F,) float64: cumulative background weights, feature id = frequency rank
    idf: np.ndarray  # (F,) float32
    topic_draws: float  # mean draws per document from the topic pool
    background_draws: float  # mean background draws per document


def _expected_distinct(log_miss: np.ndarray, draws: float) -> float:
    """Expected distinct items among `draws` draws; log_miss[i] = log(1 - p_i)."""
    return float(np.sum(-np.expm1(draws * log_miss)))


def _draws_for_distinct(probabilities: np.ndarray, target: float) -> float:
    """Mean number of draws from `probabilities` that yields `target` distinct items on average."""
    if target <= 0:
        return 0.0
    log_miss = np.log1p(-np.minimum(probabilities, 1 - 1e-12))
    target = min(target, 0.95 * len(probabilities))
    low, high = 0.0, max(target, 1.0)
    while _expected_distinct(log_miss, high) < target:
        high *= 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if _expected_distinct(log_miss, middle) < target else (low, middle)
    return high


def _structure(shape: SyntheticShape, seed: int) -> _Structure:
    rng = np.random.default_rng([seed, _STRUCTURE_STREAM])
    num_labels, num_features = shape.num_labels, shape.num_features
    num_topics = max(1, num_labels // LABELS_PER_TOPIC)

    label_weights = np.arange(1, num_labels + 1, dtype=np.float64) ** -LABEL_ZIPF_EXPONENT
    labels_by_topic = rng.permutation(num_labels).astype(np.int32)
    label_cdf = np.cumsum(label_weights[labels_by_topic])
    topic_bounds = np.arange(num_topics + 1, dtype=np.int64) * num_labels // num_topics
    topic_cdf_start = np.concatenate([[0.0], label_cdf])[topic_bounds]

    # Signatures and pools avoid the most frequent 1% of features, which every document has anyway.
    first_rare = num_features // 100
    signatures = rng.integers(first_rare, num_features, (num_labels, SIGNATURE_FEATURES), dtype=np.int32)
    topic_pools = rng.integers(first_rare, num_features, (num_topics, TOPIC_POOL_SIZE), dtype=np.int32)

    feature_weights = np.arange(1, num_features + 1, dtype=np.float64) ** -FEATURE_ZIPF_EXPONENT
    feature_probabilities = feature_weights / feature_weights.sum()
    signature_target = SIGNATURE_FEATURES * shape.labels_per_doc
    topic_target = TOPIC_FEATURE_SHARE * shape.features_per_doc
    background_target = max(0.0, shape.features_per_doc - signature_target - topic_target)
    topic_draws = _draws_for_distinct(np.full(TOPIC_POOL_SIZE, 1 / TOPIC_POOL_SIZE), topic_target)
    background_draws = _draws_for_distinct(feature_probabilities, background_target)
    # idf from the chance that background draws put a feature in a document; capped so rare features tie
    document_frequency = -np.expm1(background_draws * np.log1p(-feature_probabilities))
    idf = (1 - np.log(np.maximum(document_frequency, 1e-4))).astype(np.float32)
    return _Structure(shape, seed, labels_by_topic, label_cdf, topic_bounds, topic_cdf_start, signatures,
                      topic_pools, np.cumsum(feature_weights), idf, topic_draws, background_draws)


# ---------------------------------------------------------------------------------------------- documents


def _sample_sorted(cdf: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Positions in `cdf` whose interval holds each target (inverse-CDF sampling)."""
    return np.minimum(np.searchsorted(cdf, targets, side="right"), len(cdf) - 1)


def _block_labels(s: _Structure, rng: np.random.Generator, n: int) -> tuple[np.ndarray, sp.csr_matrix]:
    """Topics (n,) and 0/1 labels (n, L) of one block."""
    shape = s.shape
    wanted = 1 + rng.poisson(max(shape.labels_per_doc - 1, 0.0), n)
    total = s.topic_cdf_start[-1]
    topics = np.minimum(np.searchsorted(s.topic_cdf_start[1:], rng.random(n) * total, side="right"),
                        len(s.topic_bounds) - 2)

    # Draw 2k+2 candidates per document with replacement, keep its first k distinct ones.
    candidates_per_doc = 2 * wanted + 2
    doc = np.repeat(np.arange(n), candidates_per_doc)
    topic = topics[doc]
    from_topic = rng.random(len(doc)) < TOPIC_LABEL_SHARE
    start, end = s.topic_cdf_start[topic], s.topic_cdf_start[topic + 1]
    uniform = rng.random(len(doc))
    targets = np.where(from_topic, start + uniform * (end - start), uniform * total)
    positions = _sample_sorted(s.label_cdf, targets)
    # float rounding at a topic's upper edge must not leak into the next topic
    positions = np.where(from_topic, np.minimum(positions, s.topic_bounds[topic + 1] - 1), positions)
    candidates = s.labels_by_topic[positions].astype(np.int64)

    order = np.argsort(doc * shape.num_labels + candidates, kind="stable")
    sorted_keys = (doc * shape.num_labels + candidates)[order]
    first = np.empty(len(doc), dtype=bool)
    first[order] = np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])
    distinct_rank = np.cumsum(first)
    doc_start = np.concatenate([[0], np.cumsum(candidates_per_doc)[:-1]])
    distinct_before_doc = distinct_rank[doc_start] - first[doc_start]
    keep = first & (distinct_rank - distinct_before_doc[doc] <= wanted[doc])

    kept_doc, kept_label = doc[keep], candidates[keep]
    labels = sp.csr_matrix((np.ones(len(kept_doc), dtype=np.float32), (kept_doc, kept_label)),
                           shape=(n, shape.num_labels))
    labels.sort_indices()
    return topics, labels


def _block_features(s: _Structure, rng: np.random.Generator, topics: np.ndarray,
                    labels: sp.csr_matrix) -> sp.csr_matrix:
    """TF-IDF-like features (n, F) float32 with L2-normalised rows, from a block's topics and labels."""
    n = labels.shape[0]
    label_doc = np.repeat(np.arange(n), np.diff(labels.indptr))
    signature_doc = np.repeat(label_doc, SIGNATURE_FEATURES)
    signature_feature = s.signatures[labels.indices].ravel()

    length = rng.lognormal(-LENGTH_SIGMA ** 2 / 2, LENGTH_SIGMA, n)
    topic_doc = np.repeat(np.arange(n), rng.poisson(length * s.topic_draws))
    topic_feature = s.topic_pools[topics[topic_doc], rng.integers(0, TOPIC_POOL_SIZE, len(topic_doc))]
    background_doc = np.repeat(np.arange(n), rng.poisson(length * s.background_draws))
    background_feature = _sample_sorted(s.feature_cdf, rng.random(len(background_doc)) * s.feature_cdf[-1])

    rows = np.concatenate([signature_doc, topic_doc, background_doc])
    columns = np.concatenate([signature_feature, topic_feature, background_feature])
    counts = np.concatenate([np.full(len(signature_doc), SIGNATURE_COUNT, dtype=np.float32),
                             np.ones(len(topic_doc) + len(background_doc), dtype=np.float32)])
    features = sp.csr_matrix((counts, (rows, columns)), shape=(n, s.shape.num_features))  # sums repeats
    features.sort_indices()
    features.data = (1 + np.log(features.data)) * s.idf[features.indices]
    norms = np.sqrt(np.add.reduceat(features.data ** 2, features.indptr[:-1]))  # every row has signatures
    features.data /= np.repeat(norms, np.diff(features.indptr)).astype(np.float32)
    return features


def _block(s: _Structure, block: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Documents [block * DOCS_PER_BLOCK, (block + 1) * DOCS_PER_BLOCK) of the stream."""
    rng = np.random.default_rng([s.seed, block])
    topics, labels = _block_labels(s, rng, DOCS_PER_BLOCK)
    return _block_features(s, rng, topics, labels), labels


def _check(num_docs: int, seed: int, first_doc: int) -> None:
    for name, value in (("number of documents", num_docs), ("seed", seed), ("first document", first_doc)):
        if value < 0:
            raise XmcError(f"the {name} must be >= 0, got {value}")


def _iter_blocks(s: _Structure, num_docs: int, first_doc: int) -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix]]:
    end = first_doc + num_docs
    for block in range(first_doc // DOCS_PER_BLOCK, -(-end // DOCS_PER_BLOCK)):
        block_start = block * DOCS_PER_BLOCK
        features, labels = _block(s, block)
        rows = slice(max(first_doc, block_start) - block_start, min(end, block_start + DOCS_PER_BLOCK) - block_start)
        yield features[rows], labels[rows]


def iter_blocks(shape: SyntheticShape, num_docs: int, seed: int = 0,
                first_doc: int = 0) -> Iterator[tuple[sp.csr_matrix, sp.csr_matrix]]:
    """(features, labels) of documents [first_doc, first_doc + num_docs), a block at a time (at most
    DOCS_PER_BLOCK rows each); stacked, they equal ``generate_matrices``."""
    _check(num_docs, seed, first_doc)
    return _iter_blocks(_structure(shape, seed), num_docs, first_doc)


def generate_matrices(shape: SyntheticShape, num_docs: int, seed: int = 0,
                      first_doc: int = 0) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Documents [first_doc, first_doc + num_docs) of the seed's stream.

    Returns features (num_docs, F) csr float32 with L2-normalised rows of positive TF-IDF-like weights, and
    labels (num_docs, L) csr float32 0/1; every document has at least one label and one feature.
    """
    blocks = list(iter_blocks(shape, num_docs, seed, first_doc))
    if not blocks:
        return (sp.csr_matrix((0, shape.num_features), dtype=np.float32),
                sp.csr_matrix((0, shape.num_labels), dtype=np.float32))
    features = sp.vstack([f for f, _ in blocks], format="csr", dtype=np.float32)
    labels = sp.vstack([y for _, y in blocks], format="csr", dtype=np.float32)
    return features, labels


# ---------------------------------------------------------------------------------------------- rendering
# Lines are assembled as byte matrices, one row per token, padded with NUL bytes that are dropped at the end:
# no Python loop per document or per token.

_NUL, _SPACE, _NEWLINE, _COMMA = 0, ord(" "), ord("\n"), ord(",")


def _digits(numbers: np.ndarray, leading_zeros: bool = False, width: int | None = None) -> np.ndarray:
    """(n, width) uint8 ASCII digits of non-negative integers; leading zeros become NUL unless kept."""
    numbers = np.asarray(numbers, dtype=np.int64)
    if width is None:
        width = len(str(int(numbers.max()))) if len(numbers) else 1
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    digits = (numbers[:, None] // powers % 10 + ord("0")).astype(np.uint8)
    if not leading_zeros:
        digits[:, :-1][numbers[:, None] < powers[:-1]] = _NUL
    return digits


def _constant(n: int, text: bytes) -> np.ndarray:
    return np.tile(np.frombuffer(text, dtype=np.uint8), (n, 1))


def _separator(n: int, byte: int) -> np.ndarray:
    return np.full((n, 1), byte, dtype=np.uint8)


def _lines(tokens: np.ndarray, indptr: np.ndarray) -> bytes:
    """Join token rows (their last column is the separator) into lines, line i = tokens[indptr[i]:indptr[i+1]]."""
    if np.any(np.diff(indptr) == 0):
        raise ValueError("every line needs at least one token")
    tokens[indptr[1:] - 1, -1] = _NEWLINE
    flat = tokens.ravel()
    return flat[flat != _NUL].tobytes()


def _word_counts(features: sp.csr_matrix, words_per_doc: float) -> tuple[np.ndarray, np.ndarray]:
    """Words of each document, heaviest feature first: (feature ids (W,), indptr (N+1,)). Every feature is one
    word, and the words left to reach words_per_doc are shared out in proportion to the weights."""
    nonzeros = np.diff(features.indptr)
    row = np.repeat(np.arange(features.shape[0]), nonzeros)
    row_sums = np.add.reduceat(features.data, features.indptr[:-1]) if features.nnz else np.zeros(0)
    spare = np.maximum(words_per_doc - nonzeros, 0)
    repeats = 1 + np.rint(spare[row] * features.data / row_sums[row]).astype(np.int64)
    order = np.lexsort((features.indices, -features.data, row))  # heaviest first: truncation keeps the signal
    words = np.repeat(features.indices[order], repeats[order])
    indptr = np.concatenate([[0], np.cumsum(np.add.reduceat(repeats, features.indptr[:-1]))])
    return words, indptr


def _text_bytes(features: sp.csr_matrix, words_per_doc: float) -> tuple[bytes, np.ndarray]:
    """Pseudo-word lines "w12 w12 w7 ..." and the number of words of each line (N,)."""
    words, indptr = _word_counts(features, words_per_doc)
    tokens = np.hstack([_constant(len(words), b"w"), _digits(words), _separator(len(words), _SPACE)])
    return _lines(tokens, indptr), np.diff(indptr)


def feature_texts(features: sp.csr_matrix, words_per_doc: float) -> list[str]:
    """Texts (N,) that a tokenizer reads as the documents' features: feature f is the word "w{f}", repeated in
    proportion to its weight (at least once, about words_per_doc words per document), heaviest first."""
    if features.shape[0] == 0:
        return []
    return _text_bytes(features, words_per_doc)[0].decode("ascii").splitlines()


def _number_lines(prefix: bytes, numbers: np.ndarray, indptr: np.ndarray) -> bytes:
    tokens = np.hstack([_constant(len(numbers), prefix), _digits(numbers), _separator(len(numbers), _SPACE)])
    return _lines(tokens, indptr)


def _svmlight_lines(features: sp.csr_matrix, labels: sp.csr_matrix) -> bytes:
    """LightXML's train_v1.txt lines: "3,17 12:0.045123 80:0.301002", 0-based ids, values to VALUE_DECIMALS."""
    n_labels, n_features = labels.nnz, features.nnz
    label_tokens = np.hstack([_digits(labels.indices), _separator(n_labels, _COMMA)])
    label_tokens[labels.indptr[1:] - 1, -1] = _SPACE
    scale = 10 ** VALUE_DECIMALS
    quantized = np.clip(np.rint(features.data.astype(np.float64) * scale), 1, scale).astype(np.int64)
    feature_tokens = np.hstack([_digits(features.indices), _constant(n_features, b":"),
                                _digits(quantized // scale, width=1), _constant(n_features, b"."),
                                _digits(quantized % scale, leading_zeros=True, width=VALUE_DECIMALS),
                                _separator(n_features, _SPACE)])
    width = max(label_tokens.shape[1], feature_tokens.shape[1])
    tokens = np.zeros((n_labels + n_features, width), dtype=np.uint8)
    # a line is its labels, then its features
    label_doc = np.repeat(np.arange(labels.shape[0]), np.diff(labels.indptr))
    feature_doc = np.repeat(np.arange(features.shape[0]), np.diff(features.indptr))
    tokens[np.arange(n_labels) + features.indptr[label_doc], width - label_tokens.shape[1]:] = label_tokens
    tokens[np.arange(n_features) + labels.indptr[feature_doc + 1], width - feature_tokens.shape[1]:] = feature_tokens
    return _lines(tokens, labels.indptr + features.indptr)


# ---------------------------------------------------------------------------------------------- writing

_DATA_FILES = ("train_texts.txt", "train_labels.txt", "train_ids.txt", "train_v1.txt",
               "test_texts.txt", "test_labels.txt", "test_ids.txt")


def _is_synthetic(folder: Path) -> bool:
    try:
        return json.loads((folder / "stats.json").read_text(encoding="utf-8")).get("generator") == GENERATOR
    except (OSError, ValueError, AttributeError):
        return False


def _check_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise XmcError(f"{folder} is a file; pass a new or empty folder as the output of the synthetic dataset")
    if folder.is_dir() and any(folder.iterdir()) and not _is_synthetic(folder):
        raise XmcError(f"{folder} is not empty and holds no synthetic dataset (its stats.json does not name "
                       f"{GENERATOR}); pass a new or empty folder so nothing of yours is overwritten")


def _quantiles(counts: np.ndarray) -> dict[str, float]:
    return {str(q): float(np.quantile(counts, q)) for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)}


def _write_split(s: _Structure, folder: Path, split: str, num_docs: int, first_doc: int) -> dict:
    """Writes one split's files as `.partial`, renamed by the caller; returns its statistics."""
    label_counts = np.zeros(s.shape.num_labels, dtype=np.int64)
    totals = {"labels": 0, "features": 0, "words": 0}
    names = [f"{split}_texts.txt", f"{split}_labels.txt", f"{split}_ids.txt"] + (
        ["train_v1.txt"] if split == "train" else [])
    files = [open(folder / f"{name}.partial", "wb") for name in names]
    try:
        with progress_bar(f"synthetic {s.shape.name} {split}", num_docs) as advance:
            done = 0
            for features, labels in _iter_blocks(s, num_docs, first_doc):
                n = labels.shape[0]
                text, words = _text_bytes(features, s.shape.words_per_doc)
                files[0].write(text)
                files[1].write(_number_lines(b"L", labels.indices, labels.indptr))
                files[2].write(_number_lines(f"{split}-".encode(), np.arange(done, done + n), np.arange(n + 1)))
                if split == "train":
                    files[3].write(_svmlight_lines(features, labels))
                label_counts += np.bincount(labels.indices, minlength=s.shape.num_labels)
                totals["labels"] += labels.nnz
                totals["features"] += features.nnz
                totals["words"] += int(words.sum())
                done += n
                advance(n)
    finally:
        for file in files:
            file.close()
    return {"docs": num_docs, "label_counts": label_counts,
            **{key: value / max(num_docs, 1) for key, value in totals.items()}}


def _statistics(shape: SyntheticShape, seed: int, train: dict, test: dict) -> dict:
    train_counts, test_counts = train["label_counts"], test["label_counts"]
    seen_train, seen_test = train_counts > 0, test_counts > 0
    top = np.argsort(-train_counts, kind="stable")[:10]
    top_1_percent = np.sort(train_counts)[::-1][:max(1, shape.num_labels // 100)].sum()
    return {
        "generator": GENERATOR,
        "complete": True,
        "synthetic": {"shape": asdict(shape), "seed": seed, "test_first_doc": TEST_FIRST_DOC,
                      "docs_per_block": DOCS_PER_BLOCK},
        "n_train": train["docs"],
        "n_test": test["docs"],
        "n_labels": int(np.count_nonzero(seen_train | seen_test)),
        "n_labels_train": int(np.count_nonzero(seen_train)),
        "n_labels_test": int(np.count_nonzero(seen_test)),
        "n_test_labels_unseen_in_train": int(np.count_nonzero(seen_test & ~seen_train)),
        "avg_labels_per_doc_train": round(train["labels"], 3),
        "avg_labels_per_doc_test": round(test["labels"], 3),
        "avg_docs_per_label_train": round(float(train_counts[seen_train].mean()), 3) if seen_train.any() else 0.0,
        "avg_features_per_doc_train": round(train["features"], 2),
        "avg_words_per_doc_train": round(train["words"], 2),
        "avg_words_per_doc_test": round(test["words"], 2),
        "label_freq_quantiles_train(q:count)": _quantiles(train_counts[seen_train]) if seen_train.any() else {},
        "share_of_train_assignments_top_1pct_labels": round(float(top_1_percent / max(train_counts.sum(), 1)), 4),
        "n_labels_train_freq_1": int(np.count_nonzero(train_counts == 1)),
        "n_labels_train_freq_le_5": int(np.count_nonzero(seen_train & (train_counts <= 5))),
        "top10_labels_train": [[f"L{label}", int(train_counts[label])] for label in top if train_counts[label]],
    }


def _card(stats: dict, title: str, command: str) -> str:
    shape = stats["synthetic"]["shape"]
    return f"""# {title} (synthetic)

**Synthetic data, not for accuracy claims.** Generated by `{GENERATOR}` at the shape of `{shape["name"]}`, for
benchmarks and scale tests (speed, memory, scaling). Scores on it say nothing about a method's accuracy on real
data; never report them beside or instead of the real dataset's.

Regenerate: `{command}`

## Parameters

| parameter | value |
|---|---|
| shape | `{shape["name"]}` |
| seed | {stats["synthetic"]["seed"]} |
| train / test documents | {stats["n_train"]:,} / {stats["n_test"]:,} |
| labels (L) / features (F) | {shape["num_labels"]:,} / {shape["num_features"]:,} |
| labels / features / words per document (target means) | {shape["labels_per_doc"]} / {shape["features_per_doc"]} / {shape["words_per_doc"]} |
| label power law (weight of rank r) | (r+1)^-{LABEL_ZIPF_EXPONENT} |
| topics | {max(1, shape["num_labels"] // LABELS_PER_TOPIC):,} of ~{LABELS_PER_TOPIC} labels; {TOPIC_LABEL_SHARE:.0%} of label draws from the document's topic |
| features | {SIGNATURE_FEATURES} signature features per label, a pool of {TOPIC_POOL_SIZE} per topic, Zipf background (exponent {FEATURE_ZIPF_EXPONENT}) |

## Statistics (from the files)

| | train | test |
|---|---|---|
| documents | {stats["n_train"]:,} | {stats["n_test"]:,} |
| distinct labels | {stats["n_labels_train"]:,} | {stats["n_labels_test"]:,} |
| labels per document (mean) | {stats["avg_labels_per_doc_train"]} | {stats["avg_labels_per_doc_test"]} |
| words per document (mean) | {stats["avg_words_per_doc_train"]} | {stats["avg_words_per_doc_test"]} |
| sparse features per document (mean) | {stats["avg_features_per_doc_train"]} | — |

- {stats["n_test_labels_unseen_in_train"]:,} test labels never occur in train; {stats["n_labels_train_freq_1"]:,} labels
  occur in one training document, {stats["n_labels_train_freq_le_5"]:,} in at most five; the most frequent 1% of
  labels hold {stats["share_of_train_assignments_top_1pct_labels"]:.1%} of the training assignments.

## Files

| file | contents |
|---|---|
| `train_texts.txt`, `test_texts.txt` | pseudo-words: feature f is the word `w{{f}}`, repeated by weight, heaviest first |
| `train_labels.txt`, `test_labels.txt` | label names `L{{id}}`; `L0` is the most frequent by construction |
| `train_ids.txt`, `test_ids.txt` | `train-i` is document i of the seed's stream, `test-i` document {TEST_FIRST_DOC} + i |
| `train_v1.txt` | LightXML's svmlight file of the training features: `label,label f:v f:v`, 0-based; its label ids are the generator's (`L{{id}}`), not xmcbench's sorted vocabulary |
| `stats.json` | the statistics above and the generator's parameters |
"""


def write_dataset(folder: Path, shape: SyntheticShape, train_docs: int | None = None, test_docs: int | None = None,
                  seed: int = 0, command: str | None = None) -> Path:
    """Write a synthetic dataset in the raw-text layout (plus train_v1.txt features) block by block, in memory
    bounded by the block size whatever the number of documents; returns the folder.

    Refuses a non-empty folder unless it holds a synthetic dataset (which is then replaced).
    """
    folder = Path(os.path.expanduser(str(folder)))
    train_docs = shape.train_docs if train_docs is None else train_docs
    test_docs = shape.test_docs if test_docs is None else test_docs
    for name, value in (("train documents", train_docs), ("test documents", test_docs)):
        if value < 1:
            raise XmcError(f"the number of {name} must be at least 1, got {value}")
    _check(0, seed, 0)
    _check_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = (f"xmcbench synthetic {shape.name} --output {folder} --train-docs {train_docs} "
                   f"--test-docs {test_docs} --seed {seed}")
    # Marks the folder as ours before the first byte of data, so an interrupted run can be redone in place.
    write_json(folder / "stats.json", {"generator": GENERATOR, "complete": False})
    structure = _structure(shape, seed)
    train = _write_split(structure, folder, "train", train_docs, 0)
    test = _write_split(structure, folder, "test", test_docs, TEST_FIRST_DOC)
    for name in _DATA_FILES:
        os.replace(folder / f"{name}.partial", folder / name)
    stats = _statistics(shape, seed, train, test)
    atomic_write(folder / "README.md", lambda path: path.write_text(_card(stats, folder.name, command), encoding="utf-8"))
    write_json(folder / "stats.json", stats)
    return folder
