"""Hugging Face `datasets` folders written by `save_to_disk`: a DatasetDict with "train" and "test" splits,
or one Dataset (or a DatasetDict with one split) split with --test-size. Columns as for delimited files:
--text-column (default text), --label-column (default labels or label) holding lists of names or ids,
class labels, or strings split like delimited label cells.

Reading needs the optional `datasets` package (`pip install 'xmcbench[hf]'`); recognising the folder does not.
"""

from __future__ import annotations

from pathlib import Path

from xmcbench.data import Dataset
from xmcbench.errors import XmcError, joined_line
from xmcbench.formats import DataFormat, FormatOptions, content_version, dataset_from_rows, label_lists, split_test, \
    write_label_table
from xmcbench_formats.delimited import LABEL_COLUMNS, TEXT_COLUMNS, choose_separator, pick_column, rows_from_cells

NAME = "hf_datasets"
EXTRA = "hf"
INSTALL_HINT = f"pip install 'xmcbench[{EXTRA}]'"


def detect(path: Path) -> bool:
    """A save_to_disk folder: dataset_dict.json (DatasetDict) or state.json + dataset_info.json (Dataset)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def import_datasets():
    try:
        import datasets
    except ImportError:
        raise XmcError(f"reading and writing Hugging Face datasets folders needs the optional `datasets` package: "
                       f"{INSTALL_HINT}") from None
    if not hasattr(datasets, "load_from_disk"):   # e.g. a folder named datasets/ in the working directory
        raise XmcError(f"the `datasets` module found at {getattr(datasets, '__file__', '?')} is not Hugging Face's; "
                       f"run from another folder, or {INSTALL_HINT}")
    return datasets


def _label_decoder(feature):
    """A function from a stored label value to label names: class ids become their class names."""
    datasets = import_datasets()
    inner = getattr(feature, "feature", None)
    if isinstance(feature, datasets.ClassLabel):
        return lambda value: [] if value is None or value < 0 else [feature.int2str(value)]
    if isinstance(feature, (datasets.Sequence, list)) or inner is not None:
        element = inner if inner is not None else (feature[0] if isinstance(feature, list) and feature else None)
        if isinstance(element, datasets.ClassLabel):
            return lambda values: [element.int2str(v) for v in values or []]
    return None


def read(path: Path, options: FormatOptions) -> Dataset:
    datasets = import_datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as error:
        raise XmcError(f"cannot read {path} with datasets.load_from_disk ({joined_line(error)}); check "
                       "that it is a folder written by save_to_disk") from None
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"all": loaded}
    if set(splits) >= {"train", "test"}:
        if options.test_size is not None:
            raise XmcError(f"{path} has train and test splits already; --test-size splits a single split, drop it")
        parts = {"train": splits["train"], "test": splits["test"]}
    elif len(splits) == 1:
        parts = {"all": next(iter(splits.values()))}
    else:
        raise XmcError(f"{path} has the splits {', '.join(splits)}; xmcbench reads 'train' and 'test', or a single "
                       "split with --test-size")
    tables = {}
    for split, table in parts.items():
        columns = list(table.column_names)
        where = Path(f"{path} ({split} split)") if split != "all" else path
        text_column = pick_column(where, columns, options.text_column, TEXT_COLUMNS, "text", "--text-column")
        label_column = pick_column(where, columns, options.label_column, LABEL_COLUMNS, "label", "--label-column")
        id_column = pick_column(where, columns, options.id_column, (), "id", "--id-column")
        texts = ["" if text is None else str(text) for text in table[text_column]]
        decode = _label_decoder(table.features[label_column])
        cells = table[label_column]
        ids = [str(value) for value in table[id_column]] if id_column else None
        tables[split] = (texts, cells, decode, ids, where)
    separator = choose_separator([cell for _, cells, decode, _, _ in tables.values() if decode is None
                                  for cell in cells], options.label_separator)

    def rows(split: str) -> list[list[str]]:
        _, cells, decode, _, where = tables[split]
        return [decode(cell) for cell in cells] if decode is not None else rows_from_cells(cells, separator, where)

    files = sorted(file for file in path.rglob("*") if file.is_file())
    version = content_version(files, NAME, options.given())
    if "all" in tables:
        texts, _, _, ids, _ = tables["all"]
        if options.test_size is None:
            raise XmcError(f"{path} holds a single split: pass --test-size (a share such as 0.2, or a number of rows) "
                           "to split it into training and test documents")
        train, test = split_test(len(texts), options.test_size, options.seed, ids)
        all_rows = rows("all")
        return dataset_from_rows(path.name, version, [texts[i] for i in train], [all_rows[i] for i in train],
                                 [texts[i] for i in test], [all_rows[i] for i in test], str(path))
    return dataset_from_rows(path.name, version, tables["train"][0], rows("train"), tables["test"][0], rows("test"),
                             str(path))


def write(dataset: Dataset, folder: Path, options: FormatOptions) -> None:
    """A DatasetDict with train and test splits, columns text and labels (a list of names per document); label
    texts in label_texts.tsv beside (write_label_table)."""
    datasets = import_datasets()
    options.refuse(NAME, "label_separator", "id_column", "test_size")
    if not dataset.train_texts and dataset.train_features is not None:
        raise XmcError(f"dataset '{dataset.name}' has sparse features but no texts; write it as xc_sparse or pecos")
    text_column = options.text_column or TEXT_COLUMNS[0]
    label_column = options.label_column or LABEL_COLUMNS[0]
    features = datasets.Features({text_column: datasets.Value("string"),
                                  label_column: datasets.Sequence(datasets.Value("string"))})
    splits = {split: datasets.Dataset.from_dict(
        {text_column: list(getattr(dataset, f"{split}_texts")),
         label_column: label_lists(dataset, getattr(dataset, f"{split}_labels"))}, features=features)
        for split in ("train", "test")}
    datasets.disable_progress_bars()   # convert prints one line of its own; the library's bars go to stderr
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    write_label_table(dataset, folder)


FORMAT = DataFormat(
    name=NAME,
    description="Hugging Face datasets folder from save_to_disk (train and test splits, or one split and "
                "--test-size); --text-column / --label-column as for delimited",
    detect=detect, read=read, write=write, extra=EXTRA)
