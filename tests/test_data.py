"""Dataset layer: the shipped Debian datasets and every reading policy of xmcbench.data, on tiny files."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import importlib.resources
import importlib.util
import json
import lzma
import re
from pathlib import Path

import numpy as np
import pytest

from xmcbench.registry import build_registry
from xmcbench import data
from xmcbench.data import (
    DatasetSpec,
    data_dir_from_env,
    load_dataset,
    load_dataset_from_path,
    read_label_lines,
    read_texts,
    resolve_files,
)
from xmcbench.errors import XmcError

REPO = Path(__file__).resolve().parents[1]


def _datasets_root():
    """The installed package ``xmcbench_datasets``; the repository folder in a checkout that is not installed."""
    try:
        return importlib.resources.files("xmcbench_datasets")
    except ModuleNotFoundError:
        return REPO / "datasets"


def _mini_spec() -> DatasetSpec:
    return DatasetSpec(name="debian-debtags-mini", description="", dirname="debian-debtags-mini",
                       embedded=_datasets_root() / "debian-debtags-mini")


def _write(folder: Path, files: dict[str, str | bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        raw = content.encode() if isinstance(content, str) else content
        if name.endswith(".xz"):
            raw = lzma.compress(raw)
        elif name.endswith(".gz"):
            raw = gzip.compress(raw)
        elif name.endswith(".bz2"):
            raw = bz2.compress(raw)
        (folder / name).write_bytes(raw)
    return folder


def _tiny(folder: Path, changes: dict[str, str | bytes | None] | None = None) -> Path:
    """A valid 3-train / 2-test dataset; ``changes`` maps a file name to new contents, or to None to drop it."""
    files: dict[str, str | bytes | None] = {
        "train_texts.txt": "alpha beta\ngamma\ndelta epsilon\n",
        "train_labels.txt": "a b\nb\nc\n",
        "test_texts.txt": "alpha\nzeta\n",
        "test_labels.txt": "a\nb z\n",
    }
    files.update(changes or {})
    return _write(folder, {k: v for k, v in files.items() if v is not None})


# ------------------------------------------------------------------------------------------- shipped data


@pytest.fixture(scope="module")
def mini():
    return load_dataset(_mini_spec())


def test_mini_matches_stats_json(mini):
    stats = json.loads((_datasets_root() / "debian-debtags-mini" / "stats.json").read_text())
    assert len(mini.train_texts) == mini.train_labels.shape[0] == stats["n_train"] == 4244
    assert len(mini.test_texts) == mini.test_labels.shape[0] == stats["n_test"] == 1206
    assert mini.num_labels == stats["n_labels_train"] == 506
    assert len(mini.label_names) == stats["n_labels"] == 520
    assert mini.train_labels.nnz / 4244 == pytest.approx(stats["avg_labels_per_doc_train"], abs=1e-3)
    top_name, top_count = stats["top10_labels_train"][0]
    counts = mini.label_counts()
    assert counts.shape == (520,)
    assert mini.label_names[int(counts.argmax())] == top_name and counts.max() == top_count
    assert mini.train_labels.dtype == np.float32 and set(np.unique(mini.train_labels.data)) == {1.0}
    assert mini.report == {"unseen_test_labels": 14}
    assert mini.train_features is None


def test_mini_unseen_test_labels_follow_the_vocabulary(mini):
    vocab, unseen = mini.label_names[:mini.num_labels], mini.label_names[mini.num_labels:]
    assert vocab == sorted(vocab) and unseen == sorted(unseen) and len(unseen) == 14
    assert not set(vocab) & set(unseen)
    assert mini.train_labels[:, mini.num_labels:].nnz == 0
    assert np.all(np.diff(mini.test_labels[:, mini.num_labels:].tocsc().indptr) > 0)  # each one is used in test
    assert mini.label_counts()[mini.num_labels:].sum() == 0


def test_mini_version_is_stable(mini):
    again = load_dataset(_mini_spec())
    assert again.version == mini.version and len(mini.version) == 16
    assert again.label_names == mini.label_names
    assert (again.train_labels != mini.train_labels).nnz == 0


def test_checksums_json_matches_shipped_files():
    root = REPO / "datasets"
    expected = json.loads((root / "checksums.json").read_text())
    shipped = {p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.is_file() and p.name != "checksums.json" and "__pycache__" not in p.parts}
    assert set(expected) == shipped
    for rel, digest in expected.items():
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest, f"{rel}: regenerate checksums.json"


def _module(path: Path, name: str):
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_builtin_datasets_registry():
    """xmcbench's own plugin registers the datasets it ships; LightXML's registers the paper's benchmarks."""
    shipped = _module(REPO / "datasets" / "plugin.py", "_xmcbench_datasets_plugin").shipped_datasets()
    paper = _module(REPO / "plugins" / "xmcbench_lightxml" / "datasets.py", "_lightxml_datasets").paper_datasets()
    specs = {s.name: s for s in shipped + paper}
    assert [s.name for s in shipped] == ["debian-debtags-mini", "debian-debtags", "debian-builddeps"]
    assert [s.name for s in paper] == ["eurlex4k", "wiki10-31k", "amazoncat13k", "wiki500k", "amazon670k"]
    registry = build_registry()
    assert registry.datasets["debian-debtags-mini"].origin.startswith("xmcbench-datasets")
    assert registry.datasets["wiki500k"].origin.startswith("lightxml")
    for name in ("debian-debtags-mini", "debian-debtags", "debian-builddeps"):
        stats = json.loads((REPO / "datasets" / name / "stats.json").read_text())
        spec = specs[name]
        assert (spec.num_train, spec.num_test, spec.num_labels) == (stats["n_train"], stats["n_test"],
                                                                     stats["n_labels"])
        assert (spec.propensity_a, spec.propensity_b) == (0.55, 1.5)
        assert (REPO / spec.card).is_file()
        if spec.embedded is not None:  # None only where xmcbench_datasets is not installed
            assert resolve_files(spec, None) == spec.embedded
    wiki = specs["wiki500k"]
    assert (wiki.dirname, wiki.num_train, wiki.num_test, wiki.num_labels) == ("Wiki-500K", 1_779_881, 769_421,
                                                                              501_008)
    assert (wiki.propensity_a, wiki.propensity_b) == (0.5, 0.4)
    assert (specs["amazon670k"].propensity_a, specs["amazon670k"].propensity_b) == (0.6, 2.6)
    assert all(specs[n].embedded is None and "AttentionXML" in specs[n].source
               for n in ("eurlex4k", "wiki10-31k", "amazoncat13k", "wiki500k", "amazon670k"))


# ------------------------------------------------------------------------------------------- reading policies


def test_tiny_dataset_layout(tmp_path):
    ds = load_dataset_from_path(_tiny(tmp_path / "tiny"))
    assert ds.name == "tiny"
    assert ds.train_texts == ["alpha beta", "gamma", "delta epsilon"]
    assert ds.label_names == ["a", "b", "c", "z"] and ds.num_labels == 3
    assert ds.train_labels.toarray().tolist() == [[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    assert ds.test_labels.toarray().tolist() == [[1, 0, 0, 0], [0, 1, 0, 1]]
    assert ds.label_counts().tolist() == [1, 2, 1, 0]
    assert ds.report == {"unseen_test_labels": 1}
    assert (ds.propensity_a, ds.propensity_b) == (0.55, 1.5)


def test_crlf_lines_are_stripped_and_counted(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_texts.txt": "alpha\r\ngamma\r\ndelta\r\n",
                                    "train_labels.txt": "a\r\nb\nc\r\n"})
    ds = load_dataset_from_path(folder)
    assert ds.train_texts == ["alpha", "gamma", "delta"]
    assert ds.label_names[:3] == ["a", "b", "c"]
    assert ds.report["crlf_lines"] == 5


def test_empty_lines_are_kept_and_counted(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_texts.txt": "alpha\n\n   \n", "train_labels.txt": "a\n\nb\n",
                                    "test_labels.txt": "a\n\n"})
    ds = load_dataset_from_path(folder)
    assert ds.train_texts == ["alpha", "", "   "]
    assert ds.train_labels.getrow(1).nnz == 0 and ds.test_labels.getrow(1).nnz == 0
    assert ds.report["empty_texts"] == 2
    assert ds.report["empty_train_label_lines"] == 1 and ds.report["empty_test_label_lines"] == 1


def test_duplicate_labels_are_kept_once(tmp_path):
    ds = load_dataset_from_path(_tiny(tmp_path / "d", {"train_labels.txt": "a a b\nb\tb\nc\n"}))
    assert ds.train_labels.toarray()[:, :3].tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    assert ds.train_labels.data.max() == 1.0
    assert ds.report["duplicate_label_lines"] == 2


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    ds = load_dataset_from_path(_tiny(tmp_path / "d", {"train_texts.txt": b"caf\xe9\nok \xc3\xa9\n\xff\xfe\n"}))
    assert ds.train_texts == ["caf\ufffd", "ok \u00e9", "\ufffd\ufffd"]
    assert ds.report["non_utf8_lines"] == 2


def test_bom_and_missing_final_newline(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_texts.txt": b"\xef\xbb\xbfalpha\ngamma\ndelta",
                                    "train_labels.txt": "a\nb\nc"})
    ds = load_dataset_from_path(folder)
    assert ds.train_texts == ["alpha", "gamma", "delta"]
    assert ds.report["utf8_bom_files"] == 1


def test_lines_split_across_read_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_BLOCK_BYTES", 3)  # every block boundary falls inside a line or a character
    path = _write(tmp_path, {"t.txt.xz": "héllo wörld\r\n\nx\n€€€ end"}) / "t.txt.xz"
    counts: dict[str, int] = {}
    assert data._read_lines(path, counts) == ["héllo wörld", "", "x", "€€€ end"]
    assert counts == {"crlf_lines": 1}


@pytest.mark.parametrize("ext", [".xz", ".gz", ".bz2"])
def test_compressed_files_read_like_plain_ones(tmp_path, ext):
    plain = load_dataset_from_path(_tiny(tmp_path / "plain"))
    packed = _tiny(tmp_path / "packed", {"train_texts.txt": None, "test_labels.txt": None,
                                         "train_texts.txt" + ext: "alpha beta\ngamma\ndelta epsilon\n",
                                         "test_labels.txt" + ext: "a\nb z\n"})
    ds = load_dataset_from_path(packed)
    assert ds.train_texts == plain.train_texts and ds.label_names == plain.label_names
    assert (ds.test_labels != plain.test_labels).nnz == 0
    assert ds.version == plain.version  # the version hashes contents, so caches survive (de)compression


def test_plain_file_preferred_over_compressed(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_texts.txt.xz": "stale\nstale\nstale\n"})
    assert load_dataset_from_path(folder).train_texts[0] == "alpha beta"


def test_raw_texts_preferred_over_tokenised(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_raw_texts.txt": "Alpha, Beta!\nGamma.\nDelta?\n",
                                    "test_raw_texts.txt.gz": "Alpha.\nZeta.\n"})
    ds = load_dataset_from_path(folder)
    assert ds.train_texts == ["Alpha, Beta!", "Gamma.", "Delta?"] and ds.test_texts == ["Alpha.", "Zeta."]
    assert ds.version != load_dataset_from_path(_tiny(tmp_path / "tok")).version


def test_raw_texts_for_one_split_only_is_an_error(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_raw_texts.txt": "A\nB\nC\n"})
    with pytest.raises(XmcError, match=r"train_raw_texts\.txt but no test_raw_texts\.txt"):
        load_dataset_from_path(folder)


def test_line_count_mismatch_names_both_files(tmp_path):
    folder = _tiny(tmp_path / "d", {"test_labels.txt": "a\nb\nc\n"})
    with pytest.raises(XmcError) as err:
        load_dataset_from_path(folder)
    message = str(err.value)
    assert str(folder / "test_texts.txt") in message and str(folder / "test_labels.txt") in message
    assert "2 lines" in message and "has 3" in message and "\n" not in message


def test_empty_training_set_is_an_error(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_texts.txt": "", "train_labels.txt": ""})
    with pytest.raises(XmcError, match="no training documents"):
        load_dataset_from_path(folder)


def test_missing_files_error_names_expected_files_and_env_var(tmp_path):
    spec = DatasetSpec(name="wiki500k", description="", dirname="Wiki-500K", source="somewhere public")
    for data_dir in (None, tmp_path / "nowhere", tmp_path):
        with pytest.raises(XmcError) as err:
            load_dataset(spec, data_dir)
        message = str(err.value)
        assert message.startswith("dataset 'wiki500k' not found: expected train_texts.txt (or train_raw_texts.txt), "
                                  "train_labels.txt, test_texts.txt, test_labels.txt in ")
        assert "--data-dir" in message and "XMCBENCH_DATA_DIR" in message and "'Wiki-500K/'" in message
        assert message.endswith("Public copies: somewhere public") and "\n" not in message
    _tiny(tmp_path / "Wiki-500K", {"test_labels.txt": None})
    with pytest.raises(XmcError, match=r"\(missing: test_labels\.txt\)"):
        load_dataset(spec, tmp_path)
    with pytest.raises(XmcError, match=r"not found: expected .* in .*Wiki-500K"):
        load_dataset_from_path(tmp_path / "Wiki-500K")


def test_data_dir_lookup(tmp_path):
    spec = DatasetSpec(name="eurlex4k", description="", dirname="Eurlex-4K", propensity_a=0.6, propensity_b=2.6)
    folder = _tiny(tmp_path / "Eurlex-4K")
    ds = load_dataset(spec, tmp_path)
    assert ds.name == "eurlex4k" and (ds.propensity_a, ds.propensity_b) == (0.6, 2.6)
    assert resolve_files(spec, tmp_path) == folder
    assert resolve_files(spec, folder) == folder  # --data-dir pointing at the dataset folder itself
    other = tmp_path / "other"
    _tiny(other / "eurlex-4k")
    assert resolve_files(spec, other) == other / "eurlex-4k"  # archives unpack with varying case


def test_feature_file_prefers_lightxml_svmlight(tmp_path):
    folder = _tiny(tmp_path / "d", {"train.txt": "3 2 3\n0 0:1\n1 1:2\n2 0:3 1:4\n"})
    dataset = load_dataset_from_path(folder)
    assert dataset.test_features is None   # the layout's features file is of the training documents
    np.testing.assert_allclose(dataset.train_features.toarray(), [[1, 0], [0, 1], [0.6, 0.8]], rtol=1e-6)
    _write(folder, {"train_v1.txt": "1 2:1\n2 2:1\n3 2:1\n"})
    assert load_dataset_from_path(folder).train_features.toarray().tolist() == [[0, 0, 1]] * 3


def test_a_features_file_is_read_when_first_asked_for(tmp_path):
    folder = _tiny(tmp_path / "d", {"train_v1.txt": "1 0:1\n2 oops\n3 1:1\n"})
    dataset = load_dataset_from_path(folder)   # loads although line 2 is malformed: the file is not read yet
    assert dataset.has_train_features
    with pytest.raises(XmcError, match="train_v1.txt:2: malformed feature 'oops'"):
        dataset.train_features


def test_public_readers(tmp_path):
    _write(tmp_path, {"t.txt.bz2": "one\r\ntwo three\n", "l.txt": "a  b a\n\nc\n"})
    assert read_texts(tmp_path / "t.txt.bz2") == ["one", "two three"]
    assert read_label_lines(tmp_path / "l.txt") == [["a", "b", "a"], [], ["c"]]
    with pytest.raises(XmcError, match="cannot read"):
        read_texts(tmp_path / "absent.txt")
    (tmp_path / "broken.txt.xz").write_bytes(b"not xz at all")
    with pytest.raises(XmcError, match="cannot read .*broken"):
        read_texts(tmp_path / "broken.txt.xz")


def test_data_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv("XMCBENCH_DATA_DIR", raising=False)
    assert data_dir_from_env(None) is None
    monkeypatch.setenv("XMCBENCH_DATA_DIR", str(tmp_path))
    assert data_dir_from_env(None) == tmp_path
    assert data_dir_from_env(tmp_path / "cli") == tmp_path / "cli"  # the flag wins over the variable
    monkeypatch.setenv("XMCBENCH_DATA_DIR", "  ")
    assert data_dir_from_env(None) is None
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XMCBENCH_DATA_DIR", "~/xc")
    assert data_dir_from_env(None) == tmp_path / "xc"


# ------------------------------------------------------------------------------------------- label texts

DEBIAN = ("debian-debtags-mini", "debian-debtags", "debian-builddeps")


@pytest.mark.parametrize("ext", ["", ".xz", ".gz", ".bz2"])
def test_label_texts_tsv_gives_each_label_a_text(tmp_path, ext):
    # b has none, y is not a label of the dataset, the text of c holds a tab and of z is empty
    table = "a\tthe letter a\nc\tsee\tcee\ny\tunused\nz\t\n"
    ds = load_dataset_from_path(_tiny(tmp_path / "d", {"label_texts.tsv" + ext: table}))
    assert ds.label_names == ["a", "b", "c", "z"]
    assert ds.label_texts == ["the letter a", "b", "see\tcee", "z"]
    assert ds.report == {"unseen_test_labels": 1, "labels_without_text": 2, "label_texts_unused": 1}


def test_label_texts_are_part_of_the_version_only_when_present(tmp_path):
    without = load_dataset_from_path(_tiny(tmp_path / "without"))
    assert without.label_texts is None
    assert without.version == "5a18e65ead1042f5"   # as before label texts existed: users' caches stay valid
    first = load_dataset_from_path(_tiny(tmp_path / "first", {"label_texts.tsv": "a\tthe letter a\n"}))
    other = load_dataset_from_path(_tiny(tmp_path / "other", {"label_texts.tsv": "a\tanother text\n"}))
    assert len({without.version, first.version, other.version}) == 3
    packed = load_dataset_from_path(_tiny(tmp_path / "packed", {"label_texts.tsv.xz": "a\tthe letter a\n"}))
    assert packed.version == first.version


def test_label_texts_as_csv_or_json_lines(tmp_path):
    csv_table = 'id,label,text\n1,a,"the letter a, first"\n2,b,"two\nlines"\n'
    ds = load_dataset_from_path(_tiny(tmp_path / "csv", {"label_texts.csv": csv_table}))
    assert ds.label_texts == ["the letter a, first", "two\nlines", "c", "z"]
    jsonl = '{"label": "c", "text": "cee"}\n\n{"label": "z", "text": "zed"}\n'
    assert load_dataset_from_path(_tiny(tmp_path / "jsonl", {"label_texts.jsonl": jsonl})).label_texts == \
        ["a", "b", "cee", "zed"]
    with pytest.raises(XmcError, match="holds label_texts.tsv and label_texts.csv"):
        load_dataset_from_path(_tiny(tmp_path / "two", {"label_texts.tsv": "a\tx\n", "label_texts.csv": csv_table}))


@pytest.mark.parametrize("name", DEBIAN)
def test_shipped_datasets_carry_a_text_for_every_label(name):
    spec = DatasetSpec(name=name, description="", dirname=name, embedded=_datasets_root() / name)
    ds = load_dataset(spec)
    assert ds.label_texts is not None and len(ds.label_texts) == len(ds.label_names)
    assert "labels_without_text" not in ds.report and "label_texts_unused" not in ds.report
    # each text starts with its label's name: "devel::lang:python - Software Development: ..."
    assert all(text.startswith(label) for label, text in zip(ds.label_names, ds.label_texts))
    described = sum(text != label for label, text in zip(ds.label_names, ds.label_texts))
    assert described == {"debian-builddeps": 20_813 - 413}.get(name, len(ds.label_names))
    stats = json.loads((_datasets_root() / name / "stats.json").read_text())
    assert stats["n_labels_with_text"] == len(ds.label_names) and stats["n_label_texts_only_the_name"] == \
        len(ds.label_names) - described
    assert stats["dataset_version"] == ds.version   # what config.json records as dataset_version


def test_datasets_command_says_which_have_label_texts():
    from typer.testing import CliRunner

    from xmcbench.cli import app

    result = CliRunner().invoke(app, ["datasets"])
    assert result.exit_code == 0 and "files     label texts" in result.output.splitlines()[0]
    rows = {line.split()[0]: line for line in result.output.splitlines()[2:]}
    assert all(re.search(r" embedded +yes ", rows[name]) for name in DEBIAN)
    assert re.search(r" no +\? ", rows["wiki500k"])   # files absent: whether they have texts is unknown
