"""CSV, TSV and JSON-lines files: one document per row, a text column and a label column.

A dataset is a folder with train.csv and test.csv (or .tsv, .jsonl, each optionally .xz/.gz/.bz2), or a
single file (or a folder holding exactly one such file) split with --test-size.

Label cells: a JSON list (["a", "b"], also a JSON array value in JSON lines) is taken as it is (its items
strings or numbers: an object or a nested list is refused, it names no label); any other cell is split on
--label-separator, or, when none is given, on "|" if some label cell of the dataset contains one, else on
"," if some cell contains one, else on whitespace. Labels are stripped of surrounding whitespace and empty
ones dropped, so an empty cell is a document without labels.

Bytes that are not UTF-8 are repaired as U+FFFD and counted, as the raw-text reader counts them: the lines
(of the file, not rows) that held some, `non_utf8_lines` in the dataset's report.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from itertools import chain
from pathlib import Path

from xmcbench.data import Dataset
from xmcbench.errors import XmcError
from xmcbench.data import LABEL_TEXTS_FILES
from xmcbench.formats import DataFormat, FormatOptions, content_version, dataset_from_rows, label_lists, split_test, \
    write_label_table
from xmcbench.storage import atomic_write, open_binary

NAME = "delimited"
KINDS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
COMPRESSED = (".xz", ".gz", ".bz2")
TEXT_COLUMNS = ("text",)
LABEL_COLUMNS = ("labels", "label")
SEPARATORS = ("|", ",")   # tried in this order when --label-separator is not given; whitespace last


def kind_of(file: Path) -> str | None:
    """csv, tsv or jsonl from the file's name (a compression suffix is looked through), else None."""
    name = file.name.lower()
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return next((kind for suffix, kind in KINDS.items() if name.endswith(suffix)), None)


def stem_of(file: Path) -> str:
    name = file.name.lower()
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return name.rsplit(".", 1)[0]


def data_files(path: Path) -> dict[str, list[Path]] | None:
    """{"train": [file], "test": [file]} for a train/test pair, {"all": [file]} for a single file, else None."""
    if path.is_file():
        return {"all": [path]} if kind_of(path) else None
    if not path.is_dir():
        return None
    files = sorted(file for file in path.iterdir() if file.is_file() and kind_of(file) and not is_label_table(file))
    by_stem = {split: [file for file in files if stem_of(file) == split] for split in ("train", "test")}
    if len(by_stem["train"]) == 1 and len(by_stem["test"]) == 1:
        return {"train": by_stem["train"], "test": by_stem["test"]}
    if len(files) == 1:
        return {"all": files}
    return None


def is_label_table(file: Path) -> bool:
    """The folder's table of label texts (label_texts.tsv, .csv, .jsonl), which holds no documents."""
    name = file.name
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return name in LABEL_TEXTS_FILES


def detect(path: Path) -> bool:
    return data_files(path) is not None


# ---------------------------------------------------------------------------------------------- reading

class Table:
    """The cells of one file that a dataset needs: texts (N,), raw label cells (N,), ids (N,) or None, and
    the count of the file's lines that held bytes that are not UTF-8."""

    def __init__(self, file: Path, texts: list[str], label_cells: list, ids: list[str] | None,
                 non_utf8_lines: int = 0) -> None:
        self.file, self.texts, self.label_cells, self.ids = file, texts, label_cells, ids
        self.non_utf8_lines = non_utf8_lines


def pick_column(file: Path, columns: list[str], chosen: str | None, defaults: tuple[str, ...], what: str,
                flag: str) -> str | None:
    if chosen is not None:
        if chosen not in columns:
            raise XmcError(f"{file} has no column {chosen!r} (its columns: {', '.join(columns) or 'none'}); "
                           f"name the {what} column with {flag}")
        return chosen
    found = next((name for name in defaults if name in columns), None)
    if found is None and defaults:
        raise XmcError(f"{file} has no column named {' or '.join(repr(d) for d in defaults)} (its columns: "
                       f"{', '.join(columns) or 'none'}); name the {what} column with {flag}")
    return found


def read_table(file: Path, options: FormatOptions) -> Table:
    kind = kind_of(file)
    try:
        with open_binary(file) as stream:
            text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="replace", newline="")
            if kind == "jsonl":
                table = _read_jsonl(file, text, options)
            else:
                table = _read_csv(file, text, options, "\t" if kind == "tsv" else ",")
        if _has_replacement(table):   # rare: only then read the file again to count the lines repaired
            table.non_utf8_lines = _non_utf8_lines(file)
        return table
    except (OSError, EOFError, ValueError) as error:   # ValueError: a corrupt compressed stream (lzma, zlib)
        if isinstance(error, XmcError):
            raise
        raise XmcError(f"cannot read {file}: {error}; check the file, or decompress it by hand") from None


def _has_replacement(table: Table) -> bool:
    """Whether a cell the dataset keeps holds U+FFFD, the character bad UTF-8 is repaired to."""
    cells = chain(table.texts, table.ids or (), chain.from_iterable(
        cell if isinstance(cell, list) else (cell,) for cell in table.label_cells))
    return any(isinstance(cell, str) and "\ufffd" in cell for cell in cells)


def _non_utf8_lines(file: Path) -> int:
    """The lines of a file (ended by \\n) that are not valid UTF-8: a \\n is never part of a multi-byte
    character, so a line holds whole characters."""
    count = 0
    with open_binary(file) as stream:
        for line in stream:
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                count += 1
    return count


def _read_csv(file: Path, text, options: FormatOptions, delimiter: str) -> Table:
    # a document may be longer than the csv module's default limit of 128 KiB per field
    csv.field_size_limit(sys.maxsize)
    reader = csv.reader(text, delimiter=delimiter)
    try:
        columns = next(reader, None)
        if columns is None:
            raise XmcError(f"{file} is empty; it needs a header row naming its columns, then one row per document")
        text_column = pick_column(file, columns, options.text_column, TEXT_COLUMNS, "text", "--text-column")
        label_column = pick_column(file, columns, options.label_column, LABEL_COLUMNS, "label", "--label-column")
        id_column = pick_column(file, columns, options.id_column, (), "id", "--id-column")
        wanted = [columns.index(name) for name in (text_column, label_column, id_column) if name is not None]
        texts, label_cells, ids = [], [], [] if id_column is not None else None
        for row in reader:
            if not row:   # the csv module's blank line: no document
                continue
            if len(row) != len(columns):
                raise XmcError(f"{file}:{reader.line_num}: the row has {len(row)} fields but the header has "
                               f"{len(columns)}; quote fields that contain the delimiter or line breaks")
            cells = [row[i] for i in wanted]
            texts.append(cells[0])
            label_cells.append(cells[1])
            if ids is not None:
                ids.append(cells[2])
    except csv.Error as error:
        raise XmcError(f"{file}:{reader.line_num}: {error}; check the quoting of that row") from None
    return Table(file, texts, label_cells, ids)


def _read_jsonl(file: Path, text, options: FormatOptions) -> Table:
    texts, label_cells, ids = [], [], [] if options.id_column is not None else None
    columns = None
    for line_number, line in enumerate(text, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise XmcError(f"{file}:{line_number}: not a JSON object ({error.msg}); write one JSON object per "
                           "line") from None
        if not isinstance(record, dict):
            raise XmcError(f"{file}:{line_number}: a JSON {type(record).__name__}, not an object; write one JSON "
                           "object per line")
        if columns is None:
            columns = list(record)
            text_column = pick_column(file, columns, options.text_column, TEXT_COLUMNS, "text", "--text-column")
            label_column = pick_column(file, columns, options.label_column, LABEL_COLUMNS, "label",
                                       "--label-column")
            pick_column(file, columns, options.id_column, (), "id", "--id-column")
        missing = [name for name in (text_column, label_column, options.id_column)
                   if name is not None and name not in record]
        if missing:
            raise XmcError(f"{file}:{line_number}: the object has no {missing[0]!r}; every line needs the text and "
                           "label fields")
        value = record[text_column]
        texts.append(value if isinstance(value, str) else "" if value is None else str(value))
        label_cells.append(record[label_column])
        if ids is not None:
            ids.append(str(record[options.id_column]))
    if columns is None:
        raise XmcError(f"{file} is empty; write one JSON object per line, e.g. "
                       '{"text": "...", "labels": ["a", "b"]}')
    return Table(file, texts, label_cells, ids)


def json_list(cell) -> list | None:
    """The list a cell holds as JSON (a JSON array value, or a string "[...]"), else None."""
    if isinstance(cell, list):
        return cell
    if isinstance(cell, str) and cell.startswith("[") and cell.endswith("]"):
        try:
            value = json.loads(cell)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, list) else None
    return None


def choose_separator(cells, given: str | None) -> str | None:
    """The label separator: the one given, else the first of SEPARATORS some plain cell contains; None means
    whitespace."""
    if given is not None:
        if given == "":
            raise XmcError("--label-separator is empty; give the character between labels, e.g. '|' or ','")
        return given
    plain = [cell for cell in cells if isinstance(cell, str) and json_list(cell) is None]
    return next((sep for sep in SEPARATORS if any(sep in cell for cell in plain)), None)


def split_cell(cell, separator: str | None) -> list[str]:
    """A label cell as a list of label names (see the module docstring); a cell that names no label (a JSON
    object, or a list holding one or a list) is a ValueError saying what it holds."""
    listed = json_list(cell)
    if listed is not None:
        nested = next((item for item in listed if isinstance(item, (dict, list))), None)
        if nested is not None:
            raise ValueError(f"its list holds a JSON {'object' if isinstance(nested, dict) else 'list'} "
                             f"({json.dumps(nested, ensure_ascii=False)[:60]})")
        labels = ["" if item is None else item if isinstance(item, str) else json.dumps(item) for item in listed]
    elif cell is None:
        return []
    elif isinstance(cell, str):
        labels = cell.split(separator) if separator is not None else cell.split()
    elif isinstance(cell, dict):
        raise ValueError(f"it holds a JSON object ({json.dumps(cell, ensure_ascii=False)[:60]})")
    else:   # a number or a boolean in JSON lines: one label
        labels = [json.dumps(cell)]
    return [label for label in (name.strip() for name in labels) if label]


def rows_from_cells(cells: list, separator: str | None, where: Path) -> list[list[str]]:
    """Each label cell as a list of label names; a cell that names no label ends in one XmcError line that
    names `where` (the file) and the document."""
    rows = []
    for document, cell in enumerate(cells, start=1):
        try:
            rows.append(split_cell(cell, separator))
        except ValueError as error:
            raise XmcError(f"{where}: the label cell of document {document} names no label: {error}; a label "
                           'cell is a list of label names (strings or numbers, e.g. ["a", "b"]) or a string of '
                           "them") from None
    return rows


def read(path: Path, options: FormatOptions) -> Dataset:
    files = data_files(path)
    if files is None:
        raise XmcError(f"{path} holds no train/test pair (train.csv and test.csv, or .tsv/.jsonl) and not exactly "
                       "one .csv/.tsv/.jsonl file; see docs/data-formats.md")
    tables = {split: read_table(found[0], options) for split, found in files.items()}
    separator = choose_separator([cell for table in tables.values() for cell in table.label_cells],
                                 options.label_separator)
    if "all" in tables:
        table = tables["all"]
        if options.test_size is None:
            raise XmcError(f"{table.file} is a single file: pass --test-size (a share such as 0.2, or a number of "
                           "rows) to split it into training and test documents, or give train and test files")
        train, test = split_test(len(table.texts), options.test_size, options.seed, table.ids)
        rows = rows_from_cells(table.label_cells, separator, table.file)
        train_texts, train_rows = [table.texts[i] for i in train], [rows[i] for i in train]
        test_texts, test_rows = [table.texts[i] for i in test], [rows[i] for i in test]
    else:
        if options.test_size is not None:
            raise XmcError(f"{path} has train and test files already; --test-size splits a single file, drop it")
        train_texts, train_rows = tables["train"].texts, rows_from_cells(tables["train"].label_cells, separator,
                                                                         tables["train"].file)
        test_texts, test_rows = tables["test"].texts, rows_from_cells(tables["test"].label_cells, separator,
                                                                      tables["test"].file)
    name = stem_of(path) if path.is_file() else path.name
    version = content_version([found[0] for found in files.values()], NAME, options.given())
    repaired = sum(table.non_utf8_lines for table in tables.values())
    return dataset_from_rows(name, version, train_texts, train_rows, test_texts, test_rows, str(path),
                             report={"non_utf8_lines": repaired} if repaired else None)


# ---------------------------------------------------------------------------------------------- writing

def plain_labels_fit(label_names: list[str], separator: str) -> bool:
    """Whether every label survives being written joined by `separator` and read back by detection."""
    return all(name and name == name.strip() and not name.startswith("[") and separator not in name
               and not any(other in name for other in SEPARATORS) and not any(c.isspace() for c in name)
               for name in label_names)


def write(dataset: Dataset, folder: Path, options: FormatOptions) -> None:
    """train.csv and test.csv with a text and a label column. Labels are joined by --label-separator (default
    "|") when every label name survives it, else written as JSON lists. Label texts go to label_texts.tsv
    (write_label_table)."""
    options.refuse(NAME, "id_column", "test_size")
    if not dataset.train_texts and dataset.train_features is not None:
        raise XmcError(f"dataset '{dataset.name}' has sparse features but no texts, and the delimited format holds "
                       "texts; write it as xc_sparse or pecos instead")
    text_column = options.text_column or TEXT_COLUMNS[0]
    label_column = options.label_column or LABEL_COLUMNS[0]
    if text_column == label_column:
        raise XmcError(f"--text-column and --label-column are both {text_column!r}; name two different columns")
    separator = options.label_separator or "|"
    as_json = not plain_labels_fit(dataset.label_names, separator)
    for split, texts, labels in (("train", dataset.train_texts, dataset.train_labels),
                                 ("test", dataset.test_texts, dataset.test_labels)):
        rows = label_lists(dataset, labels)

        def write_file(temporary: Path, texts=texts, rows=rows) -> None:
            with open(temporary, "w", encoding="utf-8", newline="") as stream:
                writer = csv.writer(stream)
                writer.writerow([text_column, label_column])
                for text, row in zip(texts, rows):
                    writer.writerow([text, json.dumps(row, ensure_ascii=False) if as_json else separator.join(row)])

        atomic_write(folder / f"{split}.csv", write_file)
    write_label_table(dataset, folder)


FORMAT = DataFormat(
    name=NAME,
    description="CSV / TSV / JSON lines: train.csv + test.csv (or one file and --test-size); columns from "
                "--text-column (default text) and --label-column (default labels or label)",
    detect=detect, read=read, write=write)
