"""The raw-text layout of AttentionXML / LightXML: train_texts.txt, train_labels.txt, test_texts.txt and
test_labels.txt, line-aligned, labels separated by spaces, and an optional label_texts.tsv (xmcbench.data reads
it)."""

from __future__ import annotations

import re
from pathlib import Path

from xmcbench.data import Dataset, dataset_files, load_dataset_from_path
from xmcbench.errors import XmcError
from xmcbench.formats import DataFormat, FormatOptions, label_lists, write_label_table
from xmcbench.storage import atomic_write

NAME = "raw_text"
LINE_BREAK = re.compile(r"\r\n|[\r\n]")   # what the reader splits lines on; other Unicode breaks stay


def is_raw_text_folder(path: Path) -> bool:
    """A folder holding all four files of the layout (plain or compressed)."""
    if not path.is_dir():
        return False
    try:
        _, missing = dataset_files(path)
    except XmcError:   # train_raw_texts.txt without test_raw_texts.txt: this layout, read() says what is wrong
        return True
    return not missing


def read(path: Path, options: FormatOptions) -> Dataset:
    options.refuse(NAME, "text_column", "label_column", "label_separator", "id_column", "test_size")
    return load_dataset_from_path(path)


def one_line(text: str) -> str:
    """A text as one line of a text file: its line breaks become spaces."""
    return LINE_BREAK.sub(" ", text) if ("\n" in text or "\r" in text) else text


def write(dataset: Dataset, folder: Path, options: FormatOptions) -> None:
    options.refuse(NAME, "text_column", "label_column", "label_separator", "id_column", "test_size")
    # texts first: a raw-text dataset's train_features would read its features file to answer
    if not dataset.train_texts and dataset.train_features is not None:
        raise XmcError(f"dataset '{dataset.name}' has sparse features but no texts, and the raw_text layout holds "
                       "texts only; write it as xc_sparse or pecos instead")
    spaced = next((name for name in dataset.label_names if name != name.strip() or any(c in name for c in " \t\n\r")
                   or not name), None)
    if spaced is not None:
        raise XmcError(f"label {spaced!r} contains whitespace (or is empty), which the raw_text layout uses to "
                       "separate labels; write the dataset as delimited or pecos instead")
    for split, texts, labels in (("train", dataset.train_texts, dataset.train_labels),
                                 ("test", dataset.test_texts, dataset.test_labels)):
        text_lines = "".join(one_line(text) + "\n" for text in texts)
        label_lines = "".join(" ".join(row) + "\n" for row in label_lists(dataset, labels))
        atomic_write(folder / f"{split}_texts.txt", lambda temporary, t=text_lines: temporary.write_text(t, "utf-8"))
        atomic_write(folder / f"{split}_labels.txt", lambda temporary, t=label_lines: temporary.write_text(t, "utf-8"))
    write_label_table(dataset, folder)


FORMAT = DataFormat(
    name=NAME,
    description="train_texts.txt, train_labels.txt, test_texts.txt, test_labels.txt: one document per line, "
                "labels separated by spaces, optional label_texts.tsv (optionally .xz/.gz/.bz2)",
    detect=is_raw_text_folder, read=read, write=write)
