"""The Extreme Classification Repository's label-feature layout (the LF-* datasets that NGAME, DEXA, DEXML and
Renée train on), as a folder (every file optionally .xz/.gz/.bz2):

    trn_X.txt, tst_X.txt          one raw document text per line (NGAME's trn.raw.txt / tst.raw.txt also do)
    trn_X_Y.txt, tst_X_Y.txt      label matrices: header 'N L' (documents, labels), then per document
                                  'label:value ...' with 0-based label ids (an empty line: no label)
    Y.txt (or lbl.raw.txt)        optional: one label text per line, line i the text of label id i
    trn_X_Xf.txt, tst_X_Xf.txt    optional: the repository's bag-of-words features, header 'N D', 'f:v ...'
    filter_labels_test.txt        optional: 'doc_id label_id' per line (0-based), (test document, label) pairs
    filter_labels_train.txt       removed from predictions before scoring, as the repository's evaluation does

Labels are ids in this layout, so a label's name is its id as a string ("0", "1", ...), as in xc_sparse and
pecos without output-items.txt; its text is its line of Y.txt (an empty line: the label keeps its name).
A file in which every line starts with 'uid->' (a token without whitespace, then '->') carries ids before
its texts, as some repositories' raw files do: the prefix is dropped from every line of that file and the
file counted as `uid_prefixed_files`; the uid is not used (rows are matched by line number, labels by id).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.data import Dataset, _first_file, _read_lines, label_texts_file
from xmcbench.errors import XmcError
from xmcbench.features import parse_xc_matrix_header, read_xc_matrix
from xmcbench.formats import DataFormat, FormatOptions, content_version, dataset_from_matrices
from xmcbench.storage import atomic_write, open_binary
from xmcbench_formats.raw_text import one_line
from xmcbench_formats.xc_sparse import label_ids

NAME = "xc_label_features"
SPLITS = {"train": "trn", "test": "tst"}
LABEL_TEXT_FILES = ("Y.txt", "lbl.raw.txt")
UID_PREFIX = re.compile(r"[^\s]+->")
UNUSED = ("text_column", "label_column", "label_separator", "id_column", "test_size")


def _texts_file(path: Path, short: str):
    return _first_file(path, (f"{short}_X.txt", f"{short}.raw.txt"))


def _has_matrix_header(file) -> bool:
    with open_binary(file) as stream:
        first = stream.readline(200)
    return parse_xc_matrix_header(first.removeprefix(b"\xef\xbb\xbf")) is not None


def _has_files(path: Path) -> bool:
    """trn_X_Y.txt and tst_X_Y.txt, and texts or features for both splits (names only)."""
    if not path.is_dir() or any(_first_file(path, (f"{short}_X_Y.txt",)) is None for short in SPLITS.values()):
        return False
    texts = all(_texts_file(path, short) is not None for short in SPLITS.values())
    return texts or all(_first_file(path, (f"{short}_X_Xf.txt",)) is not None for short in SPLITS.values())


def detect(path: Path) -> bool:
    """The files of the layout, the label matrices starting with an 'N L' header (xc_sparse's have 'N D L')."""
    try:
        return _has_files(path) and all(_has_matrix_header(_first_file(path, (f"{short}_X_Y.txt",)))
                                        for short in SPLITS.values())
    except (OSError, EOFError, ValueError):   # a corrupt compressed file is not ours to explain here
        return False


def without_uid_prefixes(lines: list[str], counts: dict[str, int]) -> list[str]:
    """The lines without their 'uid->' prefixes when every non-empty line has one (module docstring)."""
    if not lines or not all(UID_PREFIX.match(line) for line in lines if line):
        return lines
    counts["uid_prefixed_files"] = counts.get("uid_prefixed_files", 0) + 1
    return [line.split("->", 1)[1] if line else line for line in lines]


def read_filter(file, num_docs: int, num_labels: int, matrix_file) -> sp.csr_matrix:
    """filter_labels_*.txt: 'doc_id label_id' lines -> (num_docs, num_labels) 0/1 csr; XmcError in one line,
    with the line number, for a line that is not two whole numbers or names a document or label out of range."""
    with open_binary(file) as stream:
        text = stream.read().decode("utf-8", errors="replace")
    line_numbers, tokens = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        pair = line.split()
        if not pair:
            continue
        if len(pair) != 2 or not all(token.isascii() and token.isdigit() for token in pair):
            raise XmcError(f"{file}:{number}: expected 'doc_id label_id' (two whole numbers, 0-based); got "
                           f"{line.strip()[:60]!r}")
        line_numbers.append(number)
        tokens += pair
    pairs = np.array(tokens, dtype=np.int64).reshape(-1, 2)
    for column, limit, what in ((0, num_docs, "document"), (1, num_labels, "label")):
        beyond = np.flatnonzero(pairs[:, column] >= limit)
        if beyond.size:
            raise XmcError(f"{file}:{line_numbers[beyond[0]]}: {what} {pairs[beyond[0], column]} is out of range: "
                           f"{matrix_file} has {limit} {what}s (ids 0 to {limit - 1}); the filter must name pairs "
                           "of this dataset")
    matrix = sp.csr_matrix((np.ones(len(pairs), dtype=np.float32), (pairs[:, 0], pairs[:, 1])),
                           shape=(num_docs, num_labels))
    matrix.sum_duplicates()
    matrix.data[:] = 1.0
    return matrix


def read(path: Path, options: FormatOptions) -> Dataset:
    options.refuse(NAME, *UNUSED)
    if not _has_files(path):
        raise XmcError(f"{path} is not a label-feature folder of the Extreme Classification Repository: expected "
                       "trn_X_Y.txt and tst_X_Y.txt (header 'N L') with trn_X.txt / tst_X.txt texts (or "
                       "trn_X_Xf.txt / tst_X_Xf.txt features)")
    counts: dict[str, int] = {}
    files, parts = [], {}
    for split, short in SPLITS.items():
        labels_file = _first_file(path, (f"{short}_X_Y.txt",))
        labels = read_xc_matrix(labels_file)
        texts_file = _texts_file(path, short)
        texts = without_uid_prefixes(_read_lines(texts_file, counts), counts) if texts_file is not None else []
        features_file = _first_file(path, (f"{short}_X_Xf.txt",))
        features = read_xc_matrix(features_file) if features_file is not None else None
        for rows, file in ((len(texts) if texts_file is not None else None, texts_file),
                           (features.shape[0] if features is not None else None, features_file)):
            if rows is not None and rows != labels.shape[0]:
                raise XmcError(f"{file} has {rows} documents but {labels_file} has {labels.shape[0]} (its header "
                               "and lines); the files of a split must describe the same documents, in order")
        files += [file for file in (labels_file, texts_file, features_file) if file is not None]
        parts[split] = (texts, labels, features, labels_file)
    width = max(parts["train"][1].shape[1], parts["test"][1].shape[1])   # headers may count their split's labels
    label_texts = None
    found = [file for name in LABEL_TEXT_FILES if (file := _first_file(path, (name,))) is not None]
    if len(found) > 1:
        raise XmcError(f"{path} holds {found[0].name} and {found[1].name}: keep the one that gives the label texts")
    if found:
        table = label_texts_file(path)
        if table is not None:
            raise XmcError(f"{path} holds {found[0].name} and {table.name}, two sources of label texts; keep one")
        label_texts = without_uid_prefixes(_read_lines(found[0], counts), counts)
        files.append(found[0])
        if len(label_texts) < width:
            raise XmcError(f"{found[0]} has {len(label_texts)} lines but the label matrices have {width} label ids; "
                           "it needs one line per label id, line i the text of label i")
        width = len(label_texts)
    filters = {}
    for split, short in SPLITS.items():
        file = _first_file(path, (f"filter_labels_{split}.txt",))
        if file is not None:
            texts, labels, features, labels_file = parts[split]
            filters[split] = read_filter(file, labels.shape[0], width, labels_file)
            files.append(file)
    train_texts, train_labels, train_features, _ = parts["train"]
    test_texts, test_labels, test_features, _ = parts["test"]
    train_labels, test_labels = (sp.csr_matrix((m.data, m.indices, m.indptr), shape=(m.shape[0], width))
                                 for m in (train_labels, test_labels))
    names = [str(i) for i in range(width)]
    version = content_version(files, NAME)
    return dataset_from_matrices(path.name, version, train_texts, train_labels, test_texts, test_labels, names,
                                 str(path), train_features, test_features, counts, label_texts,
                                 filters.get("train"), filters.get("test"))


def write(dataset: Dataset, folder: Path, options: FormatOptions) -> None:
    """trn_X_Y.txt / tst_X_Y.txt always; trn_X.txt / tst_X.txt with texts, trn_X_Xf.txt / tst_X_Xf.txt with
    features; Y.txt with label texts, or with the label names when they are not the ids (so they survive as
    texts); filter_labels_*.txt with filters. Label ids: the names when every name is a whole number, else
    the positions in label_names (xc_sparse's rule)."""
    options.refuse(NAME, *UNUSED)
    ids = label_ids(dataset.label_names)
    width = int(ids.max()) + 1 if len(ids) else 0
    for split, short in SPLITS.items():
        texts = getattr(dataset, f"{split}_texts")
        labels = sp.csr_matrix(getattr(dataset, f"{split}_labels"))
        by_id = sp.csr_matrix((labels.data, ids[labels.indices], labels.indptr), shape=(labels.shape[0], width))
        _write_matrix(folder / f"{short}_X_Y.txt", by_id)
        if texts:
            lines = "".join(one_line(text) + "\n" for text in texts)
            atomic_write(folder / f"{short}_X.txt", lambda temporary, t=lines: temporary.write_text(t, "utf-8"))
        features = getattr(dataset, f"{split}_features")
        if features is not None:
            _write_matrix(folder / f"{short}_X_Xf.txt", sp.csr_matrix(features, dtype=np.float32))
        pairs = getattr(dataset, f"{split}_filter")
        if pairs is not None:
            pairs = sp.coo_matrix(pairs)
            order = np.lexsort((ids[pairs.col], pairs.row))
            lines = "".join(f"{row} {label}\n" for row, label in zip(pairs.row[order].tolist(),
                                                                     ids[pairs.col][order].tolist()))
            atomic_write(folder / f"filter_labels_{split}.txt",
                         lambda temporary, t=lines: temporary.write_text(t, "utf-8"))
    names_are_ids = all(name == str(i) for name, i in zip(dataset.label_names, ids.tolist()))
    if dataset.label_texts is not None or not names_are_ids:
        by_id = [""] * width   # an id no label has: an empty line, which keeps the id as its name
        for i, text in zip(ids.tolist(), dataset.label_texts or dataset.label_names):
            by_id[i] = one_line(text)
        lines = "".join(text + "\n" for text in by_id)
        atomic_write(folder / "Y.txt", lambda temporary: temporary.write_text(lines, "utf-8"))


def _write_matrix(file: Path, matrix: sp.csr_matrix) -> None:
    """An XC sparse matrix file: header 'N C', then 'j:v ...' per row (values as %g)."""
    matrix = sp.csr_matrix(matrix)
    matrix.sort_indices()

    def write_file(temporary: Path) -> None:
        with open(temporary, "w", encoding="utf-8") as stream:
            stream.write(f"{matrix.shape[0]} {matrix.shape[1]}\n")
            for start, end in zip(matrix.indptr[:-1].tolist(), matrix.indptr[1:].tolist()):
                stream.write(" ".join(f"{j}:{v:.9g}" for j, v in zip(matrix.indices[start:end].tolist(),
                                                                     matrix.data[start:end].tolist())) + "\n")

    atomic_write(file, write_file)


FORMAT = DataFormat(
    name=NAME,
    description="Extreme Classification Repository label-feature folder: trn_X.txt/tst_X.txt texts (or "
                "trn_X_Xf.txt features), trn_X_Y.txt/tst_X_Y.txt labels (header 'N L'), Y.txt label texts, "
                "filter_labels_*.txt",
    detect=detect, read=read, write=write, writes_filters=True)
