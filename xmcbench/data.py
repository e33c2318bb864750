"""Datasets in the raw-text layout of AttentionXML / LightXML, read into sparse label matrices.

A dataset folder holds four line-aligned files, one document per line:

    train_texts.txt   train_labels.txt   test_texts.txt   test_labels.txt

Label lines hold whitespace-separated label names. An optional ``label_texts.tsv`` gives labels a text
(``label<TAB>text`` per line; ``label_texts.csv`` / ``label_texts.jsonl`` with ``label`` and ``text`` columns
also do), see ``read_label_table``. The public copies of the paper's benchmarks also ship
``train_raw_texts.txt`` / ``test_raw_texts.txt`` (their ``*_texts.txt`` are already tokenised); the raw ones
are preferred when present. Every file may instead be stored as ``.xz``, ``.gz`` or ``.bz2``. Optional sparse
features of the training documents (``train_v1.txt``, LightXML's svmlight file, or ``train.txt``, the Extreme
Classification Repository's bag of words) become ``Dataset.train_features``, read from their file when first
used (``FeatureFile``; ``xmcbench.features`` parses them).

Reading is forgiving where the intent is clear and strict where guessing would change results:
CRLF line ends, non-UTF-8 bytes, a UTF-8 byte-order mark, duplicate labels on a line, empty texts and empty
label lines are accepted and counted in ``Dataset.report``; files of different line counts, an empty
training or test set, a training set without any label, unreadable or corrupt files and missing files raise
``XmcError`` with a one-line explanation. docs/bad-input.md lists every case.

Non-UTF-8 bytes become U+FFFD in texts, but ``\\xNN`` escapes in label names, so that two labels that differ
only in their undecodable bytes stay two labels.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import lzma
import os
import zlib
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from itertools import chain
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.errors import BadData, XmcError
from xmcbench.storage import COMPRESSED_SUFFIXES, open_binary

IN_MEMORY = "in-memory:"   # the dataset name of data given as Python lists (xmcbench.api): never read from disk

PathLike = Traversable | Path | str

ENV_DATA_DIR = "XMCBENCH_DATA_DIR"

# Plain first: a user who decompressed a file by hand means the plain copy.
_EXTENSIONS = ("",) + COMPRESSED_SUFFIXES

# Files are read in blocks cut at newlines, so peak memory stays near the size of the result
# instead of file bytes + decoded text + lines all at once (Wiki-500K's raw texts are several GB).
_BLOCK_BYTES = 32 << 20

_BOM = b"\xef\xbb\xbf"

_FEATURE_FILES = ("train_v1.txt", "train.txt")  # LightXML's svmlight file is what LightXML itself reads


@dataclass(frozen=True)
class DatasetSpec:
    """How to find one registered dataset and what its published statistics are.

    No hyperparameters here: presets belong to methods.
    """

    name: str  # registry name, e.g. "debian-debtags-mini", "wiki500k"
    description: str
    dirname: str  # folder name under a user data dir (e.g. "Wiki-500K")
    embedded: Traversable | Path | None = None  # files shipped with a package; None -> looked up in the data dir
    num_train: int | None = None  # published statistics, for display and sanity checks
    num_test: int | None = None
    num_labels: int | None = None
    propensity_a: float = 0.55  # Jain et al. 2016 A, B for PSP@k
    propensity_b: float = 1.5
    source: str = ""  # one line: where public copies are distributed (shown when files are missing)
    card: str = ""  # path/URL of the dataset card
    is_default: bool = False  # the dataset a run uses when none is named (the first registered one marked wins)


@dataclass(frozen=True)
class FeatureFile:
    """The raw-text layout's features file (train_v1.txt / train.txt) of `num_docs` training documents, kept
    unread until Dataset.train_features is first read: at Wiki-500K's size it takes minutes and gigabytes to
    read, and only label indexing reads it."""

    path: Path
    num_docs: int

    def read(self) -> sp.csr_matrix:
        """(num_docs, F) float32 csr with L2-normalised rows."""
        from xmcbench.features import read_sparse_features   # scipy's parsers: only when the features are read

        return read_sparse_features(self.path, self.num_docs)


class _TrainFeatures:
    """Dataset.train_features: it holds a matrix, None or a FeatureFile, which the first read of the field
    replaces by its matrix (the dataset keeps it from then on, and so does a dataclasses.replace copy)."""

    def __get__(self, dataset, owner=None):
        if dataset is None:
            return None   # the field's default
        if isinstance(dataset._train_features, FeatureFile):
            dataset._train_features = dataset._train_features.read()
        return dataset._train_features

    def __set__(self, dataset, value) -> None:
        dataset._train_features = value


@dataclass
class Dataset:
    """A loaded dataset.

    Label ids: ``0 .. num_labels-1`` are the training vocabulary (sorted names); ids ``>= num_labels`` are labels
    seen only in the test set (sorted names), kept so that recall-style metrics count them as misses.
    ``report`` holds only the policies that changed something; keys: ``crlf_lines``, ``lone_carriage_returns``,
    ``non_utf8_lines``,
    ``utf8_bom_files``, ``empty_texts``, ``empty_train_label_lines``, ``empty_test_label_lines``,
    ``duplicate_label_lines``, ``unseen_test_labels`` (distinct test labels absent from train),
    ``labels_without_text`` (labels that keep their name as text), ``label_texts_unused`` (label-text lines naming a
    label the dataset lacks), ``uid_prefixed_files`` (files whose ``uid->`` line prefixes were dropped).
    """

    name: str
    version: str  # sha256 (first 16 hex) over the contents of the four files read: keys caches
    label_names: list[str]  # training vocabulary (sorted), then labels seen only in test (sorted)
    num_labels: int  # L, size of the training vocabulary; ids >= L are never predictable
    train_texts: list[str]  # (N_train,)
    train_labels: sp.csr_matrix  # (N_train, len(label_names)) float32 0/1
    test_texts: list[str]  # (N_test,)
    test_labels: sp.csr_matrix  # (N_test, len(label_names)) float32 0/1
    propensity_a: float
    propensity_b: float
    report: dict[str, int] = field(default_factory=dict)
    # Sparse features (bag of words, TF-IDF) of the documents: (N_train, D) and (N_test, D) float32 csr, or None.
    # Formats that store them give them as stored (a dataset of features only has empty train_texts /
    # test_texts); the raw-text layout's features file gives train_features only, with L2-normalised rows, read
    # when the field is first read (a FeatureFile until then, see _TrainFeatures).
    train_features: sp.csr_matrix | None = _TrainFeatures()
    test_features: sp.csr_matrix | None = None
    # One text per label of label_names (a label the files give no text keeps its name), or None: the dataset
    # carries no label texts (label_texts.tsv in the raw-text layout, Y.txt / lbl.raw.txt in the XC repository's).
    label_texts: list[str] | None = None
    # (document, label) pairs removed from a method's predictions before scoring, as the Extreme Classification
    # Repository's evaluation does with filter_labels_test.txt / filter_labels_train.txt (a label that is the
    # document itself): (N_test, len(label_names)) and (N_train, len(label_names)) 0/1 csr, or None.
    test_filter: sp.csr_matrix | None = None
    train_filter: sp.csr_matrix | None = None

    def label_counts(self) -> np.ndarray:
        """Training documents per label: (len(label_names),) int64; test-only labels count 0."""
        return np.bincount(self.train_labels.indices, minlength=len(self.label_names)).astype(np.int64)

    @property
    def has_train_features(self) -> bool:
        """Whether the dataset has training features, answered without reading a features file."""
        return self._train_features is not None


# ---------------------------------------------------------------------------------------------- locating


def data_dir_from_env(cli_value: Path | None) -> Path | None:
    """The user data directory: ``--data-dir`` if given, else ``$XMCBENCH_DATA_DIR`` if set, else None.

    Not checked here: a stale variable must not break the built-in datasets, which never need it.
    """
    if cli_value is not None:
        return Path(os.path.expanduser(str(cli_value)))
    value = os.environ.get(ENV_DATA_DIR, "").strip()
    return Path(os.path.expanduser(value)) if value else None


def _child(folder: PathLike, name: str) -> Traversable | Path:
    return Path(folder) / name if isinstance(folder, str) else folder.joinpath(name)


def _first_file(folder: PathLike, names: tuple[str, ...]) -> Traversable | Path | None:
    """The first of ``names`` x (plain, .xz, .gz, .bz2) that exists in ``folder``."""
    for name in names:
        for ext in _EXTENSIONS:
            candidate = _child(folder, name + ext)
            if candidate.is_file():
                return candidate
    return None


# A dataset folder's optional table of label texts, in any of these layouts (read_label_table).
LABEL_TEXTS_FILES = ("label_texts.tsv", "label_texts.csv", "label_texts.jsonl")


def label_texts_file(folder: PathLike) -> Traversable | Path | None:
    """The folder's table of label texts (LABEL_TEXTS_FILES, plain or compressed), or None."""
    found = [file for name in LABEL_TEXTS_FILES if (file := _first_file(folder, (name,))) is not None]
    if len(found) > 1:
        raise BadData(f"{folder} holds {found[0].name} and {found[1].name}: a dataset has one table of label texts; "
                      "remove one of them")
    return found[0] if found else None


_EXPECTED = "train_texts.txt (or train_raw_texts.txt), train_labels.txt, test_texts.txt, test_labels.txt"


def dataset_files(folder: PathLike) -> tuple[dict[str, Traversable | Path], list[str]]:
    """Map role -> file for the four files; second item lists the names of the missing ones."""
    found: dict[str, Traversable | Path] = {}
    missing: list[str] = []
    raw = {split: _first_file(folder, (f"{split}_raw_texts.txt",)) for split in ("train", "test")}
    if (raw["train"] is None) != (raw["test"] is None):
        have, lack = ("train", "test") if raw["train"] is not None else ("test", "train")
        raise BadData(
            f"{folder} has {have}_raw_texts.txt but no {lack}_raw_texts.txt; "
            f"provide both raw text files or neither, so train and test get the same preprocessing"
        )
    for split in ("train", "test"):
        texts = raw[split] or _first_file(folder, (f"{split}_texts.txt",))
        labels = _first_file(folder, (f"{split}_labels.txt",))
        for role, file, name in ((f"{split}_texts", texts, f"{split}_texts.txt"),
                                 (f"{split}_labels", labels, f"{split}_labels.txt")):
            if file is None:
                missing.append(name)
            else:
                found[role] = file
    return found, missing


def _not_found(spec: DatasetSpec, where: str, missing: list[str] | None, hint: str) -> XmcError:
    lacking = f" (missing: {', '.join(missing)})" if missing else ""
    public = f". Public copies: {spec.source}" if spec.source else ""
    return XmcError(f"dataset '{spec.name}' not found: expected {_EXPECTED} in {where}{lacking}; {hint}{public}")


def _candidate_dirs(spec: DatasetSpec, data_dir: Path) -> list[Path]:
    """Folders that may hold the dataset, best first."""
    candidates = [data_dir / spec.dirname]
    # A user who points --data-dir at the dataset folder itself means that folder.
    if data_dir.name.lower() == spec.dirname.lower():
        candidates.append(data_dir)
    # Archives unpack with varying case ("wiki-500k" vs "Wiki-500K").
    try:
        candidates += sorted(p for p in data_dir.iterdir()
                             if p.is_dir() and p.name.lower() == spec.dirname.lower() and p.name != spec.dirname)
    except OSError:
        pass
    return candidates


def resolve_files(spec: DatasetSpec, data_dir: Path | None) -> Traversable | Path:
    """The folder holding the dataset's files: the embedded copy if the spec has one, else ``data_dir/dirname``."""
    if spec.embedded is not None:
        if not spec.embedded.is_dir():
            raise BadData(f"built-in dataset '{spec.name}' has no files at {spec.embedded}; reinstall xmcbench "
                          f"(e.g. pip install -e .) so that the package xmcbench_datasets is complete")
        _, missing = dataset_files(spec.embedded)
        if missing:
            raise _not_found(spec, str(spec.embedded), missing,
                             "reinstall xmcbench so that the package xmcbench_datasets is complete")
        return spec.embedded
    hint = f"set --data-dir or {ENV_DATA_DIR} to the folder holding '{spec.dirname}/'"
    if data_dir is None:
        raise _not_found(spec, f"'{spec.dirname}/' under a data directory, but none is set", None, hint)
    if not data_dir.is_dir():
        raise _not_found(spec, f"{data_dir / spec.dirname}, but the data directory {data_dir} does not exist",
                         None, hint)
    best_missing: tuple[Path, list[str]] | None = None
    for folder in _candidate_dirs(spec, data_dir):
        if not folder.is_dir():
            continue
        _, missing = dataset_files(folder)
        if not missing:
            return folder
        if best_missing is None:
            best_missing = (folder, missing)
    if best_missing is not None:
        raise _not_found(spec, str(best_missing[0]), best_missing[1], hint)
    raise _not_found(spec, str(data_dir / spec.dirname), None, hint)


def _feature_file(folder: Traversable | Path, num_docs: int) -> FeatureFile | None:
    if not isinstance(folder, Path):
        return None  # embedded resources ship texts only
    for name in _FEATURE_FILES:
        if (folder / name).is_file():
            return FeatureFile(folder / name, num_docs)
    return None


# ---------------------------------------------------------------------------------------------- reading


def _decode_block(block: bytes, counts: dict[str, int], errors: str = "replace") -> list[str]:
    """Lines of a block that ends with b"\\n"; counts repairs into ``counts``.

    errors: how undecodable bytes are repaired: "replace" (U+FFFD, for texts) or "backslashreplace"
    (``\\xNN``, for label names, so distinct byte sequences stay distinct labels).
    """
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        bad = 0
        for raw_line in block.split(b"\n"):  # only on the rare broken file: find how many lines need repair
            try:
                raw_line.decode("utf-8")
            except UnicodeDecodeError:
                bad += 1
        counts["non_utf8_lines"] = counts.get("non_utf8_lines", 0) + bad
        # '\n' is ASCII, never part of a multi-byte sequence, so replacement cannot merge or split lines.
        text = block.decode("utf-8", errors=errors)
    crlf = text.count("\r\n")
    if crlf:
        counts["crlf_lines"] = counts.get("crlf_lines", 0) + crlf
        text = text.replace("\r\n", "\n")
    lone = text.count("\r")
    if lone:
        counts["lone_carriage_returns"] = counts.get("lone_carriage_returns", 0) + lone
    return text[:-1].split("\n")


def lines_of_bytes(raw: bytes, name: str) -> list[str]:
    """Lines of text given as bytes (e.g. stdin), read as files are: split on \\n only (\\r\\n too), bad
    UTF-8 repaired, CR-only line ends refused (see _check_line_ends)."""
    if not raw:
        return []
    counts: dict[str, int] = {}
    lines = _decode_block(raw if raw.endswith(b"\n") else raw + b"\n", counts)
    _check_line_ends(name, counts.get("lone_carriage_returns", 0), len(lines))
    return lines


def _check_line_ends(name: object, lone_cr: int, lines: int) -> None:
    """A lone \\r is kept as a character, but more lone \\r than lines means the file ends its lines with
    \\r alone (classic Mac OS): read as one line, its documents would silently merge."""
    if lone_cr > lines:
        raise BadData(f"{name} ends its lines with a lone carriage return (\\r, classic Mac OS): {lone_cr} of them "
                      f"in {lines} line(s); convert it to \\n line ends, e.g. tr '\\r' '\\n' < IN > OUT")


def _read_lines(file: PathLike, counts: dict[str, int], digest=None, errors: str = "replace") -> list[str]:
    """All lines of a (possibly compressed) text file, without line ends; feeds the contents to ``digest``.

    errors: the repair of non-UTF-8 bytes (see ``_decode_block``).
    """
    lines: list[str] = []
    lone_cr_before = counts.get("lone_carriage_returns", 0)
    pending = bytearray()  # bytes after the last newline seen so far
    first = True
    try:
        with open_binary(file) as stream:
            while True:
                # the first read holds at least the 3 bytes of a byte-order mark, whatever the block size
                chunk = stream.read(max(_BLOCK_BYTES, len(_BOM)) if first else _BLOCK_BYTES)
                if not chunk:
                    break
                if digest is not None:
                    digest.update(chunk)
                if first:
                    first = False
                    if chunk.startswith(_BOM):
                        counts["utf8_bom_files"] = counts.get("utf8_bom_files", 0) + 1
                        chunk = chunk[len(_BOM):]
                cut = chunk.rfind(b"\n") + 1
                if cut == 0:
                    pending += chunk
                    continue
                block = bytes(pending) + chunk[:cut] if pending else chunk[:cut]
                pending = bytearray(chunk[cut:])
                lines.extend(_decode_block(block, counts, errors))
    # gzip.BadGzipFile is an OSError; a corrupt deflate stream inside a .gz raises zlib.error
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as err:
        raise BadData(f"cannot read {file}: {err}; check the file, or re-download / decompress it by hand") from None
    if pending:  # last line without a trailing newline
        lines.extend(_decode_block(bytes(pending) + b"\n", counts, errors))
    _check_line_ends(file, counts.get("lone_carriage_returns", 0) - lone_cr_before, len(lines))
    return lines


def split_labels(line: str) -> list[str]:
    """The labels of one line, separated by spaces and tabs only: other characters, Unicode spaces (NBSP,
    U+2028) included, belong to a label's name instead of silently splitting it."""
    if line.isascii() and line.isprintable():   # the common case, at str.split's speed
        return line.split()
    return [label for label in line.replace("\t", " ").split(" ") if label and label != "\r"]


def read_texts(path: PathLike) -> list[str]:
    """Documents of a text file, one per line: (N,) str. ``.xz/.gz/.bz2`` are decompressed by suffix."""
    return _read_lines(path, {})


def read_label_lines(path: PathLike) -> list[list[str]]:
    """Labels of a label file, one whitespace-separated list per line: (N,) lists of str.

    Labels are returned as written (duplicates included); ``load_dataset`` keeps each label once per document.
    Undecodable bytes in a label name become ``\\xNN`` escapes, as in ``load_dataset``.
    """
    with gc_paused():
        return list(map(split_labels, _read_lines(path, {}, errors="backslashreplace")))


# ---------------------------------------------------------------------------------------------- label texts


@dataclass(frozen=True)
class LabelTable:
    """A table of label texts as read from its file: ``texts`` maps label name -> text, in file order;
    ``digest``: sha256 (hex) of the file's decompressed bytes, for the dataset version."""

    texts: dict[str, str]
    digest: str


def _table_kind(file: PathLike) -> str:
    """tsv, csv or jsonl from the file's name (a compression suffix is looked through); tsv by default."""
    name = (Path(file) if isinstance(file, str) else file).name.lower()
    for ext in COMPRESSED_SUFFIXES:
        name = name.removesuffix(ext)
    return "csv" if name.endswith(".csv") else "jsonl" if name.endswith((".jsonl", ".ndjson")) else "tsv"


def read_label_table(file: PathLike) -> LabelTable:
    """A table of label texts: ``label<TAB>text`` per line (the text runs to the line end and may hold tabs), or
    for a ``.csv`` / ``.jsonl`` name a header row / one object per line with ``label`` and ``text``. Plain or
    .xz/.gz/.bz2. Strict, since a wrong match trains silently on wrong texts: the file must be UTF-8, every
    line needs its tab, and a label name may be neither empty nor listed twice (XmcError in one line naming the
    file and line). A label the dataset lacks is not an error here (see ``texts_for_labels``)."""
    try:
        with open_binary(file) as stream:
            raw = stream.read()
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as err:
        raise BadData(f"cannot read {file}: {err}; check the file, or re-download / decompress it by hand") from None
    digest = hashlib.sha256(raw).hexdigest()
    try:
        content = raw.removeprefix(_BOM).decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.removeprefix(_BOM)[:err.start].count(b"\n") + 1
        raise BadData(f"{file}:{line}: not UTF-8 (byte {err.start} of the file); label texts are matched to label "
                      "names by their exact characters, so save the file as UTF-8") from None
    kind = _table_kind(file)
    rows = _tsv_rows(file, content) if kind == "tsv" else _csv_rows(file, content) if kind == "csv" \
        else _jsonl_rows(file, content)
    texts: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line, label, text in rows:
        if not label:
            raise BadData(f"{file}:{line}: the label name is empty; each row names a label, then its text")
        if label in first_line:
            raise BadData(f"{file}:{line}: label {label!r} is listed again (first on line {first_line[label]}); "
                          "give each label one text")
        first_line[label] = line
        texts[label] = text
    return LabelTable(texts, digest)


def _tsv_rows(file: PathLike, content: str):
    lines = content.replace("\r\n", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, start=1):
        label, tab, text = line.partition("\t")
        if not tab:
            raise BadData(f"{file}:{number}: no tab on the line; each line is a label name, a tab, then its text")
        yield number, label, text


def _csv_rows(file: PathLike, content: str):
    import csv
    import io
    import sys

    csv.field_size_limit(sys.maxsize)
    reader = csv.reader(io.StringIO(content, newline=""))
    try:
        header = next(reader, None)
        if header is None or "label" not in header or "text" not in header:
            raise BadData(f"{file}: the header row must name the columns 'label' and 'text' (it has: "
                          f"{', '.join(header or []) or 'none'})")
        label_at, text_at = header.index("label"), header.index("text")
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise BadData(f"{file}:{reader.line_num}: the row has {len(row)} fields but the header has "
                              f"{len(header)}; quote fields that contain commas or line breaks")
            yield reader.line_num, row[label_at], row[text_at]
    except csv.Error as error:
        raise BadData(f"{file}:{reader.line_num}: {error}; check the quoting of that row") from None


def _jsonl_rows(file: PathLike, content: str):
    import json

    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise BadData(f"{file}:{number}: not a JSON object ({error.msg}); write one "
                          '{"label": ..., "text": ...} object per line') from None
        if not isinstance(record, dict) or not isinstance(record.get("label"), str) \
                or not isinstance(record.get("text"), str):
            raise BadData(f"{file}:{number}: expected an object with the strings \"label\" and \"text\"")
        yield number, record["label"], record["text"]


def texts_for_labels(label_names: list[str], texts: dict[str, str], counts: dict[str, int]) -> list[str]:
    """One text per label of ``label_names``: its text in ``texts`` (label name -> text), else (absent, empty or
    only whitespace) its name, counted as ``labels_without_text``. Names in ``texts`` that are not labels of the
    dataset are counted as ``label_texts_unused`` and left out: a table may cover a whole taxonomy."""
    result, without = [], 0
    for name in label_names:
        text = texts.get(name)
        if text is None or not text.strip():
            text, without = name, without + 1
        result.append(text)
    _count(counts, "labels_without_text", without)
    _count(counts, "label_texts_unused", len(set(texts).difference(label_names)))
    return result


def label_matrix(rows: list[list[str]], vocab: dict[str, int], width: int) -> tuple[sp.csr_matrix, int]:
    """0/1 matrix (len(rows), width) float32 from label-name lists, and how many rows had a repeated label."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.fromiter(map(vocab.__getitem__, chain.from_iterable(rows)), dtype=np.int64, count=int(indptr[-1]))
    matrix = sp.csr_matrix((np.ones(len(indices), dtype=np.float32), indices, indptr), shape=(len(rows), width))
    matrix.sum_duplicates()  # also sorts indices; repeated labels become 2.0 until reset below
    duplicate_rows = int(np.count_nonzero(np.diff(matrix.indptr) != lengths))
    matrix.data[:] = 1.0
    return matrix, duplicate_rows


@contextlib.contextmanager
def gc_paused():
    """Millions of label lists would trigger repeated full garbage collections, none of which can free anything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _count(counts: dict[str, int], key: str, n: int) -> None:
    if n:
        counts[key] = counts.get(key, 0) + n


def _load(spec: DatasetSpec, folder: Traversable | Path) -> Dataset:
    files, missing = dataset_files(folder)
    if missing:  # resolve_files checked; a folder can still change under us
        raise _not_found(spec, str(folder), missing, "check the folder")
    counts: dict[str, int] = {}
    digests: list[str] = []

    def read(role: str) -> list[str]:
        digest = hashlib.sha256()
        errors = "backslashreplace" if role.endswith("_labels") else "replace"
        repaired = counts.get("non_utf8_lines", 0)
        lines = _read_lines(files[role], counts, digest, errors)
        # Label names from repaired bytes changed once (U+FFFD -> \xNN): a new version keeps old caches unused.
        repaired = f" {errors}" if counts.get("non_utf8_lines", 0) > repaired and errors != "replace" else ""
        digests.append(f"{role} {digest.hexdigest()}{repaired}\n")
        return lines

    split_data = {}
    for split in ("train", "test"):
        texts = read(f"{split}_texts")
        label_lines = read(f"{split}_labels")
        if len(texts) != len(label_lines):
            longer = files[f"{split}_texts"] if len(texts) > len(label_lines) else files[f"{split}_labels"]
            raise BadData(
                f"{files[f'{split}_texts']} has {len(texts)} lines but {files[f'{split}_labels']} has "
                f"{len(label_lines)}: line {min(len(texts), len(label_lines)) + 1} of {longer} has no partner; "
                f"the files must be line-aligned (one document per line in both)"
            )
        _count(counts, "empty_texts", sum(1 for t in texts if not t or t.isspace()))
        rows = list(map(split_labels, label_lines))
        del label_lines
        _count(counts, f"empty_{split}_label_lines", sum(1 for r in rows if not r))
        split_data[split] = (texts, rows)

    train_texts, train_rows = split_data["train"]
    test_texts, test_rows = split_data["test"]
    if not train_texts:
        raise BadData(f"dataset '{spec.name}' has no training documents: {files['train_texts']} is empty; "
                      f"fill it with one document per line")
    if not test_texts:
        raise BadData(f"dataset '{spec.name}' has no test documents: {files['test_texts']} is empty; "
                      f"fill it with one document per line (a run scores its model on the test set)")
    if not any(train_rows):
        raise BadData(f"dataset '{spec.name}' has no training labels: every line of {files['train_labels']} "
                      f"is empty; put each document's labels on its line, separated by spaces")

    train_vocab = sorted(set(chain.from_iterable(train_rows)))
    test_only = sorted(set(chain.from_iterable(test_rows)).difference(train_vocab))
    label_names = train_vocab + test_only
    vocab = {name: i for i, name in enumerate(label_names)}
    _count(counts, "unseen_test_labels", len(test_only))

    train_labels, train_dups = label_matrix(train_rows, vocab, len(label_names))
    test_labels, test_dups = label_matrix(test_rows, vocab, len(label_names))
    _count(counts, "duplicate_label_lines", train_dups + test_dups)

    label_texts = None
    table_file = label_texts_file(folder)
    if table_file is not None:   # only then part of the version, so a folder without one keeps its old version
        table = read_label_table(table_file)
        digests.append(f"label_texts {table.digest}\n")
        label_texts = texts_for_labels(label_names, table.texts, counts)

    return Dataset(
        name=spec.name,
        version=hashlib.sha256("".join(digests).encode()).hexdigest()[:16],
        label_names=label_names,
        num_labels=len(train_vocab),
        train_texts=train_texts,
        train_labels=train_labels,
        test_texts=test_texts,
        test_labels=test_labels,
        propensity_a=spec.propensity_a,
        propensity_b=spec.propensity_b,
        report=counts,
        train_features=_feature_file(folder, len(train_texts)),
        label_texts=label_texts,
    )


def load_dataset(spec: DatasetSpec, data_dir: Path | None = None) -> Dataset:
    """Read a registered dataset from its embedded copy or from ``data_dir / spec.dirname``."""
    folder = resolve_files(spec, data_dir)
    with gc_paused():
        return _load(spec, folder)


def load_dataset_from_path(path: Path) -> Dataset:
    """Read a user folder in the same layout; the dataset is named after the folder."""
    path = Path(os.path.expanduser(str(path)))
    spec = DatasetSpec(name=path.name, description=f"user dataset at {path}", dirname=path.name)
    if not path.is_dir():
        raise _not_found(spec, f"{path}, which is not a folder", None,
                         "pass the folder that holds these files")
    _, missing = dataset_files(path)
    if missing:
        raise _not_found(spec, str(path), missing, "add the missing files (plain or .xz/.gz/.bz2)")
    with gc_paused():
        return _load(spec, path)
