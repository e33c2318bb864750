"""Features: of documents (TF-IDF of texts, or a dataset's own sparse features read from the Extreme
Classification Repository's and LightXML's text files) and of labels (PIFA: the normalised sum of a label's
documents' features), which label indexers (xmcbench.indexing) cluster.

One reader for the sparse text files: scikit-learn's C svmlight parser reads the bodies (read_xc_sparse,
read_xc_matrix for the data formats, read_sparse_features for the raw-text layout's features file); a per-line
Python parser re-reads a file the C parser refused only to name the line at fault (its errors carry no line
number), or to accept what only it reads (unsorted feature ids).

Shapes: N documents, F features, L labels.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import lzma
import math
import mmap
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterable

import numpy as np
import scipy.sparse as sp

from xmcbench.storage import open_binary
from xmcbench.errors import BadData, XmcError
from xmcbench.workers import available_cores, fork_available, run_forked

# scikit-learn (a second of imports) is bound on first use (bind_scikit_learn): the data formats import this module
# when their plugin loads, and `xmcbench plugins` or `datasets` should not pay for it
SCIKIT_LEARN = {"load_svmlight_file": "sklearn.datasets", "TfidfVectorizer": "sklearn.feature_extraction.text",
                "normalize": "sklearn.preprocessing", "row_norms": "sklearn.utils.extmath"}
load_svmlight_file = TfidfVectorizer = normalize = row_norms = None


def bind_scikit_learn() -> None:
    """Bind this module's scikit-learn names (SCIKIT_LEARN) on first use; a name bound already stays (a test may
    have replaced it, and forked workers inherit the module as it is)."""
    for name, module in SCIKIT_LEARN.items():
        if globals()[name] is None:
            globals()[name] = getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------------------------------
# Document features
# --------------------------------------------------------------------------------------------------


def tfidf_features(train_texts: list[str], max_features: int | None = None,
                   min_df: int | None = None) -> sp.csr_matrix:
    """TF-IDF features of the training texts, used only to build label representations and to compare texts.

    train_texts: N strings.
    Returns (N, F) csr float32, rows L2-normalised (sublinear tf, unigrams, lowercase,
    min_df=2, or 1 when N < 50 because on tiny corpora min_df=2 would drop almost every term). min_df=1 keeps
    every term: a word that only one of two texts has must lower their cosine.
    """
    bind_scikit_learn()

    n = len(train_texts)
    vectorizer = TfidfVectorizer(
        lowercase=True,
        ngram_range=(1, 1),
        min_df=min_df if min_df is not None else (2 if n >= 50 else 1),
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


def unit_rows(features) -> sp.csr_matrix:
    """(R, F) csr float32 with L2-normalised (or zero) rows: the input itself when it already is one, so that
    rows normalised before (TF-IDF, read_sparse_features) keep their exact values."""
    bind_scikit_learn()

    x = features
    if not (sp.issparse(x) and x.format == "csr" and x.dtype == np.float32):
        x = sp.csr_matrix(x, dtype=np.float32)
    norms = row_norms(x)
    if np.all((np.abs(norms - 1) <= 1e-4) | (norms == 0)):
        return sp.csr_matrix(x)
    return sp.csr_matrix(normalize(x, norm="l2", axis=1), dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# Sparse feature files
# --------------------------------------------------------------------------------------------------

@dataclass
class XcSparse:
    """One Extreme Classification Repository file: header 'N D L', then 'l1,l2 f:v f:v ...' per document.

    features: (N, D) float32 csr, as stored (not normalised). labels: (N, L) float32 0/1 csr, L from the header.
    """

    features: sp.csr_matrix
    labels: sp.csr_matrix


def parse_xc_header(line: bytes | str) -> tuple[int, int, int] | None:
    """'N D L' of an XC file's first line, or None when the line is not such a header."""
    parts = line.split()
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    n, d, l = (int(part) for part in parts)
    return n, d, l


def _xc_header_and_body(path: Path, parse_header, expected: str) -> tuple[tuple[int, ...], bytes]:
    """The parsed header line and the bytes after it of an XC text file (plain or .xz/.gz/.bz2)."""
    with open_binary(path) as stream:
        raw = stream.read()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    first_end = raw.find(b"\n")
    header = parse_header(raw[:first_end if first_end >= 0 else len(raw)])
    if header is None:
        raise BadData(f"{path}: line 1 is not the {expected} header of an Extreme Classification Repository file; "
                      "add it, or pass --format for another layout")
    return header, raw[first_end + 1:] if first_end >= 0 else b""


def _parse_xc_body(path: Path, body: bytes, num_docs: int, num_columns: int,
                   expected: str = "'l1,l2 f:v f:v ...' lines with 0-based ids and sorted, unique features") \
        -> tuple[sp.csr_matrix, list]:
    """(N, num_columns) float32 csr of the 'f:v' pairs and the (N,) label-id tuples of the lines of an XC file
    after its header, by scikit-learn's C svmlight parser; N must be the header's num_docs."""
    bind_scikit_learn()

    try:
        # parsed as float64, then cast: scikit-learn's float32 path is slower by about half
        features, labels = load_svmlight_file(io.BytesIO(body), n_features=num_columns, multilabel=True,
                                              zero_based=True, dtype=np.float64)
    except ValueError as error:
        raise BadData(f"{path}: not a valid Extreme Classification Repository file after its header ({error}); "
                      f"expected {expected}") from None
    features = sp.csr_matrix(features, dtype=np.float32)
    labels = list(labels)
    if features.shape[0] != num_docs:
        features, labels = _with_empty_lines(body, features, labels)
    if features.shape[0] != num_docs:
        raise BadData(f"{path}: header line 1 says {num_docs} documents but the file has {features.shape[0]} "
                      "data lines; fix the header or re-export the file")
    if not np.isfinite(features.data).all():
        raise BadData(f"{path}: a value is not a finite number (nan or inf); fix or drop that entry")
    return features, labels


def read_xc_sparse(path: Path) -> XcSparse:
    """Parse an XC file (plain or .xz/.gz/.bz2) with scikit-learn's C svmlight parser: no Python loop per token.

    Lines with no labels (' 3:1.0') and empty lines (a document without labels or features) are documents.
    Raises XmcError in one line for a missing header, a row count unlike the header's, a value that is not a
    finite number, or anything the C parser rejects (its message carries no line number; the callers that
    need one re-read with a line-by-line parser).
    """
    (num_docs, num_features, num_labels), body = _xc_header_and_body(
        path, parse_xc_header, "'N D L' (documents, features, labels)")
    features, labels = _parse_xc_body(path, body, num_docs, num_features)
    del body
    lengths = np.fromiter(map(len, labels), dtype=np.int64, count=len(labels))
    ids = np.fromiter(chain.from_iterable(labels), dtype=np.float64, count=int(lengths.sum()))
    if ids.size and (ids.min() < 0 or ids.max() >= num_labels or not np.array_equal(ids, np.floor(ids))):
        raise BadData(f"{path}: a label id is not a whole number in [0, {num_labels}), the header's label count; "
                      "ids are 0-based")
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    label_matrix = sp.csr_matrix((np.ones(ids.size, dtype=np.float32), ids.astype(np.int64), indptr),
                                 shape=(num_docs, num_labels))
    label_matrix.sum_duplicates()
    label_matrix.data[:] = 1.0
    return XcSparse(features, label_matrix)


def parse_xc_matrix_header(line: bytes | str) -> tuple[int, int] | None:
    """'N C' (rows, columns) of the first line of an XC sparse matrix file, or None when it is not one."""
    parts = line.split()
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1])


def read_xc_matrix(path: Path) -> sp.csr_matrix:
    """An XC sparse matrix file (plain or .xz/.gz/.bz2), as the label-feature datasets store their label
    matrices (trn_X_Y.txt) and bag-of-words features (trn_X_Xf.txt): header 'N C', then per row 'j:v j:v ...'
    with 0-based column ids (an empty line is an empty row). (N, C) float32 csr, values as stored.

    The rows are an XC file's lines without labels, so the parser of read_xc_sparse reads them, each line
    led by the space that marks an empty label list."""
    (num_rows, num_columns), body = _xc_header_and_body(path, parse_xc_matrix_header, "'N C' (rows, columns)")
    if body:
        ends = body.endswith(b"\n")
        body = b" " + (body[:-1] if ends else body).replace(b"\n", b"\n ") + (b"\n" if ends else b"")
    matrix, _ = _parse_xc_body(path, body, num_rows, num_columns,
                               "'j:v j:v ...' lines with 0-based column ids, sorted and unique within a line")
    return matrix


def _with_empty_lines(body: bytes, features: sp.csr_matrix, labels: list) -> tuple[sp.csr_matrix, list]:
    """The parser skips empty (and comment-only) lines; in an XC file an empty line is a document: put them back."""
    lines = body.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    empty = np.fromiter((not line.split(b"#", 1)[0].strip() for line in lines), dtype=bool, count=len(lines))
    if features.shape[0] != int((~empty).sum()):
        return features, labels
    kept = np.flatnonzero(~empty)
    row_lengths = np.zeros(len(lines), dtype=np.int64)
    row_lengths[kept] = np.diff(features.indptr)
    indptr = np.concatenate([[0], np.cumsum(row_lengths)])
    full = sp.csr_matrix((features.data, features.indices, indptr), shape=(len(lines), features.shape[1]))
    full_labels: list = [()] * len(lines)
    for row, label in zip(kept.tolist(), labels):
        full_labels[row] = label
    return full, full_labels


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
    bind_scikit_learn()

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
    bind_scikit_learn()

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
# Label features
# --------------------------------------------------------------------------------------------------

_MIN_WORK_FOR_WORKERS = 10_000_000  # below this many products, forking costs more than it saves (threads=0)
_PIECES_PER_WORKER = 8  # see _label_features_in_workers
_MOVE_CHUNK = 1 << 22  # see _label_features_in_workers


def label_features(doc_features: sp.csr_matrix, labels: sp.csr_matrix, threads: int = 0) -> sp.csr_matrix:
    """Label representation: row l = L2-normalised sum of the feature rows of the documents carrying label l.

    doc_features: (N, F); labels: (N, L) 0/1 csr.
    threads: worker processes (forked) that share the product by label rows; 0 means one per available
    core, or none for small inputs. The result does not depend on it.
    Returns (L, F) csr float32; labels with no document get an all-zero row. The column indices within a row
    are not sorted: nothing downstream needs them sorted, and sorting 10^8 entries costs seconds.
    """
    bind_scikit_learn()

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
    workers = threads or (available_cores() if work.sum() >= _MIN_WORK_FOR_WORKERS else 1)
    if workers > 1 and fork_available() and hasattr(mmap, "MADV_REMOVE"):
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
    bind_scikit_learn()

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

        run_forked(workers, work_pieces, "label features", num_pieces)

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
