"""Bad input, one test per row of docs/bad-input.md, plus property tests for the readers and the metrics.

Each case either works by a documented policy that reports its count (``Dataset.report``, written to a run's
``data_report.json``), or stops with exit status 2 and one line on stderr that names the file (and line).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xmcbench import data
from xmcbench.data import load_dataset_from_path
from xmcbench.errors import XmcError
from xmcbench.metrics import evaluate

REPO = Path(__file__).resolve().parents[1]

TINY = {  # 3 train / 2 test documents; test label z is never seen in training
    "train_texts.txt": "alpha beta\ngamma\ndelta epsilon\n",
    "train_labels.txt": "a b\nb\nc\n",
    "test_texts.txt": "alpha\nzeta\n",
    "test_labels.txt": "a\nb z\n",
}


def write(folder: Path, changes: dict[str, str | bytes | None] | None = None) -> Path:
    """The TINY dataset in ``folder``, with ``changes`` (file name -> contents, or None to leave it out)."""
    files = {**TINY, **(changes or {})}
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if content is not None:
            raw = content.encode() if isinstance(content, str) else content
            (folder / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return folder


def xmcbench(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmcbench", *args], capture_output=True, text=True, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, progress_lines: int = 0) -> str:
    """Exit status 2, no traceback, and one error line, every fragment in it; that line is all of stderr unless
    the run had started (``progress_lines`` lines of its log come first)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == progress_lines + 1 and result.stderr.endswith("\n"), result.stderr
    error = lines[-1]
    assert error.startswith("xmcbench: error: ") and "error" not in " ".join(lines[:-1]), result.stderr
    for fragment in fragments:
        assert fragment in error, (fragment, result.stderr)
    return error


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------- one test per row


def test_texts_and_labels_of_different_line_counts(tmp_path):
    folder = write(tmp_path / "d", {"train_labels.txt": "a b\nb\nc\nd\n"})  # 3 texts, 4 label lines
    with pytest.raises(XmcError) as error:
        load_dataset_from_path(folder)
    message = one_line(error)
    assert str(folder / "train_texts.txt") in message and str(folder / "train_labels.txt") in message
    assert f"line 4 of {folder / 'train_labels.txt'} has no partner" in message
    assert_one_line_error(xmcbench("run", "lightxml", "--dataset", str(folder), "--output", str(tmp_path / "out")),
                          "has 3 lines but", "has 4", "line 4 of")
    assert not (tmp_path / "out").exists()


def test_empty_text_lines(tmp_path):
    ds = load_dataset_from_path(write(tmp_path / "d", {"train_texts.txt": "alpha\n\n \t\n"}))
    assert ds.train_texts == ["alpha", "", " \t"]  # kept: the document still has its labels
    assert ds.train_labels.getrow(1).nnz == 1 and ds.train_labels.getrow(2).nnz == 1
    assert ds.report == {"empty_texts": 2, "unseen_test_labels": 1}


def test_empty_label_lines(tmp_path):
    ds = load_dataset_from_path(write(tmp_path / "d", {"train_labels.txt": "a b\n\nc\n", "test_labels.txt": "\n \n"}))
    assert len(ds.train_texts) == 3 and len(ds.test_texts) == 2  # kept, as documents without labels
    assert np.diff(ds.train_labels.indptr).tolist() == [2, 0, 1] and ds.test_labels.nnz == 0
    assert ds.report == {"empty_train_label_lines": 1, "empty_test_label_lines": 2}
    # ... unless no training document has a label at all: then there is nothing to learn
    with pytest.raises(XmcError) as error:
        load_dataset_from_path(write(tmp_path / "none", {"train_labels.txt": "\n\n\n"}))
    assert "has no training labels" in one_line(error) and str(tmp_path / "none" / "train_labels.txt") in str(error.value)


def test_non_utf8_bytes(tmp_path):
    folder = write(tmp_path / "d", {"train_texts.txt": b"caf\xe9\ngamma\n\xff ok\n",
                                    "train_labels.txt": b"caf\xe9\ncaf\xe8\nc\n"})
    ds = load_dataset_from_path(folder)
    assert ds.train_texts == ["caf\ufffd", "gamma", "\ufffd ok"]  # texts: U+FFFD
    # label names: \xNN escapes, so two labels that differ only in undecodable bytes stay two labels
    assert ds.label_names[:ds.num_labels] == ["c", "caf\\xe8", "caf\\xe9"]
    assert ds.report["non_utf8_lines"] == 4
    assert data.read_label_lines(folder / "train_labels.txt")[:2] == [["caf\\xe9"], ["caf\\xe8"]]
    # a byte-order mark is dropped and counted, not read as part of the first document
    bom = load_dataset_from_path(write(tmp_path / "bom", {"train_texts.txt": b"\xef\xbb\xbfalpha\ngamma\ndelta\n"}))
    assert bom.train_texts[0] == "alpha" and bom.report["utf8_bom_files"] == 1


def test_windows_line_endings(tmp_path):
    folder = write(tmp_path / "d", {"train_texts.txt": "alpha beta\r\ngamma\r\ndelta epsilon\r\n",
                                    "train_labels.txt": "a b\r\nb\nc\r\n"})  # mixed endings are fine too
    ds = load_dataset_from_path(folder)
    assert ds.train_texts == ["alpha beta", "gamma", "delta epsilon"]
    assert ds.label_names == ["a", "b", "c", "z"]
    assert ds.report == {"crlf_lines": 5, "unseen_test_labels": 1}
    # the version hashes the bytes as read, so a CRLF copy is a different dataset version (separate caches)
    assert ds.version != load_dataset_from_path(write(tmp_path / "lf")).version


def test_a_label_repeated_on_one_line(tmp_path):
    ds = load_dataset_from_path(write(tmp_path / "d", {"train_labels.txt": "a b a\nb\tb  b\nc\n"}))
    assert ds.train_labels.toarray()[:, :3].tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 1]]
    assert set(ds.train_labels.data.tolist()) == {1.0}
    assert ds.report["duplicate_label_lines"] == 2


def test_test_labels_never_seen_in_training(tmp_path):
    ds = load_dataset_from_path(write(tmp_path / "d", {"test_labels.txt": "a y\nb z\n"}))
    assert ds.num_labels == 3 and ds.label_names == ["a", "b", "c", "y", "z"]  # unseen ones after the vocabulary
    assert ds.test_labels.toarray().tolist() == [[1, 0, 0, 1, 0], [0, 1, 0, 0, 1]]  # kept in the truth
    assert ds.train_labels[:, 3:].nnz == 0 and ds.label_counts().tolist() == [1, 2, 1, 0, 0]
    assert ds.report == {"unseen_test_labels": 2}
    # scored as misses: a perfect ranking of the predictable labels still loses recall
    perfect = np.array([[0, 1], [1, 2]])  # ids < num_labels only: y and z can never be predicted
    metrics = evaluate(perfect, ds.test_labels, ks=(1, 2))
    assert metrics["P@1"] == 100.0 and metrics["R@2"] == pytest.approx(50.0)
    # metrics.json's unseen_test_labels and data_report.json: see test_a_finished_run_directory


def test_a_one_megabyte_document(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from xmcbench.tokenization import tokenize

    huge = "python module script " * 50_000  # 1,050,000 characters, 150,000 words, one line
    ds = load_dataset_from_path(write(tmp_path / "d", {"train_texts.txt": f"alpha beta\n{huge}\ndelta epsilon\n"}))
    assert ds.train_texts[1] == huge and len(huge.encode()) >= 1_000_000  # read whole, not rejected
    assert ds.report == {"unseen_test_labels": 1}  # nothing to report at reading time
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokens = tokenize(ds.train_texts, tokenizer, max_length=32, texts_key=None)
    assert tokens.lengths.tolist()[1] == 32  # truncated to max_length tokens, special tokens included
    assert max(tokens.lengths) <= 32 and len(tokens) == 3


def test_an_empty_dataset(tmp_path):
    empty = write(tmp_path / "empty", {name: "" for name in TINY})
    with pytest.raises(XmcError) as error:
        load_dataset_from_path(empty)
    assert "has no training documents" in one_line(error) and str(empty / "train_texts.txt") in str(error.value)
    no_test = write(tmp_path / "no-test", {"test_texts.txt": "", "test_labels.txt": ""})
    with pytest.raises(XmcError) as error:
        load_dataset_from_path(no_test)
    assert "has no test documents" in one_line(error) and str(no_test / "test_texts.txt") in str(error.value)
    with pytest.raises(XmcError) as error:
        load_dataset_from_path(tmp_path / "nothing-here")
    assert "not found" in one_line(error)
    assert_one_line_error(xmcbench("run", "lightxml", "--dataset", str(empty), "--output", str(tmp_path / "out")),
                          "has no training documents", str(empty / "train_texts.txt"))
    assert not (tmp_path / "out").exists()


def test_a_corrupt_compressed_file(tmp_path):
    packed = gzip.compress(b"alpha beta\ngamma\ndelta epsilon\n" * 50)
    broken = packed[:20] + bytes(b ^ 0xFF for b in packed[20:40]) + packed[40:]  # corrupt deflate data
    folder = write(tmp_path / "d", {"train_texts.txt": None})
    for contents in (broken, packed[:-12], b"not gzip at all"):
        (folder / "train_texts.txt.gz").write_bytes(contents)
        with pytest.raises(XmcError) as error:
            load_dataset_from_path(folder)
        assert one_line(error).startswith(f"cannot read {folder / 'train_texts.txt.gz'}: ")


def test_set_keys_that_do_not_exist_or_values_of_the_wrong_type(tmp_path):
    from xmcbench.registry import build_registry
    from xmcbench.runner import plan_run

    registry = build_registry()
    with pytest.raises(XmcError) as error:
        plan_run(registry, "lightxml", set_options=["epoch=3"])
    assert one_line(error).startswith("--set: unknown setting 'epoch': did you mean 'epochs'")
    with pytest.raises(XmcError) as error:  # nothing close: every valid key is listed
        plan_run(registry, "lightxml", set_options=["qqqqqqqq=1"])
    message = one_line(error)
    assert "valid names: " in message and all(key in message for key in ("epochs", "lr", "max_length", "top_k"))
    for pair, expected in (("epochs=three", "epochs must be int, got 'three'"),
                           ("lr=fast", "lr must be float, got 'fast'"),
                           ("swa=maybe", "swa must be bool, got 'maybe'"),
                           ("epochs", "--set expects key=value, got 'epochs'")):
        with pytest.raises(XmcError) as error:
            plan_run(registry, "lightxml", set_options=[pair])
        assert expected in one_line(error)
    config_file = tmp_path / "settings.toml"
    config_file.write_text("epochz = 3\n")
    with pytest.raises(XmcError) as error:
        plan_run(registry, "lightxml", config_file=config_file)
    assert one_line(error).startswith(f"{config_file}: unknown setting 'epochz': did you mean 'epochs'")
    assert_one_line_error(xmcbench("run", "lightxml", "--set", "epoch=3", "--print-config"),
                          "unknown setting 'epoch': did you mean 'epochs'")
    assert_one_line_error(xmcbench("config", "lightxml", "--set", "max_length=long"),
                          "max_length must be int, got 'long'")


def test_an_unknown_method_component_or_dataset(tmp_path, tiny_dataset):
    out = tmp_path / "out"
    assert_one_line_error(xmcbench("run", "lightxm", "--output", str(out), cwd=tmp_path),
                          "unknown method 'lightxm': did you mean 'lightxml'")
    assert_one_line_error(xmcbench("run", "lightxml", "--dataset", "debian-debtag", "--output", str(out),
                                   cwd=tmp_path),
                          "unknown dataset 'debian-debtag': did you mean 'debian-debtags'")
    assert_one_line_error(xmcbench("run", "lightxml", "--dataset", str(tiny_dataset), "--output", str(out),
                                   "--set", "encoder=transformer-clx", cwd=tmp_path),
                          "unknown encoder 'transformer-clx': did you mean 'transformer-cls'?")
    assert not out.exists()


def test_an_unknown_component_is_refused_when_planning():
    from xmcbench.registry import build_registry
    from xmcbench.runner import plan_run

    with pytest.raises(XmcError, match="unknown ranker 'bottleneckk': did you mean 'bottleneck'"):
        plan_run(build_registry(), "lightxml", set_options=["ranker=bottleneckk"])


@pytest.mark.slow
def test_a_finished_run_directory(tmp_path, tiny_model_dir, tiny_dataset):
    from typer.testing import CliRunner

    from xmcbench.cli import app

    folder = tiny_dataset
    labels = (folder / "test_labels.txt").read_text().splitlines()
    labels[0] += " zz:never-trained"  # one unseen test label, to see it in metrics.json and data_report.json
    (folder / "test_labels.txt").write_text("\n".join(labels) + "\n")
    run_dir = tmp_path / "run"
    settings_ = [f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1",
                 "max_length=32", "threads=1", "cluster_size=2", "top_clusters=2", "hidden_size=8"]
    args = ["run", "lightxml", "--dataset", str(folder), "--output", str(run_dir)]
    for setting in settings_:
        args += ["--set", setting]
    args += ["--seed", "3"]
    cli = CliRunner()
    first = cli.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert json.loads((run_dir / "metrics.json").read_text())["unseen_test_labels"] == 1
    assert json.loads((run_dir / "data_report.json").read_text()) == {"unseen_test_labels": 1}

    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    refused = xmcbench(*args)
    assert_one_line_error(refused, f"{run_dir} already holds a finished run", "--overwrite")
    assert sorted(p for p in run_dir.rglob("*") if p.is_file()) == files
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before  # nothing touched

    again = cli.invoke(app, args[:-1] + ["4", "--overwrite"])  # --seed 4 this time
    assert again.exit_code == 0, again.output
    assert json.loads((run_dir / "config.json").read_text())["config"]["seed"] == 4
    assert (run_dir / "metrics.json").stat().st_mtime_ns > before[run_dir / "metrics.json"][0]


# ---------------------------------------------------------------------------------------- the table itself


def test_every_row_of_the_table_has_its_test():
    """docs/bad-input.md names, per row, the test that exercises it; each must exist in this file."""
    table = (REPO / "docs" / "bad-input.md").read_text()
    named = {line.rsplit("`", 2)[-2] for line in table.splitlines()
             if line.startswith("| ") and line.rstrip().endswith("` |") and "test_" in line}
    assert len(named) >= 12
    assert named <= {name for name in globals() if name.startswith("test_")}


# ---------------------------------------------------------------------------------------- property tests: readers

# Texts: any character but the line end itself. U+FEFF at the very start of a file is a byte-order mark (see
# test_non_utf8_bytes), and surrogates cannot be written as UTF-8.
TEXT_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\ufeff")
# Label names: anything str.split does not split on (it splits on exactly the characters str.isspace accepts).
LABEL_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufeff").filter(
    lambda c: not c.isspace())
LABEL = st.text(LABEL_CHARS, min_size=1, max_size=4) | st.sampled_from(["a", "b", "c", "lang:c", "x11:gui"])
DOCS = st.lists(st.tuples(st.text(TEXT_CHARS, max_size=12), st.lists(LABEL, max_size=4)), min_size=1, max_size=6)
LAYOUT = st.fixed_dictionaries({"crlf": st.booleans(), "gz": st.booleans(), "final_newline": st.booleans()})


def _file_bytes(lines: list[str], layout: dict) -> bytes:
    end = "\r\n" if layout["crlf"] else "\n"
    text = "".join(line + end for line in lines)
    if not layout["final_newline"] and lines and lines[-1]:  # (an empty last line needs its line end to exist)
        text = text[:-len(end)]
    raw = text.encode("utf-8")
    return gzip.compress(raw) if layout["gz"] else raw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train=DOCS, test=DOCS, layouts=st.lists(LAYOUT, min_size=4, max_size=4),
       separator=st.sampled_from([" ", "\t", "  ", " \t "]))
def test_reader_round_trip(train, test, layouts, separator):
    """Whatever is written in the layout (CRLF or not, .gz or not, final newline or not) is read back, counted."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "random"
        folder.mkdir()
        files = {"train_texts": [t for t, _ in train], "train_labels": [separator.join(ls) for _, ls in train],
                 "test_texts": [t for t, _ in test], "test_labels": [separator.join(ls) for _, ls in test]}
        expected_crlf = 0
        for (role, lines), layout in zip(files.items(), layouts):
            raw = _file_bytes(lines, layout)
            (folder / f"{role}.txt{'.gz' if layout['gz'] else ''}").write_bytes(raw)
            if layout["crlf"]:
                expected_crlf += (gzip.decompress(raw) if layout["gz"] else raw).count(b"\r\n")

        if not any(labels for _, labels in train):
            with pytest.raises(XmcError, match="has no training labels"):
                load_dataset_from_path(folder)
            return
        ds = load_dataset_from_path(folder)

    vocab = sorted({label for _, labels in train for label in labels})
    unseen = sorted({label for _, labels in test for label in labels} - set(vocab))
    assert ds.label_names == vocab + unseen and ds.num_labels == len(vocab)
    for docs, texts, matrix in ((train, ds.train_texts, ds.train_labels), (test, ds.test_texts, ds.test_labels)):
        assert len(texts) == matrix.shape[0] == len(docs)
        assert texts == [t for t, _ in docs]
        assert matrix.shape[1] == len(ds.label_names) and set(matrix.data.tolist()) <= {1.0}
        for row, (_, labels) in enumerate(docs):
            got = matrix.indices[matrix.indptr[row]:matrix.indptr[row + 1]]
            assert {ds.label_names[i] for i in got} == set(labels) and len(got) == len(set(labels))

    every = train + test
    expected = {
        "crlf_lines": expected_crlf,
        "empty_texts": sum(1 for t, _ in every if not t or t.isspace()),
        "empty_train_label_lines": sum(1 for _, labels in train if not labels),
        "empty_test_label_lines": sum(1 for _, labels in test if not labels),
        "duplicate_label_lines": sum(1 for _, labels in every if len(set(labels)) != len(labels)),
        "unseen_test_labels": len(unseen),
    }
    assert ds.report == {key: n for key, n in expected.items() if n}  # only the policies that changed something


@settings(max_examples=40, deadline=None)
@given(content=st.binary(max_size=64) | st.lists(st.sampled_from(
           [b"\r\n", b"\n", b"\r", b"\xef\xbb\xbf", b"\xc3\xa9", b"\xe9", b"\xe2\x82\xac", b"ab", b" "]),
           max_size=24).map(b"".join),
       block=st.integers(1, 9), gz=st.booleans())
def test_reader_is_independent_of_the_block_size(content, block, gz):
    """Lines and counts do not depend on where the reader's blocks are cut (the real blocks are 32 MiB)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("f.txt.gz" if gz else "f.txt")
        path.write_bytes(gzip.compress(content) if gz else content)
        whole: dict[str, int] = {}
        expected = data._read_lines(path, whole)
        original = data._BLOCK_BYTES
        data._BLOCK_BYTES = block
        try:
            cut: dict[str, int] = {}
            assert data._read_lines(path, cut) == expected
        finally:
            data._BLOCK_BYTES = original
    assert cut == whole
    body = content.removeprefix(b"\xef\xbb\xbf")
    assert len(expected) == body.count(b"\n") + (0 if not body or body.endswith(b"\n") else 1)  # no line lost
    assert whole.get("utf8_bom_files", 0) == int(content.startswith(b"\xef\xbb\xbf"))


# ---------------------------------------------------------------------------------------- property tests: metrics
# tests/test_metrics.py already checks, with hypothesis, agreement with a brute-force implementation, every value
# within [0, 100] (P@k within [0, 1], as a percentage), and invariance to renaming labels. Added here: invariance
# to the order of documents, and unseen test labels (extra truth columns) as misses that never raise a score.


@st.composite
def rankings(draw):
    num_docs = draw(st.integers(1, 6))
    num_seen = draw(st.integers(1, 6))
    num_unseen = draw(st.integers(0, 3))
    k = draw(st.integers(1, num_seen))
    truth = [draw(st.sets(st.integers(0, num_seen + num_unseen - 1), max_size=4)) for _ in range(num_docs)]
    predicted = [draw(st.permutations(range(num_seen)))[:k] for _ in range(num_docs)]
    return num_seen, num_unseen, k, truth, np.array(predicted, dtype=np.int64)


def _csr(rows, width):
    r = [i for i, labels in enumerate(rows) for _ in labels]
    c = [label for labels in rows for label in sorted(labels)]
    return sp.csr_matrix((np.ones(len(c)), (r, c)), shape=(len(rows), width))


@settings(max_examples=40, deadline=None)
@given(rankings(), st.randoms(use_true_random=False))
def test_metrics_invariant_to_document_order(problem, rnd):
    num_seen, num_unseen, k, truth, predicted = problem
    order = list(range(len(truth)))
    rnd.shuffle(order)
    inv = np.linspace(1.0, 3.0, num_seen + num_unseen)
    a = evaluate(predicted, _csr(truth, num_seen + num_unseen), ks=(1, k), inv_propensity=inv)
    b = evaluate(predicted[order], _csr([truth[i] for i in order], num_seen + num_unseen), ks=(1, k),
                 inv_propensity=inv)
    assert a == pytest.approx(b, abs=1e-9)
    assert all(0.0 <= value <= 100.0 + 1e-9 for value in a.values())


@settings(max_examples=40, deadline=None)
@given(rankings())
def test_unseen_test_labels_are_misses(problem):
    num_seen, num_unseen, k, truth, predicted = problem
    seen_only = [{label for label in labels if label < num_seen} for labels in truth]
    with_unseen = evaluate(predicted, _csr(truth, num_seen + num_unseen), ks=(k,))
    without = evaluate(predicted, _csr(seen_only, num_seen + num_unseen), ks=(k,))
    assert with_unseen[f"P@{k}"] == without[f"P@{k}"]  # the same hits
    for key in (f"R@{k}", f"nDCG@{k}"):
        if truth == seen_only:
            assert with_unseen[key] == pytest.approx(without[key])
        else:  # never higher, whatever was predicted
            assert with_unseen[key] <= without[key] + 1e-9
