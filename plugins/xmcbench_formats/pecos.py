"""PECOS's folder layout: X.trn.txt / X.tst.txt (one raw text per line) and/or X.trn.npz / X.tst.npz (sparse
features, scipy CSR), Y.trn.npz / Y.tst.npz (label matrices, scipy CSR, documents x labels) and optionally
output-items.txt (one label name per line; the label ids as strings without it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.data import Dataset, _first_file, read_texts
from xmcbench.errors import XmcError
from xmcbench.formats import DataFormat, FormatOptions, content_version, dataset_from_matrices, write_label_table
from xmcbench.storage import atomic_write
from xmcbench_formats.raw_text import one_line

NAME = "pecos"
SPLITS = {"train": "trn", "test": "tst"}
LABEL_NAMES_FILE = "output-items.txt"


def detect(path: Path) -> bool:
    if not path.is_dir() or not all((path / f"Y.{s}.npz").is_file() for s in SPLITS.values()):
        return False
    texts = all(_first_file(path, (f"X.{s}.txt",)) is not None for s in SPLITS.values())
    features = all((path / f"X.{s}.npz").is_file() for s in SPLITS.values())
    return texts or features


def load_matrix(file: Path) -> sp.csr_matrix:
    try:
        return sp.csr_matrix(sp.load_npz(file))
    except (OSError, ValueError, KeyError) as error:
        raise XmcError(f"cannot read {file} as a scipy sparse matrix ({error}); save it with "
                       "scipy.sparse.save_npz") from None


def read(path: Path, options: FormatOptions) -> Dataset:
    options.refuse(NAME, "text_column", "label_column", "label_separator", "id_column", "test_size")
    if not detect(path):
        raise XmcError(f"{path} is not a PECOS folder: expected Y.trn.npz, Y.tst.npz and X.trn.txt / X.tst.txt "
                       "(or X.trn.npz / X.tst.npz)")
    files, parts = [], {}
    for split, short in SPLITS.items():
        labels_file = path / f"Y.{short}.npz"
        text_file = _first_file(path, (f"X.{short}.txt",))
        feature_file = path / f"X.{short}.npz"
        labels = load_matrix(labels_file)
        texts = read_texts(text_file) if text_file is not None else []
        features = sp.csr_matrix(load_matrix(feature_file), dtype=np.float32) if feature_file.is_file() else None
        if features is not None and not np.isfinite(features.data).all():   # as xc_sparse's reader refuses them
            raise XmcError(f"{feature_file}: a feature value is not a finite number (nan or inf); fix or drop that "
                           "feature")
        for rows, file in ((len(texts) if texts or text_file else None, text_file),
                           (features.shape[0] if features is not None else None, feature_file)):
            if rows is not None and rows != labels.shape[0]:
                raise XmcError(f"{file} has {rows} documents but {labels_file} has {labels.shape[0]} rows; the "
                               "files of a split must describe the same documents, in order")
        files += [file for file in (labels_file, text_file, feature_file) if file is not None and Path(file).is_file()]
        parts[split] = (texts, labels, features)
    train_texts, train_labels, train_features = parts["train"]
    test_texts, test_labels, test_features = parts["test"]
    width = max(train_labels.shape[1], test_labels.shape[1])
    names_file = path / LABEL_NAMES_FILE
    if names_file.is_file():
        names = read_texts(names_file)
        files.append(names_file)
        if len(names) != width:
            raise XmcError(f"{names_file} names {len(names)} labels but the label matrices have {width} columns; "
                           "it needs one label name per line, in column order")
    else:
        names = [str(i) for i in range(width)]
    train_labels, test_labels = (sp.csr_matrix((m.data, m.indices, m.indptr), shape=(m.shape[0], width))
                                 for m in (train_labels, test_labels))
    version = content_version(files, NAME)
    return dataset_from_matrices(path.name, version, train_texts, train_labels, test_texts, test_labels, names,
                                 str(path), train_features, test_features)


def write(dataset: Dataset, folder: Path, options: FormatOptions) -> None:
    """Y.*.npz and output-items.txt always; X.*.txt with texts and X.*.npz with features; label texts in
    label_texts.tsv (write_label_table)."""
    options.refuse(NAME, "text_column", "label_column", "label_separator", "id_column", "test_size")
    broken = next((name for name in dataset.label_names if "\n" in name or "\r" in name), None)
    if broken is not None:
        raise XmcError(f"label {broken!r} contains a line break, and {LABEL_NAMES_FILE} holds one name per line; "
                       "rename the label")
    for split, short in SPLITS.items():
        texts = getattr(dataset, f"{split}_texts")
        labels = sp.csr_matrix(getattr(dataset, f"{split}_labels"), dtype=np.float32)
        features = getattr(dataset, f"{split}_features")
        atomic_write(folder / f"Y.{short}.npz", lambda temporary, m=labels: _save_npz(temporary, m))
        if texts:
            lines = "".join(one_line(text) + "\n" for text in texts)
            atomic_write(folder / f"X.{short}.txt", lambda temporary, t=lines: temporary.write_text(t, "utf-8"))
        if features is not None:
            atomic_write(folder / f"X.{short}.npz",
                         lambda temporary, m=features: _save_npz(temporary, sp.csr_matrix(m, dtype=np.float32)))
    names = "".join(name + "\n" for name in dataset.label_names)
    atomic_write(folder / LABEL_NAMES_FILE, lambda temporary: temporary.write_text(names, "utf-8"))
    write_label_table(dataset, folder)


def _save_npz(file: Path, matrix: sp.csr_matrix) -> None:
    with open(file, "wb") as stream:   # a file object: save_npz would append .npz to a name
        sp.save_npz(stream, matrix)


FORMAT = DataFormat(
    name=NAME,
    description="PECOS folder: X.trn.txt/X.tst.txt texts and/or X.trn.npz/X.tst.npz features, Y.trn.npz/Y.tst.npz "
                "label matrices, optional output-items.txt label names",
    detect=detect, read=read, write=write)
