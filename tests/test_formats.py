"""Data formats: every built-in reader and writer, detection and its one-line errors, --test-size, round trips
of every format (property tests), the XC reader against a hand-written file, and a third party's format."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from xmcbench.cli import app
from xmcbench.data import Dataset
from xmcbench.errors import XmcError
from xmcbench.features import read_xc_sparse
from xmcbench.formats import DataFormat, FormatOptions, content_version, dataset_from_rows, detect_format, \
    label_lists, read_dataset, split_test, write_dataset
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import RegistrationError, build_registry
from xmcbench import saved as saved_models
from xmcbench.formats import open_dataset
from xmcbench.rundir import reading_of
from xmcbench.runs.plan import plan_run
from xmcbench.saved import rescore_run

cli = CliRunner()


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def plugin_module(name: str, **hooks) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, function in hooks.items():
        setattr(module, hook, hookimpl(function))
    return module


def xmcbench(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmcbench", *args], capture_output=True, text=True, cwd=cwd)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("xmcbench: error: "), result.stderr
    return lines[0]


def rows_of(dataset: Dataset, split: str) -> list[list[str]]:
    return [sorted(row) for row in label_lists(dataset, getattr(dataset, f"{split}_labels"))]


# -- registration -------------------------------------------------------------------------------------

def test_builtin_formats_are_registered_by_their_plugin(registry):
    assert list(registry.formats) == ["raw_text", "delimited", "xc_sparse", "pecos", "hf_datasets",
                                      "xc_label_features"]
    info = next(p for p in registry.plugins if p.name == "xmcbench-formats")
    assert info.hooks == ["xmcbench_register_formats"] and "format 'delimited'" in info.registered
    listed = cli.invoke(app, ["plugins"])
    assert "format 'xc_sparse'" in listed.output
    formats = cli.invoke(app, ["formats"])
    assert formats.exit_code == 0 and "hf_datasets" in formats.output and "xmcbench[hf]" in formats.output


def test_unknown_format_name_has_a_hint(registry):
    with pytest.raises(XmcError, match=r"unknown data format 'delimted': did you mean 'delimited'"):
        registry.format("delimted")


def test_registry_rejects_wrong_types_and_duplicates():
    bad = plugin_module("bad", xmcbench_register_formats=lambda registry: registry.add_format("csv"))
    registry = build_registry(extra_plugins=[("bad", bad)], load_entry_points=False)
    assert "not a DataFormat" in registry.failed[0].error
    fmt = DataFormat("twice", "", detect=lambda path: False, read=lambda path, options: None)
    first = plugin_module("one", xmcbench_register_formats=lambda registry: registry.add_format(fmt))
    second = plugin_module("two", xmcbench_register_formats=lambda registry: registry.add_format(fmt))
    registry = build_registry(extra_plugins=[("one", first), ("two", second)], load_entry_points=False)
    assert "format 'twice' is registered twice: by one (<in-process>) and by two (<in-process>)" \
        in registry.failed[0].error
    assert issubclass(RegistrationError, XmcError)


# -- delimited ------------------------------------------------------------------------------------------

def write_csv_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.csv").write_text('text,labels\n"hello, world",a|b\nsecond,b\nthird,c\n', encoding="utf-8")
    (folder / "test.csv").write_text('text,labels\nfoo,a\nbar,"c|z"\n', encoding="utf-8")
    return folder


def test_csv_folder_is_detected_and_read(registry, tmp_path):
    folder = write_csv_folder(tmp_path / "data")
    assert detect_format(registry, folder).name == "delimited"
    dataset = open_dataset(registry, str(folder))
    assert dataset.train_texts == ["hello, world", "second", "third"] and dataset.test_texts == ["foo", "bar"]
    assert rows_of(dataset, "train") == [["a", "b"], ["b"], ["c"]] and rows_of(dataset, "test") == [["a"], ["c", "z"]]
    assert dataset.label_names == ["a", "b", "c", "z"] and dataset.num_labels == 3
    assert dataset.report == {"unseen_test_labels": 1}


@pytest.mark.parametrize("cells, separator, expected", [
    (["a|b", "c"], None, [["a", "b"], ["c"]]),
    (["a, b", "c"], None, [["a", "b"], ["c"]]),
    (["a b", "c"], None, [["a", "b"], ["c"]]),
    (['["x, y", "z"]', "c|d"], None, [["x, y", "z"], ["c", "d"]]),
    (["a;b", "c"], ";", [["a", "b"], ["c"]]),
    (["", "c"], None, [[], ["c"]]),
])
def test_label_cells(tmp_path, registry, cells, separator, expected):
    import csv

    file = tmp_path / "all.csv"
    with open(file, "w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow(["body", "tags"])
        for i, cell in enumerate(cells * 2):
            writer.writerow([f"doc {i}", cell])
    options = FormatOptions(text_column="body", label_column="tags", label_separator=separator, test_size=0.5)
    dataset = read_dataset(registry, file, options)
    rows = {text: sorted(row) for text, row in zip(dataset.train_texts + dataset.test_texts,
                                                     rows_of(dataset, "train") + rows_of(dataset, "test"))}
    assert [rows[f"doc {i}"] for i in range(len(cells))] == [sorted(row) for row in expected]


def test_tsv_and_jsonl(registry, tmp_path):
    tsv = tmp_path / "tsv"
    tsv.mkdir()
    (tsv / "train.tsv").write_text("text\tlabels\nalpha beta\ta b\ngamma\tc\n")
    (tsv / "test.tsv").write_text("text\tlabels\ndelta\ta\n")
    dataset = read_dataset(registry, tsv)
    assert rows_of(dataset, "train") == [["a", "b"], ["c"]] and dataset.test_texts == ["delta"]
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    with gzip.open(jsonl / "train.jsonl.gz", "wt") as stream:   # compressed files are read too
        stream.write('{"text": "a doc", "label": ["x", 7]}\n\n{"text": "b doc", "label": "y|z"}\n')
    (jsonl / "test.jsonl").write_text('{"text": "c doc", "label": []}\n')
    dataset = read_dataset(registry, jsonl)
    assert rows_of(dataset, "train") == [["7", "x"], ["y", "z"]] and rows_of(dataset, "test") == [[]]


def test_column_errors_name_the_columns_and_the_option(registry, tmp_path):
    folder = write_csv_folder(tmp_path / "data")
    with pytest.raises(XmcError, match=r"has no column 'body' \(its columns: text, labels\); name the text column "
                                       r"with --text-column"):
        read_dataset(registry, folder, FormatOptions(text_column="body"))
    (folder / "test.csv").write_text("text,labels\nfoo,a,extra\n")
    with pytest.raises(XmcError, match=r"test.csv:2: the row has 3 fields but the header has 2"):
        read_dataset(registry, folder)


def test_test_size_is_seeded(registry, tmp_path):
    file = tmp_path / "all.csv"
    file.write_text("text,labels\n" + "".join(f"doc {i},l{i % 3}\n" for i in range(20)))
    first = read_dataset(registry, file, FormatOptions(test_size=0.25))
    again = read_dataset(registry, file, FormatOptions(test_size=0.25))
    other = read_dataset(registry, file, FormatOptions(test_size=0.25, seed=1))
    assert len(first.test_texts) == 5 and len(first.train_texts) == 15
    assert first.test_texts == again.test_texts and first.version == again.version
    assert first.test_texts != other.test_texts and first.version != other.version
    assert len(read_dataset(registry, file, FormatOptions(test_size=3)).test_texts) == 3
    with pytest.raises(XmcError, match="single file: pass --test-size"):
        read_dataset(registry, file)
    for bad in (0, 1.5, 20):
        with pytest.raises(XmcError, match="--test-size"):
            read_dataset(registry, file, FormatOptions(test_size=bad))


def test_test_size_keeps_groups_together(registry, tmp_path):
    file = tmp_path / "all.jsonl"
    records = [{"text": f"doc {i}", "labels": ["a"], "doc": f"g{i // 4}"} for i in range(40)]
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = read_dataset(registry, file, FormatOptions(test_size=0.3, id_column="doc"))
    group = {r["text"]: r["doc"] for r in records}
    train_groups = {group[t] for t in dataset.train_texts}
    test_groups = {group[t] for t in dataset.test_texts}
    assert not train_groups & test_groups and len(test_groups) == 3 and len(dataset.test_texts) == 12
    train, test = split_test(8, 0.5, seed=0, groups=["a", "a", "b", "b", "c", "c", "d", "d"])
    assert len(test) == 4 and all(len({i // 2 for i in test} & {i // 2 for i in train}) == 0 for _ in [0])


def test_options_change_the_version_and_are_refused_where_unused(registry, tmp_path):
    file = tmp_path / "all.csv"
    file.write_text("text,labels,more\n" + "".join(f"doc {i},l{i % 3},m{i % 2}\n" for i in range(10)))
    plain = read_dataset(registry, file, FormatOptions(test_size=0.2))
    other_column = read_dataset(registry, file, FormatOptions(test_size=0.2, label_column="more"))
    assert plain.version != other_column.version and other_column.label_names == ["m0", "m1"]
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, text in (("train_texts", "a\nb\n"), ("train_labels", "x\ny\n"), ("test_texts", "c\n"),
                       ("test_labels", "x\n")):
        (raw / f"{name}.txt").write_text(text)
    with pytest.raises(XmcError, match="the raw_text format does not use --test-size"):
        open_dataset(registry, str(raw), options=FormatOptions(test_size=0.5))
    with pytest.raises(XmcError, match="--text-column read a folder or file, not the registered dataset"):
        open_dataset(registry, "debian-debtags-mini", options=FormatOptions(text_column="body"))


# -- XC sparse, PECOS, Hugging Face ---------------------------------------------------------------------

XC_TRAIN = "4 5 6\n0,2 0:1.0 3:2.0\n 1:3\n5 2:0.5 4:0.25\n\n"   # doc 2 has no labels, doc 4 nothing at all
XC_TEST = "2 5 6\n2,4 1:1\n1 0:0.5\n"


def write_xc(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text(XC_TRAIN)
    (folder / "test.txt").write_text(XC_TEST)
    return folder


def test_xc_reader_against_a_hand_written_file(registry, tmp_path):
    parsed = read_xc_sparse(write_xc(tmp_path / "xc") / "train.txt")
    np.testing.assert_array_equal(parsed.features.toarray(), [[1, 0, 0, 2, 0], [0, 3, 0, 0, 0],
                                                              [0, 0, 0.5, 0, 0.25], [0, 0, 0, 0, 0]])
    assert parsed.features.dtype == np.float32 and parsed.labels.shape == (4, 6)
    assert [list(row.indices) for row in parsed.labels] == [[0, 2], [], [5], []]
    dataset = open_dataset(registry, str(tmp_path / "xc"))
    assert dataset.train_texts == [] and dataset.train_features.shape == (4, 5)
    assert dataset.label_names == ["0", "2", "5", "1", "4"] and dataset.num_labels == 3
    assert rows_of(dataset, "test") == [["2", "4"], ["1"]]
    assert dataset.report == {"empty_train_label_lines": 2, "unseen_test_labels": 2}


def test_xc_errors_are_one_line(registry, tmp_path):
    folder = write_xc(tmp_path / "xc")
    with pytest.raises(XmcError, match="has sparse features but no texts, and lightxml reads texts"):
        plan_run(registry, "lightxml", str(folder))   # the methods that read features: xmcbench-linear's
    (folder / "test.txt").write_text("3 5 6\n1 0:1\n")
    with pytest.raises(XmcError, match=r"header line 1 says 3 documents but the file has 1"):
        read_dataset(registry, folder)
    (folder / "test.txt").write_text("1 5 6\n1 9:1\n")
    with pytest.raises(XmcError, match="not a valid Extreme Classification Repository file"):
        read_dataset(registry, folder)


def test_pecos_with_texts_features_and_names(registry, tmp_path):
    folder = tmp_path / "pecos"
    folder.mkdir()
    (folder / "X.trn.txt").write_text("alpha\nbeta\n")
    (folder / "X.tst.txt").write_text("gamma\n")
    sp.save_npz(folder / "Y.trn.npz", sp.csr_matrix(np.array([[1, 0, 1], [0, 1, 0]], dtype=np.float32)))
    sp.save_npz(folder / "Y.tst.npz", sp.csr_matrix(np.array([[0, 0, 1]], dtype=np.float32)))
    sp.save_npz(folder / "X.trn.npz", sp.csr_matrix(np.eye(2, 4, dtype=np.float32)))
    sp.save_npz(folder / "X.tst.npz", sp.csr_matrix(np.ones((1, 4), dtype=np.float32)))
    (folder / "output-items.txt").write_text("red\ngreen\nblue\n")
    dataset = open_dataset(registry, str(folder))
    assert dataset.train_texts == ["alpha", "beta"] and rows_of(dataset, "train") == [["blue", "red"], ["green"]]
    assert dataset.train_features.shape == (2, 4) and dataset.test_features.shape == (1, 4)
    (folder / "output-items.txt").write_text("red\ngreen\n")
    with pytest.raises(XmcError, match="names 2 labels but the label matrices have 3 columns"):
        read_dataset(registry, folder)


def test_hf_datasets_without_the_package_says_how_to_install(registry, tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert detect_format(registry, folder).name == "hf_datasets"
    monkeypatch.setitem(sys.modules, "datasets", None)   # as if the optional package were not installed
    with pytest.raises(XmcError, match=r"needs the optional `datasets` package: pip install 'xmcbench\[hf\]'"):
        read_dataset(registry, folder)


@pytest.fixture(scope="module")
def hf_datasets():
    """Hugging Face's `datasets`, imported once past the repository's own datasets/ folder (which the test run's
    sys.path puts first); skipped when the optional package is not installed."""
    local = sys.modules.get("datasets")
    if local is not None and hasattr(local, "load_from_disk"):
        yield local
        return
    repository = str(Path(__file__).resolve().parents[1])
    saved_path = sys.path[:]
    sys.modules.pop("datasets", None)
    try:
        sys.path[:] = [p for p in sys.path if p not in ("", ".", repository)]
        try:
            import datasets as module
        except ImportError:
            module = None
    finally:
        sys.path[:] = saved_path
    if module is None or not hasattr(module, "load_from_disk"):
        if local is not None:
            sys.modules["datasets"] = local
        pytest.skip("Hugging Face's `datasets` is not installed")
    module.disable_progress_bars()
    yield module   # stays imported: a second import of the package would duplicate its classes
    if local is not None:
        sys.modules["datasets"] = local


def test_hf_datasets_single_split_and_class_labels(registry, tmp_path, hf_datasets):
    datasets = hf_datasets
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "topic": datasets.ClassLabel(names=["sports", "news"])})
    table = datasets.Dataset.from_dict({"sentence": [f"s{i}" for i in range(10)], "topic": [i % 2 for i in range(10)]},
                                       features=features)
    table.save_to_disk(str(tmp_path / "one"))
    dataset = open_dataset(registry, str(tmp_path / "one"),
                                  options=FormatOptions(text_column="sentence", label_column="topic", test_size=0.2))
    assert len(dataset.test_texts) == 2 and set(dataset.label_names) == {"sports", "news"}


# -- detection -------------------------------------------------------------------------------------------

def test_unknown_and_ambiguous_paths_end_in_one_line(tmp_path):
    folder = tmp_path / "nothing"
    folder.mkdir()
    (folder / "notes.md").write_text("hello\n")
    error = one_error_line(xmcbench("config", "lightxml", "--dataset", str(folder)))
    assert "is in no data format xmcbench recognises (registered formats: delimited, hf_datasets, pecos, raw_text, " \
           "xc_label_features, xc_sparse); choose one with --format NAME" in error
    both = write_xc(tmp_path / "both")
    write_csv_folder(both)
    error = one_error_line(xmcbench("config", "lightxml", "--dataset", str(both)))
    assert "looks like several data formats: delimited, xc_sparse; choose one with --format NAME" in error
    error = one_error_line(xmcbench("config", "lightxml", "--dataset", str(both), "--format", "delimted"))
    assert "unknown data format 'delimted': did you mean 'delimited'?" in error


def test_raw_text_layout_is_read_first_as_before(registry, tiny_dataset):
    write_csv_folder(tiny_dataset)   # a raw-text folder that also holds CSV files stays a raw-text folder
    dataset = open_dataset(registry, str(tiny_dataset))
    assert len(dataset.train_texts) == 48
    assert read_dataset(registry, tiny_dataset, FormatOptions(format_name="delimited")).train_texts[0] == \
        "hello, world"


# -- a third party's format -----------------------------------------------------------------------------

def tabtab_plugin():
    """The example of CONTRIBUTING.md: text, two tabs, tab-separated labels."""
    from xmcbench.data import read_texts

    def detect(path: Path) -> bool:
        return path.is_dir() and (path / "train.tt").is_file() and (path / "test.tt").is_file()

    def read(path: Path, options):
        options.refuse("tabtab", "text_column", "label_column", "label_separator", "id_column", "test_size")
        splits = {}
        for name in ("train", "test"):
            lines = [line.partition("\t\t") for line in read_texts(path / f"{name}.tt")]
            splits[name] = ([text for text, _, _ in lines], [labels.split("\t") if labels else []
                                                             for _, _, labels in lines])
        version = content_version([path / "train.tt", path / "test.tt"], "tabtab")
        return dataset_from_rows(path.name, version, *splits["train"], *splits["test"], str(path))

    def xmcbench_register_formats(registry):
        registry.add_format(DataFormat("tabtab", "train.tt / test.tt", detect=detect, read=read))

    return plugin_module("tabtab", xmcbench_register_formats=xmcbench_register_formats)


def test_a_third_party_format_is_detected_chosen_and_converted(tmp_path):
    registry = build_registry(extra_plugins=[("tabtab", tabtab_plugin())])
    folder = tmp_path / "tt"
    folder.mkdir()
    (folder / "train.tt").write_text("first doc\t\tx\ty\nsecond doc\t\ty\n")
    (folder / "test.tt").write_text("third doc\t\tx\n")
    assert detect_format(registry, folder).name == "tabtab"
    dataset = open_dataset(registry, str(folder), options=FormatOptions(format_name="tabtab"))
    assert rows_of(dataset, "train") == [["x", "y"], ["y"]]
    out = write_dataset(registry, dataset, tmp_path / "out", "delimited")
    assert read_dataset(registry, out).train_texts == ["first doc", "second doc"]
    with pytest.raises(XmcError, match="the tabtab format can be read but not written"):
        write_dataset(registry, dataset, tmp_path / "again", "tabtab")


# -- round trips ---------------------------------------------------------------------------------------

LABEL = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp")), min_size=1, max_size=6)
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)
ONE_LINE_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\r\n"), max_size=20)


@st.composite
def text_datasets(draw, text=TEXT, label=LABEL):
    names = draw(st.lists(label, min_size=1, max_size=5, unique=True))
    def split(min_size):
        return draw(st.lists(st.tuples(text, st.lists(st.sampled_from(names), max_size=3, unique=True)),
                             min_size=min_size, max_size=5))
    train, test = split(1), split(1)
    if not any(labels for _, labels in train):
        train[0] = (train[0][0], [names[0]])
    return ([t for t, _ in train], [sorted(r) for _, r in train], [t for t, _ in test], [sorted(r) for _, r in test])


def build(parts, features: bool = False, seed: int = 0) -> Dataset:
    train_texts, train_rows, test_texts, test_rows = parts
    dataset = dataset_from_rows("d", "v", train_texts, train_rows, test_texts, test_rows, "memory")
    if features:
        rng = np.random.default_rng(seed)
        dataset.train_features, dataset.test_features = (
            sp.csr_matrix(rng.random((len(texts), 6)) * (rng.random((len(texts), 6)) < 0.5), dtype=np.float32)
            for texts in (train_texts, test_texts))
        dataset.train_texts, dataset.test_texts = [], []
    return dataset


def round_trip(registry, dataset: Dataset, format_name: str, folder: Path) -> Dataset:
    write_dataset(registry, dataset, folder, format_name)
    assert detect_format(registry, folder).name == format_name
    return read_dataset(registry, folder)


def assert_same(original: Dataset, read_back: Dataset) -> None:
    assert read_back.train_texts == original.train_texts and read_back.test_texts == original.test_texts
    for split in ("train", "test"):
        assert rows_of(read_back, split) == rows_of(original, split)
        features = getattr(original, f"{split}_features")
        if features is not None:
            np.testing.assert_array_equal(getattr(read_back, f"{split}_features").toarray(), features.toarray())


ROUND_TRIP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# label names: the raw_text layout separates labels by whitespace, PECOS's output-items.txt has one per line
TEXT_FORMATS = [("delimited", TEXT, LABEL), ("pecos", ONE_LINE_TEXT, LABEL),
                ("raw_text", ONE_LINE_TEXT, st.text(st.characters(blacklist_categories=("Cs", "Cc", "Z")),
                                                     min_size=1, max_size=6))]


@pytest.mark.parametrize("format_name, text, label", TEXT_FORMATS, ids=[f for f, _, _ in TEXT_FORMATS])
def test_text_formats_round_trip(registry, tmp_path_factory, format_name, text, label):
    @ROUND_TRIP
    @given(parts=text_datasets(text=text, label=label))
    def check(parts):
        dataset = build(parts)
        assert_same(dataset, round_trip(registry, dataset, format_name, tmp_path_factory.mktemp(format_name)))

    check()


def test_hf_datasets_round_trip(registry, tmp_path_factory, hf_datasets):

    @settings(max_examples=5, deadline=None)
    @given(parts=text_datasets())
    def check(parts):
        dataset = build(parts)
        assert_same(dataset, round_trip(registry, dataset, "hf_datasets", tmp_path_factory.mktemp("hf")))

    check()


@pytest.mark.parametrize("format_name", ["xc_sparse", "pecos"])
def test_feature_formats_round_trip(registry, tmp_path_factory, format_name):
    @ROUND_TRIP
    @given(parts=text_datasets(label=st.integers(0, 30).map(str)), seed=st.integers(0, 100))
    def check(parts, seed):
        dataset = build(parts, features=True, seed=seed)
        assert_same(dataset, round_trip(registry, dataset, format_name, tmp_path_factory.mktemp(format_name)))

    check()


# -- convert and run -------------------------------------------------------------------------------------

def test_convert_on_the_command_line(tmp_path):
    source = tmp_path / "all.csv"
    source.write_text("body,tags\n" + "".join(f"doc {i},t{i % 3};t9\n" for i in range(10)))
    result = xmcbench("convert", str(source), str(tmp_path / "raw"), "--to", "raw_text", "--text-column", "body",
                      "--label-column", "tags", "--label-separator", ";", "--test-size", "0.3")
    assert result.returncode == 0, result.stderr
    assert "7 train / 3 test documents" in result.stdout
    assert set((tmp_path / "raw" / "train_labels.txt").read_text().split()) <= {"t0", "t1", "t2", "t9"}
    again = one_error_line(xmcbench("convert", str(tmp_path / "raw"), str(tmp_path / "raw"), "--to", "delimited"))
    assert "exists and is not an empty folder" in again
    unknown = one_error_line(xmcbench("convert", str(tmp_path / "raw"), str(tmp_path / "x"), "--to", "parquet"))
    assert "unknown data format 'parquet'" in unknown
    features = one_error_line(xmcbench("convert", str(tmp_path / "raw"), str(tmp_path / "x"), "--to", "xc_sparse"))
    assert "has no sparse features" in features


@pytest.mark.slow
def test_run_on_a_csv_folder(tiny_model_dir, tiny_dataset, tmp_path):
    registry = build_registry()
    folder = write_dataset(registry, open_dataset(registry, str(tiny_dataset)), tmp_path / "csv", "delimited",
                           FormatOptions(text_column="body"))
    settings_ = [f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1",
                 "max_length=32", "threads=1", "cluster_size=2", "top_clusters=2", "hidden_size=8"]
    args = ["run", "lightxml", "--dataset", str(folder), "--text-column", "body", "--output", str(tmp_path / "run")]
    for setting in settings_:
        args += ["--set", setting]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "P@1" in result.output
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["dataset_version"] == read_dataset(registry, folder, FormatOptions(text_column="body")).version
    without = cli.invoke(app, args[:4] + ["--print-config"])
    assert isinstance(without.exception, XmcError) and "has no column named 'text'" in str(without.exception)
    # the reading options are recorded, so what reads the run's dataset again reads it as the run did
    assert recorded["reading"]["text_column"] == "body"
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved_models.evaluate(tmp_path / "run", registry=registry)["P@1"] == pytest.approx(metrics["P@1"])
    assert rescore_run(tmp_path / "run", registry=registry, log=lambda line: None)["P@1"] == metrics["P@1"]
    assert reading_of(recorded) == FormatOptions(text_column="body")


# -- label texts and the XC repository's label-feature layout ------------------------------------------------

def write_files(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        raw = content.encode()
        (folder / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return folder


LF_FILES = {   # 3 train / 2 test documents, 5 label ids; label 4 is on no document
    "trn_X.txt": "B01->red shoes\nB02->blue shirt\nB03->red hat\n",   # uid prefixes, as some raw files carry
    "tst_X.txt": "green shoes\nred socks\n",
    "trn_X_Y.txt.gz": "3 5\n0:1 1:1\n1:1.0\n0:1 2:1\n",
    "tst_X_Y.txt": "2 5\n\n3:1\n",                                  # an empty line: a document without labels
    "Y.txt": "Shoes\nShirts\n\nSocks\nUnused\n",                       # label 2 has no text
    "filter_labels_test.txt": "0 1\n1 3\n1 3\n",                     # a repeated pair counts once
    "filter_labels_train.txt": "2 2\n",
}


def test_xc_label_features_against_a_hand_written_folder(registry, tmp_path):
    folder = write_files(tmp_path / "LF-tiny", LF_FILES)
    assert detect_format(registry, folder).name == "xc_label_features"   # and no other format claims it
    dataset = read_dataset(registry, folder)
    assert dataset.train_texts == ["red shoes", "blue shirt", "red hat"] and dataset.test_texts == ["green shoes",
                                                                                                    "red socks"]
    # label names are the ids; 0-2 are the training vocabulary, 3 is seen only in test, 4 on no document
    assert dataset.label_names == ["0", "1", "2", "3"] and dataset.num_labels == 3
    assert rows_of(dataset, "train") == [["0", "1"], ["1"], ["0", "2"]] and rows_of(dataset, "test") == [[], ["3"]]
    assert dataset.label_texts == ["Shoes", "Shirts", "2", "Socks"]
    assert dataset.test_filter.toarray().tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    assert dataset.train_filter.toarray().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    assert dataset.report == {"uid_prefixed_files": 1, "labels_without_text": 1, "unseen_test_labels": 1,
                              "empty_test_label_lines": 1}
    assert dataset.train_features is None
    changed = write_files(tmp_path / "changed", {**LF_FILES, "filter_labels_test.txt": "0 1\n"})
    assert read_dataset(registry, changed).version != dataset.version   # the filters are part of the version


def test_xc_label_features_reads_bag_of_words_features(registry, tmp_path):
    files = {name: content for name, content in LF_FILES.items() if not name.endswith("_X.txt")}
    folder = write_files(tmp_path / "bow", {**files, "trn_X_Xf.txt": "3 4\n0:0.5 3:1\n1:1\n\n",
                                            "tst_X_Xf.txt": "2 4\n2:0.25\n0:1\n"})
    dataset = read_dataset(registry, folder)
    assert dataset.train_texts == [] and dataset.train_features.toarray().tolist() == \
        [[0.5, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert dataset.test_features.shape == (2, 4)


def test_other_formats_are_not_taken_for_the_label_feature_layout(registry, tmp_path):
    xc = write_files(tmp_path / "xc", {"train.txt": "2 3 2\n0 0:1\n1 1:1\n", "test.txt": "1 3 2\n0 2:1\n"})
    assert detect_format(registry, xc).name == "xc_sparse"
    # trn_X_Y.txt with the three-number header of train.txt is not this layout's label matrix
    wrong = write_files(tmp_path / "wrong", {**LF_FILES, "trn_X_Y.txt.gz": "3 4 5\n0 0:1\n1 1:1\n2 2:1\n"})
    with pytest.raises(XmcError, match="is in no data format xmcbench recognises"):
        detect_format(registry, wrong)
    with pytest.raises(XmcError, match="trn_X_Y.txt.gz: line 1 is not the 'N C' .rows, columns. header"):
        read_dataset(registry, wrong, FormatOptions(format_name="xc_label_features"))


def label_text_rows(dataset: Dataset, split: str) -> list[list[str]]:
    """Each document's labels as their texts: what survives a format that renames labels (to ids)."""
    texts = dict(zip(dataset.label_names, dataset.label_texts))
    return [sorted(texts[name] for name in row) for row in rows_of(dataset, split)]


def dataset_with_label_texts(features: bool = False) -> Dataset:
    dataset = dataset_from_rows("d", "v", ["red shoes", "blue\tshirt", "hat"], [["shoes"], ["shirts", "shoes"], []],
                                ["green shoes", "socks"], [["shoes"], ["socks"]], "memory")
    dataset.label_texts = ["Shirts, tops", "footwear\twith a tab", "socks"]   # label_names: shirts, shoes, socks
    if features:
        dataset.train_features = sp.csr_matrix(np.eye(3, 4, dtype=np.float32))
        dataset.test_features = sp.csr_matrix(np.eye(2, 4, dtype=np.float32))
        dataset.train_texts, dataset.test_texts = [], []
    return dataset


@pytest.mark.parametrize("format_name", ["raw_text", "delimited", "pecos", "xc_sparse", "xc_label_features",
                                         "hf_datasets"])
def test_writers_carry_label_texts(registry, tmp_path, format_name, request):
    if format_name == "hf_datasets":
        request.getfixturevalue("hf_datasets")
    dataset = dataset_with_label_texts(features=format_name == "xc_sparse")
    read_back = round_trip(registry, dataset, format_name, tmp_path / format_name)
    assert read_back.label_texts is not None
    for split in ("train", "test"):
        assert label_text_rows(read_back, split) == label_text_rows(dataset, split)
    if format_name not in ("xc_label_features", "xc_sparse"):   # the layouts whose label names are ids
        assert dict(zip(read_back.label_names, read_back.label_texts)) == dict(zip(dataset.label_names,
                                                                                  dataset.label_texts))


def test_the_label_feature_layout_keeps_filters_and_names(registry, tmp_path):
    dataset = dataset_with_label_texts()
    dataset.label_texts = None
    dataset.test_filter = sp.csr_matrix(np.array([[0, 1, 1], [1, 0, 0]], dtype=np.float32))
    read_back = round_trip(registry, dataset, "xc_label_features", tmp_path / "lf")
    assert read_back.label_texts == dataset.label_names   # names that are not ids survive as the labels' texts
    assert label_text_rows(read_back, "test") == [["shoes"], ["socks"]]
    texts = np.array(read_back.label_texts)
    filtered = sp.csr_matrix(read_back.test_filter)
    assert [sorted(texts[filtered.indices[filtered.indptr[i]:filtered.indptr[i + 1]]]) for i in range(2)] == \
        [["shoes", "socks"], ["shirts"]]
    assert read_back.train_filter is None


def test_label_texts_option_for_a_single_file(registry, tmp_path):
    data_file = tmp_path / "tickets.csv"
    data_file.write_text("text,labels\n" + "".join(f"doc {i},t{i % 3}\n" for i in range(10)))
    table = write_files(tmp_path / "a", {"labels.tsv": "t0\tprinters\nt1\tnetwork\nt9\ta label no ticket has\n"})
    options = FormatOptions(test_size=0.3, label_texts=str(table / "labels.tsv"))
    dataset = open_dataset(registry, str(data_file), options=options)
    assert dict(zip(dataset.label_names, dataset.label_texts)) == {"t0": "printers", "t1": "network", "t2": "t2"}
    assert dataset.report == {"labels_without_text": 1, "label_texts_unused": 1}
    plain = open_dataset(registry, str(data_file), options=FormatOptions(test_size=0.3))
    assert plain.label_texts is None and plain.version != dataset.version
    # the version follows the table's contents, not where it lies; a relative path is kept absolute
    moved = write_files(tmp_path / "b", {"t.tsv": (table / "labels.tsv").read_text()})
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        relative = FormatOptions(test_size=0.3, label_texts=str(Path(moved.name) / "t.tsv"))
    assert open_dataset(registry, str(data_file), options=relative).version == dataset.version
    assert relative.label_texts == str(moved / "t.tsv")
    edited = write_files(tmp_path / "c", {"t.tsv": "t0\tprinting\n"})
    assert open_dataset(registry, str(data_file), options=FormatOptions(
        test_size=0.3, label_texts=str(edited / "t.tsv"))).version != dataset.version


def test_a_dataset_with_its_own_label_texts_refuses_the_option(registry, tmp_path):
    folder = write_files(tmp_path / "raw", {"train_texts.txt": "a\nb\n", "train_labels.txt": "x\ny\n",
                                            "test_texts.txt": "c\n", "test_labels.txt": "x\n",
                                            "label_texts.tsv": "x\tex\n"})
    table = write_files(tmp_path / "t", {"other.tsv": "x\tanother\n"})
    with pytest.raises(XmcError, match="carries label texts of its own .from label_texts.tsv.; drop --label-texts"):
        open_dataset(registry, str(folder), options=FormatOptions(label_texts=str(table / "other.tsv")))
    lf = write_files(tmp_path / "lf", LF_FILES)
    with pytest.raises(XmcError, match="carries label texts of its own .from its xc_label_features files."):
        open_dataset(registry, str(lf), options=FormatOptions(label_texts=str(table / "other.tsv")))
    (lf / "label_texts.tsv").write_text("0\tshoes\n")
    with pytest.raises(XmcError, match="holds Y.txt and label_texts.tsv, two sources of label texts; keep one"):
        open_dataset(registry, str(lf))
    with pytest.raises(XmcError, match="read a folder or file, not the registered dataset"):
        open_dataset(registry, "debian-debtags-mini", options=FormatOptions(label_texts=str(table / "o.tsv")))


def test_convert_carries_label_texts_and_says_what_it_leaves_out(tmp_path):
    source = write_files(tmp_path / "raw", {"train_texts.txt": "a\nb\n", "train_labels.txt": "x\ny\n",
                                            "test_texts.txt": "c\n", "test_labels.txt": "x\n",
                                            "label_texts.tsv.xz": ""})
    (source / "label_texts.tsv.xz").unlink()
    import lzma

    (source / "label_texts.tsv.xz").write_bytes(lzma.compress("x\tthe x label\ny\twhy\n".encode()))
    result = xmcbench("convert", str(source), str(tmp_path / "csv"), "--to", "delimited")
    assert result.returncode == 0 and "2 labels with texts" in result.stdout, result.stderr
    assert xmcbench("convert", str(tmp_path / "csv"), str(tmp_path / "back"), "--to", "raw_text").returncode == 0
    assert (tmp_path / "back" / "label_texts.tsv").read_text() == "x\tthe x label\ny\twhy\n"
    lf = write_files(tmp_path / "lf", LF_FILES)
    result = xmcbench("convert", str(lf), str(tmp_path / "lf-raw"), "--to", "raw_text")
    assert result.returncode == 0 and \
        "not written (raw_text has no place for them): filtered (document, label) pairs" in result.stdout
    result = xmcbench("convert", str(lf), str(tmp_path / "lf-again"), "--to", "xc_label_features")
    assert result.returncode == 0 and "not written" not in result.stdout
    assert (tmp_path / "lf-again" / "filter_labels_test.txt").read_text() == "0 1\n1 3\n"
    labelled = open_dataset(build_registry(), str(tmp_path / "lf-raw"))
    assert labelled.label_texts == ["Shoes", "Shirts", "2", "Socks"] and labelled.test_filter is None
