"""Data formats: what a plugin implements so that `--dataset PATH` reads (and `xmcbench convert` writes)
a folder or file in a layout other than the raw-text one.

A format is a `DataFormat` registered through the `xmcbench_register_formats` hook: a name, a `detect`
function that recognises a path, a `read` function that turns the path into an `xmcbench.data.Dataset`, and
optionally a `write` function (the inverse). `FormatOptions` carries what the user said about the data
(`--text-column`, `--label-column`, `--label-separator`, `--id-column`, `--test-size`, the split seed,
`--label-texts`).

Label texts: a format's `read` may fill `Dataset.label_texts` from its own files (the XC repository's `Y.txt`);
otherwise `read_dataset` takes them from a table of label texts in the dataset's folder (`label_texts.tsv`, see
`xmcbench.data.read_label_table`) or from `--label-texts FILE`. A dataset that has label texts of its own
refuses `--label-texts`, so no file silently wins over another.

Helpers every reader may use: `dataset_from_rows` (label-name lists to the Dataset contract), `split_test`
(a seeded, optionally grouped train/test split of a single file) and `content_version` (the cache key of the
files read and the options that shaped them); the Extreme Classification Repository's sparse files are read
by `xmcbench.features` (`read_xc_sparse`, `read_xc_matrix`).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Callable

import numpy as np
import scipy.sparse as sp

from xmcbench.data import IN_MEMORY, data_dir_from_env, Dataset, dataset_files, gc_paused, label_matrix, \
    label_texts_file, load_dataset, load_dataset_from_path, read_label_table, texts_for_labels
from xmcbench.errors import BadData, RefusedSetting, XmcError
from xmcbench.storage import fingerprint, written_beside

# The option users type to choose a format; `compare` already uses --format for its table format.
FORMAT_OPTION_HINT = "--format NAME (--data-format NAME in `compare`)"


@dataclass(frozen=True)
class FormatOptions:
    """What the user said about how to read (or write) a dataset; None means "the format's default".

    format_name: the format to read with (--format), None to detect it. test_size: for a single file, the share
    (0 < x < 1) or the number (an integer >= 1) of rows, or of groups when id_column is set, that become the
    test set; seed: the seed of that split. label_texts: a table of label texts (xmcbench.data.read_label_table)
    for a dataset whose files carry none; kept as an absolute path, so a run's config.json finds it from
    anywhere.
    """

    format_name: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    label_separator: str | None = None
    id_column: str | None = None
    test_size: float | None = None
    seed: int = 0
    label_texts: str | None = None

    def __post_init__(self) -> None:
        if self.label_texts is not None:
            object.__setattr__(self, "label_texts", str(Path(self.label_texts).expanduser().resolve()))

    def given(self) -> dict:
        """The options the user set that shape how the files are read, for error messages and for the dataset
        version (the seed counts only with a split). label_texts is left out: the version counts the contents
        of that file (with_label_table), not where it lies."""
        values = {key: value for key, value in asdict(self).items()
                  if value is not None and key not in ("seed", "format_name", "label_texts")}
        if self.test_size is not None:
            values["seed"] = self.seed
        return values

    def refuse(self, format_name: str, *names: str) -> None:
        """Raise XmcError if any of the named options is set: the format has no use for it."""
        used = [name for name in names if getattr(self, name) is not None]
        if used:
            flags = ", ".join("--" + name.replace("_", "-") for name in used)
            raise RefusedSetting(f"the {format_name} format does not use {flags}; "
                                 f"drop {'it' if len(used) == 1 else 'them'} (`xmcbench formats` lists what each "
                                 "format reads)")


@dataclass(frozen=True)
class DataFormat:
    """One data format a plugin registers.

    name: what users pass to --format / --to, e.g. "delimited".
    description: one line for `xmcbench formats`.
    detect(path) -> bool: True when the file or folder is in this format; cheap (names and at most a first
        line), never raises for a path that is simply something else.
    read(path, options) -> Dataset: the whole dataset (texts, label matrices, and `train_features` /
        `test_features` (N, D) float32 csr when the format has them); user mistakes raise XmcError in one line.
        Its `version` must change with the files' contents and with the options that shaped the result.
    write(dataset, folder, options) -> None, or None when the format is read-only: writes `dataset` into the
        new folder `folder` so that `read` gives it back (texts, labels, features, label texts, as far as the
        format holds them; `write_label_table` puts label texts where `read_dataset` finds them).
    extra: the optional dependency group the format needs (`pip install 'xmcbench[EXTRA]'`), "" for none.
    writes_filters: whether `write` keeps `test_filter` / `train_filter` (`convert` says when they are left out).
    """

    name: str
    description: str
    detect: Callable[[Path], bool]
    read: Callable[[Path, FormatOptions], Dataset]
    write: Callable[[Dataset, Path, FormatOptions], None] | None = None
    extra: str = ""
    writes_filters: bool = False


# ---------------------------------------------------------------------------------------------- choosing

def detect_format(registry, path: Path) -> DataFormat:
    """The one registered format that recognises `path`; XmcError in one line when none or several do."""
    matches = [entry.value for entry in registry.formats.values() if _detects(entry.value, path)]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(sorted(registry.formats)) or "none is registered"
    if not matches:
        raise BadData(f"{path} is in no data format xmcbench recognises (registered formats: {names}); choose "
                      f"one with {FORMAT_OPTION_HINT}, and see docs/data-formats.md for the layouts")
    raise BadData(f"{path} looks like several data formats: {', '.join(sorted(f.name for f in matches))}; choose "
                  f"one with {FORMAT_OPTION_HINT}")


def _detects(data_format: DataFormat, path: Path) -> bool:
    try:
        return bool(data_format.detect(path))
    except OSError:   # unreadable: not this format's business to report
        return False


def read_dataset(registry, path: Path, options: FormatOptions | None = None) -> Dataset:
    """Read a folder or file with the format `options.format_name`, or the one that recognises it."""
    options = options or FormatOptions()
    path = Path(path).expanduser()
    if not path.exists():
        raise BadData(f"{path} does not exist; pass a folder or file holding the dataset")
    data_format = registry.format(options.format_name) if options.format_name else detect_format(registry, path)
    dataset = data_format.read(path, options)
    own_table = label_texts_file(path) if path.is_dir() else None
    if own_table is not None and dataset.label_texts is None:
        dataset = with_label_table(dataset, own_table)
    if options.label_texts is not None:
        if dataset.label_texts is not None:
            source = own_table.name if own_table is not None else f"its {data_format.name} files"
            raise BadData(f"{path} carries label texts of its own (from {source}); drop --label-texts, or remove "
                          f"the dataset's own so that {options.label_texts} gives them")
        dataset = with_label_table(dataset, Path(options.label_texts))
    return dataset


def with_label_table(dataset: Dataset, file: Path) -> Dataset:
    """`dataset` with the label texts of a table (xmcbench.data.read_label_table): labels it lacks keep their
    names, what it leaves out is counted in the report; the version also hashes the table's contents."""
    if not Path(file).is_file():
        raise BadData(f"{file} does not exist; --label-texts names a file of label<TAB>text lines")
    table = read_label_table(file)
    report = dict(dataset.report)
    texts = texts_for_labels(dataset.label_names, table.texts, report)
    version = hashlib.sha256(f"{dataset.version} label_texts {table.digest}".encode()).hexdigest()[:16]
    return replace(dataset, label_texts=texts, report=report, version=version)


def write_label_table(dataset: Dataset, folder: Path, names: list[str] | None = None) -> None:
    """The dataset's label texts as the folder's table, when it has any: label_texts.tsv (label<TAB>text), or
    label_texts.csv when a label name holds a tab or a line break, or a text a line break (which TSV cannot
    hold). names: the label names as the format wrote them, when it renamed them (e.g. to ids)."""
    if dataset.label_texts is None:
        return
    from xmcbench.storage import atomic_write

    pairs = list(zip(names if names is not None else dataset.label_names, dataset.label_texts))
    if all(not any(c in name for c in "\t\r\n") and "\n" not in text and "\r" not in text for name, text in pairs):
        lines = "".join(f"{name}\t{text}\n" for name, text in pairs)
        atomic_write(folder / "label_texts.tsv", lambda temporary: temporary.write_text(lines, "utf-8"))
        return

    def write_csv(temporary: Path) -> None:
        import csv

        with open(temporary, "w", encoding="utf-8", newline="") as stream:
            writer = csv.writer(stream)
            writer.writerow(["label", "text"])
            writer.writerows(pairs)

    atomic_write(folder / "label_texts.csv", write_csv)


def not_written(data_format: DataFormat, dataset: Dataset) -> list[str]:
    """What of `dataset` the format's writer leaves out and says nothing about: its filtered pairs, where the
    format has no place for them."""
    has_filters = dataset.test_filter is not None or dataset.train_filter is not None
    return ["filtered (document, label) pairs"] if has_filters and not data_format.writes_filters else []


def write_dataset(registry, dataset: Dataset, folder: Path, format_name: str,
                  options: FormatOptions | None = None) -> Path:
    """Write `dataset` into the new (or empty) `folder` in the named format; returns the folder."""
    data_format = registry.format(format_name)
    if data_format.write is None:
        writers = ", ".join(sorted(name for name, e in registry.formats.items() if e.value.write is not None))
        raise RefusedSetting(f"the {format_name} format can be read but not written; write one of: {writers}")
    folder = Path(folder).expanduser()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise BadData(f"{folder} exists and is not an empty folder; name a new folder to write the dataset into")
    with written_beside(folder) as staging:   # a failure midway leaves no half-written dataset to read later
        data_format.write(dataset, staging, options or FormatOptions())
    return folder


# ---------------------------------------------------------------------------------------------- building

def content_version(files: list[Path], *parts) -> str:
    """A Dataset.version: sha256 (first 16 hex) over the bytes of `files` (as stored) and JSON `parts`."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{Path(file).name}\n".encode())
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    digest.update(fingerprint(*parts).encode())
    return digest.hexdigest()[:16]


def dataset_from_rows(name: str, version: str, train_texts: list[str], train_rows: list[list[str]],
                      test_texts: list[str], test_rows: list[list[str]], where: str,
                      train_features: sp.csr_matrix | None = None, test_features: sp.csr_matrix | None = None,
                      report: dict[str, int] | None = None) -> Dataset:
    """A Dataset from label-name lists, under the same rules as the raw-text layout: label ids 0..L-1 are the
    training labels (sorted names), then the labels seen only in test; repeated labels on a row count once.

    train_texts, test_texts: (N_train,), (N_test,) str, or empty lists for a dataset of features only.
    train_rows, test_rows: (N_train,), (N_test,) lists of label names. where: the path, for error messages.
    """
    _check_sizes(where, len(train_rows), len(test_rows))
    with gc_paused():
        train_vocab = sorted(set(chain.from_iterable(train_rows)))
        test_only = sorted(set(chain.from_iterable(test_rows)).difference(train_vocab))
        label_names = train_vocab + test_only
        vocab = {label: i for i, label in enumerate(label_names)}
        train_labels, train_dups = label_matrix(train_rows, vocab, len(label_names))
        test_labels, test_dups = label_matrix(test_rows, vocab, len(label_names))
    counts = dict(report or {})
    _count(counts, "duplicate_label_lines", train_dups + test_dups)
    return _dataset(name, version, label_names, len(train_vocab), train_texts, train_labels, test_texts, test_labels,
                    where, train_features, test_features, counts)


def dataset_from_matrices(name: str, version: str, train_texts: list[str], train_labels: sp.csr_matrix,
                          test_texts: list[str], test_labels: sp.csr_matrix, names: list[str], where: str,
                          train_features: sp.csr_matrix | None = None, test_features: sp.csr_matrix | None = None,
                          report: dict[str, int] | None = None, label_texts: list[str] | None = None,
                          train_filter: sp.csr_matrix | None = None,
                          test_filter: sp.csr_matrix | None = None) -> Dataset:
    """A Dataset from 0/1 label matrices over the K labels `names` (formats that store label ids).

    train_labels (N_train, K), test_labels (N_test, K) csr. Labels no document carries are dropped; the
    training labels come first in `names` order, then the labels seen only in test (Dataset's contract).
    label_texts: (K,) the text of each label ("" for none: the label keeps its name), or None.
    train_filter (N_train, K), test_filter (N_test, K): 0/1 csr of (document, label) pairs removed from
    predictions before scoring, or None; pairs on dropped labels go with them.
    """
    _check_sizes(where, train_labels.shape[0], test_labels.shape[0])
    train_labels, test_labels = (_binary(m) for m in (train_labels, test_labels))
    in_train = np.zeros(len(names), dtype=bool)
    in_train[train_labels.indices] = True
    in_test = np.zeros(len(names), dtype=bool)
    in_test[test_labels.indices] = True
    order = np.concatenate([np.flatnonzero(in_train), np.flatnonzero(in_test & ~in_train)])
    label_names = [names[i] for i in order.tolist()]
    counts = dict(report or {})
    texts = None
    if label_texts is not None:
        texts = texts_for_labels(label_names, {names[i]: label_texts[i] for i in order.tolist()}, counts)
    train_filter, test_filter = (None if pairs is None else _binary(pairs)[:, order].tocsr()
                                 for pairs in (train_filter, test_filter))
    dataset = _dataset(name, version, label_names, int(in_train.sum()), train_texts, train_labels[:, order].tocsr(),
                       test_texts, test_labels[:, order].tocsr(), where, train_features, test_features, counts)
    return replace(dataset, label_texts=texts, train_filter=train_filter, test_filter=test_filter)


def _binary(labels: sp.spmatrix) -> sp.csr_matrix:
    labels = sp.csr_matrix(labels, dtype=np.float32)
    labels.sum_duplicates()
    labels.eliminate_zeros()
    labels.data[:] = 1.0
    return labels


def _check_sizes(where: str, num_train: int, num_test: int) -> None:
    if not num_train:
        raise BadData(f"{where} has no training documents; it needs at least one row in its training part")
    if not num_test:
        raise BadData(f"{where} has no test documents (a run scores its model on the test set); add test rows, "
                      "or split one file with --test-size")


def _count(counts: dict[str, int], key: str, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n


def _dataset(name, version, label_names, num_labels, train_texts, train_labels, test_texts, test_labels, where,
             train_features, test_features, counts) -> Dataset:
    """The checks and the report counts every reader shares, then the Dataset."""
    if train_labels.nnz == 0:
        raise BadData(f"{where} has no training labels: every training row has an empty label list")
    for texts, features, split in ((train_texts, train_features, "train"), (test_texts, test_features, "test")):
        rows = train_labels.shape[0] if split == "train" else test_labels.shape[0]
        if texts and len(texts) != rows:
            raise ValueError(f"{split}: {len(texts)} texts for {rows} label rows")
        if features is not None and features.shape[0] != rows:
            raise ValueError(f"{split}: {features.shape[0]} feature rows for {rows} label rows")
        _count(counts, f"empty_{split}_label_lines", int(np.count_nonzero(np.diff(
            (train_labels if split == "train" else test_labels).indptr) == 0)))
    _count(counts, "empty_texts", sum(1 for t in chain(train_texts, test_texts) if not t or t.isspace()))
    _count(counts, "unseen_test_labels", len(label_names) - num_labels)
    if train_features is not None and test_features is not None and train_features.shape[1] != test_features.shape[1]:
        raise BadData(f"{where}: the training features have {train_features.shape[1]} columns but the test "
                      f"features {test_features.shape[1]}; both splits need one feature space")
    return Dataset(name=name, version=version, label_names=label_names, num_labels=num_labels,
                   train_texts=train_texts, train_labels=train_labels, test_texts=test_texts, test_labels=test_labels,
                   propensity_a=0.55, propensity_b=1.5, report=counts,
                   train_features=train_features, test_features=test_features)


def label_lists(dataset: Dataset, labels: sp.csr_matrix) -> list[list[str]]:
    """The label names of each row of `labels` (N, len(label_names)): (N,) lists of str, in id order."""
    names = np.asarray(dataset.label_names, dtype=object)
    labels = sp.csr_matrix(labels)
    return [names[labels.indices[start:end]].tolist() for start, end in zip(labels.indptr[:-1], labels.indptr[1:])]


# ---------------------------------------------------------------------------------------------- splitting

def split_test(num_rows: int, test_size: float, seed: int = 0,
               groups: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A seeded train/test split of the rows of one file: (train rows, test rows), sorted int64 arrays.

    test_size: the share of rows (0 < x < 1) or their number (an integer >= 1) that go to test; with `groups`
    ((num_rows,) hashable ids, e.g. an id column), the share or number of groups instead, and all rows of one
    group land on the same side. The same inputs give the same split.
    """
    from sklearn.model_selection import GroupShuffleSplit, ShuffleSplit

    size = _test_size(test_size)
    units = len(set(groups)) if groups is not None else num_rows
    count = size if isinstance(size, int) else int(np.ceil(size * units))
    what = "groups (distinct ids)" if groups is not None else "rows"
    if not 0 < count < units:
        raise RefusedSetting(f"--test-size {test_size} leaves no {'test' if count <= 0 else 'training'} {what} out of "
                             f"{units}; choose a share between 0 and 1 or a count below {units}")
    splitter = (GroupShuffleSplit if groups is not None else ShuffleSplit)(n_splits=1, test_size=count,
                                                                          random_state=seed)
    index = np.zeros((num_rows, 1))
    train, test = next(splitter.split(index, groups=groups) if groups is not None else splitter.split(index))
    return np.sort(train).astype(np.int64), np.sort(test).astype(np.int64)


def _test_size(value: float) -> float | int:
    value = float(value)
    if value.is_integer() and value >= 1:
        return int(value)
    if 0 < value < 1:
        return value
    raise RefusedSetting(f"--test-size {value:g} is neither a share between 0 and 1 nor a whole number of rows; "
                         "e.g. --test-size 0.2 or --test-size 500")


def open_dataset(registry, name: str, data_dir: Path | None = None,
                 options: FormatOptions | None = None) -> Dataset:
    """A registered dataset by name, or a folder or file by path: the raw-text layout first, else the one
    registered data format that recognises it (xmcbench.formats); `options` are the reading options
    (--format, --text-column, ...). A dataset may hold sparse features and no texts: the methods that cannot
    read it refuse it (xmcbench.whole_methods.check_inputs)."""
    options = options or FormatOptions()
    if name.startswith(IN_MEMORY):
        raise XmcError(f"{name} was data given as Python lists, which no file holds; pass the data again "
                       "(xmcbench.evaluate(run, data=...), or a dataset name or path)")
    path = Path(name).expanduser()
    if name in registry.datasets or not path.exists():
        if options != FormatOptions():
            raise XmcError(f"{', '.join(_flags(options))} read a folder or file, not the registered dataset {name!r}; "
                           "drop them, or pass the path of your data")
        return load_dataset(registry.dataset(name), data_dir_from_env(data_dir))
    if options == FormatOptions() and path.is_dir() and dataset_files(path)[0]:
        return load_dataset_from_path(path)   # the raw-text layout, or an error naming the files it misses
    return read_dataset(registry, path, options)


def _flags(options: FormatOptions) -> list[str]:
    given = {"format": options.format_name, **options.given(), "label_texts": options.label_texts}
    return ["--" + key.replace("_", "-") for key, value in given.items() if value is not None and key != "seed"]
