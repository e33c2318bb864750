"""The Extreme Classification Repository's bag-of-words files: train.txt and test.txt (optionally
.xz/.gz/.bz2), each a header line 'N D L' (documents, features, labels) and then one document per line,
'l1,l2,... f:v f:v ...' with 0-based label and feature ids (the label list may be empty). A single such file
is split with --test-size.

Such a dataset has features but no raw text; its label names are the label ids as strings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.data import Dataset, _first_file
from xmcbench.errors import XmcError
from xmcbench.features import parse_xc_header, read_xc_sparse
from xmcbench.formats import DataFormat, FormatOptions, content_version, dataset_from_matrices, split_test, \
    write_label_table
from xmcbench.storage import atomic_write, open_binary

NAME = "xc_sparse"


def has_header(file: Path) -> bool:
    with open_binary(file) as stream:
        first = stream.readline(200)
    return parse_xc_header(first.removeprefix(b"\xef\xbb\xbf")) is not None


def data_files(path: Path) -> dict[str, Path] | None:
    """{"train": file, "test": file} for a folder with train.txt and test.txt, {"all": file} for one file."""
    if path.is_file():
        return {"all": path} if has_header(path) else None
    if not path.is_dir():
        return None
    found = {split: _first_file(path, (f"{split}.txt",)) for split in ("train", "test")}
    if found["train"] is None or found["test"] is None:
        return None
    return found if all(has_header(file) for file in found.values()) else None


def detect(path: Path) -> bool:
    try:
        return data_files(path) is not None
    except (OSError, EOFError, ValueError):   # a corrupt compressed file is not ours to explain here
        return False


def read(path: Path, options: FormatOptions) -> Dataset:
    options.refuse(NAME, "text_column", "label_column", "label_separator", "id_column")
    files = data_files(path)
    if files is None:
        raise XmcError(f"{path} holds no Extreme Classification Repository files: expected train.txt and test.txt "
                       "(or one file) starting with an 'N D L' header line")
    parsed = {split: read_xc_sparse(file) for split, file in files.items()}
    if "all" in parsed:
        if options.test_size is None:
            raise XmcError(f"{path} is a single file: pass --test-size (a share such as 0.2, or a number of rows) "
                           "to split it into training and test documents, or give train.txt and test.txt")
        whole = parsed["all"]
        train, test = split_test(whole.features.shape[0], options.test_size, options.seed)
        train_features, train_labels = whole.features[train], whole.labels[train]
        test_features, test_labels = whole.features[test], whole.labels[test]
    else:
        if options.test_size is not None:
            raise XmcError(f"{path} has train.txt and test.txt already; --test-size splits a single file, drop it")
        train_features, train_labels = parsed["train"].features, parsed["train"].labels
        test_features, test_labels = parsed["test"].features, parsed["test"].labels
        if train_features.shape[1] != test_features.shape[1]:
            raise XmcError(f"{files['train']} has {train_features.shape[1]} features but {files['test']} has "
                           f"{test_features.shape[1]} (the headers' second numbers); both need one feature space")
        width = max(train_labels.shape[1], test_labels.shape[1])   # headers may count only their own split's labels
        train_labels, test_labels = (sp.csr_matrix((m.data, m.indices, m.indptr), shape=(m.shape[0], width))
                                     for m in (train_labels, test_labels))
    names = [str(i) for i in range(train_labels.shape[1])]
    version = content_version(list(files.values()), NAME, options.given())
    name = path.stem if path.is_file() else path.name
    return dataset_from_matrices(name, version, [], train_labels, [], test_labels, names, str(path),
                                 train_features=train_features, test_features=test_features)


def label_ids(label_names: list[str]) -> np.ndarray:
    """The file's id of each label: its name when every name is a non-negative integer, else its position."""
    if all(name.isascii() and name.isdigit() and str(int(name)) == name for name in label_names):
        return np.array([int(name) for name in label_names], dtype=np.int64)
    return np.arange(len(label_names), dtype=np.int64)


def write(dataset: Dataset, folder: Path, options: FormatOptions) -> None:
    """train.txt and test.txt; labels keep integer names as their ids (else they are numbered in order);
    label texts in label_texts.tsv under those ids (write_label_table)."""
    from sklearn.datasets import dump_svmlight_file

    options.refuse(NAME, "text_column", "label_column", "label_separator", "id_column", "test_size")
    # test first: a raw-text dataset (no test features) would read its features file to answer
    if dataset.test_features is None or dataset.train_features is None:
        raise XmcError(f"dataset '{dataset.name}' has no sparse features, and xc_sparse files hold features, not "
                       "texts; write it as delimited, raw_text or pecos instead")
    ids = label_ids(dataset.label_names)
    num_labels = int(ids.max()) + 1 if len(ids) else 0
    for split, features, labels in (("train", dataset.train_features, dataset.train_labels),
                                     ("test", dataset.test_features, dataset.test_labels)):
        labels = sp.csr_matrix(labels)
        by_id = sp.csr_matrix((labels.data, ids[labels.indices], labels.indptr), shape=(labels.shape[0], num_labels))
        by_id.sort_indices()
        features = sp.csr_matrix(features, dtype=np.float32)
        features.sort_indices()

        def write_file(temporary: Path, features=features, by_id=by_id) -> None:
            with open(temporary, "wb") as stream:
                stream.write(f"{features.shape[0]} {features.shape[1]} {num_labels}\n".encode())
                dump_svmlight_file(features, by_id, stream, zero_based=True, multilabel=True)

        atomic_write(folder / f"{split}.txt", write_file)
    write_label_table(dataset, folder, [str(i) for i in ids.tolist()])


FORMAT = DataFormat(
    name=NAME,
    description="Extreme Classification Repository bag of words: train.txt + test.txt, header 'N D L', then "
                "'l1,l2 f:v f:v ...' per line (features only, no texts)",
    detect=detect, read=read, write=write)
