"""Bad input, one test per row of docs/bad-input.md, plus property tests for the readers and the metrics.

Each case either works by a documented policy that reports its count (``Dataset.report``, written to a run's
``data_report.json``), or stops with exit status 2 and one line on stderr that names the file (and line).
"""

from __future__ import annotations

import gzip
import json
import os
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
from xmcbench.config import SETTING_RANGES
from xmcbench.data import load_dataset_from_path
from xmcbench.errors import XmcError
from xmcbench.metrics import evaluate
from xmcbench.testing import write_tiny_dataset
from xmcbench.runs import launch
from xmcbench.formats import open_dataset
from xmcbench.rundir import save_validation_predictions, VALIDATION_PREDICTIONS_FILE
from xmcbench.runs.plan import plan_run
from xmcbench.saved import predict_texts, rescore_run
from xmcbench.scoring import evaluate_predictions
from xmcbench.training import Trainer

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
                          "unknown encoder 'transformer-clx': did you mean 'transformer-cls'")
    assert not out.exists()


def test_an_unknown_component_is_refused_when_planning():
    from xmcbench.registry import build_registry

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


# ---------------------------------------------------------------------------------------- label texts and filters


def test_a_label_text_file_naming_labels_the_dataset_lacks(tmp_path):
    # a table may cover a whole taxonomy: names the dataset lacks are counted and left out, never an error
    table = "a\tthe letter a\nq\tnot in the data\nr\tnor this\n"
    ds = load_dataset_from_path(write(tmp_path / "d", {"label_texts.tsv": table}))
    assert ds.label_texts == ["the letter a", "b", "c", "z"]   # labels without a line keep their name
    assert ds.report == {"unseen_test_labels": 1, "labels_without_text": 3, "label_texts_unused": 2}


def test_a_label_text_file_with_duplicate_or_empty_names(tmp_path):
    for table, expected in (("a\tfirst\nb\tbee\na\tsecond\n", ":3: label 'a' is listed again (first on line 1)"),
                            ("a\tfirst\n\tno name\n", ":2: the label name is empty")):
        folder = write(tmp_path / str(len(table)), {"label_texts.tsv": table})
        with pytest.raises(XmcError) as error:
            load_dataset_from_path(folder)
        assert one_line(error).startswith(f"{folder / 'label_texts.tsv'}{expected}")


def test_a_label_text_line_without_a_tab(tmp_path):
    folder = write(tmp_path / "d", {"label_texts.tsv": "a\tfine\nb  spaces, not a tab\n"})
    assert_one_line_error(xmcbench("convert", str(folder), str(tmp_path / "out"), "--to", "delimited"),
                          f"{folder / 'label_texts.tsv'}:2: no tab on the line; each line is a label name, a tab")
    assert not (tmp_path / "out").exists()


def test_a_label_text_file_that_is_not_utf8(tmp_path):
    folder = write(tmp_path / "d", {"label_texts.tsv": "a\tfine\nb\tcaf\xe9\n".encode("latin-1")})
    with pytest.raises(XmcError) as error:
        load_dataset_from_path(folder)
    assert one_line(error).startswith(f"{folder / 'label_texts.tsv'}:2: not UTF-8 (byte 12 of the file); label "
                                      "texts are matched")


def test_a_filter_naming_a_document_or_label_out_of_range(tmp_path):
    from xmcbench.formats import read_dataset
    from xmcbench.registry import build_registry

    registry = build_registry()
    files = {"trn_X.txt": "a\nb\n", "trn_X_Y.txt": "2 3\n0:1\n1:1 2:1\n", "tst_X.txt": "c\n",
             "tst_X_Y.txt": "1 3\n2:1\n"}
    for pairs, expected in (("0 1\n\n1 0\n", ":3: document 1 is out of range: "),
                            ("0 3\n", ":1: label 3 is out of range: "), ("0 x\n", ":1: expected 'doc_id label_id'")):
        folder = write(tmp_path / str(abs(hash(pairs))), {**files, "filter_labels_test.txt": pairs})
        for name in TINY:
            (folder / name).unlink()
        with pytest.raises(XmcError) as error:
            read_dataset(registry, folder)
        assert one_line(error).startswith(f"{folder / 'filter_labels_test.txt'}{expected}"), error.value


# ---------------------------------------------------------------------------------------- runs, model folders, settings

TINY_SETTINGS = ("pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32", "threads=1",
                 "cluster_size=2", "top_clusters=2", "hidden_size=8")


def run_args(tiny_model_dir: Path, dataset: Path, output: Path, *extra: str) -> list[str]:
    args = ["run", "lightxml", "--dataset", str(dataset), "--output", str(output),
            "--set", f"model_name={tiny_model_dir}"]
    for setting in TINY_SETTINGS:
        args += ["--set", setting]
    return args + list(extra)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory) -> Path:
    """One finished tiny run (a model, metrics, predictions); tests copy it before changing anything."""
    from xmcbench.registry import build_registry

    base = tmp_path_factory.mktemp("finished")
    dataset = data_folder = base / "tiny-topics"
    from xmcbench.testing import write_tiny_dataset
    write_tiny_dataset(data_folder)
    registry = build_registry()
    plan = plan_run(registry, "lightxml", str(dataset),
                           set_options=[f"model_name={tiny_model_dir}", *TINY_SETTINGS])
    return launch.run(plan, base / "run", registry=registry, log=lambda line: None)


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    import shutil
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def test_overwrite_of_a_folder_that_is_not_a_run(tmp_path, tiny_model_dir, tiny_dataset):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('mine')\n")
    (project / "config.json").write_text("{}\n")   # a config.json alone is no proof of a run
    before = snapshot(project)
    refused = xmcbench(*run_args(tiny_model_dir, tiny_dataset, project, "--overwrite"))
    assert_one_line_error(refused, str(project), "holds no xmcbench run", "choose another --output",
                          progress_lines=len(refused.stderr.splitlines()) - 1)
    assert snapshot(project) == before


@pytest.mark.slow
@pytest.mark.parametrize("dataset, extra", [(None, ["--set", "device=cuda"]), ("debian-debtag", []),
                                             (None, ["--set", "epochs=0"])])
def test_overwrite_with_a_setting_that_fails_keeps_the_old_run(dataset, extra, run_copy, tiny_model_dir,
                                                                tiny_dataset):
    import torch
    if "device=cuda" in extra and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device=cuda is not a bad setting here")
    before = snapshot(run_copy)
    refused = xmcbench(*run_args(tiny_model_dir, dataset or tiny_dataset, run_copy, "--overwrite", *extra))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert snapshot(run_copy) == before


@pytest.mark.slow
def test_an_overwrite_that_fails_midway_keeps_the_old_run(run_copy, tiny_model_dir, tiny_dataset, monkeypatch):
    from xmcbench.registry import build_registry
    from xmcbench.rundir import staging_folder

    before = snapshot(run_copy)

    def fail(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trainer, "fit", fail)
    registry = build_registry()
    plan = plan_run(registry, "lightxml", str(tiny_dataset),
                           set_options=[f"model_name={tiny_model_dir}", *TINY_SETTINGS])
    with pytest.raises(OSError):
        launch.run(plan, run_copy, overwrite=True, registry=registry, log=lambda line: None)
    assert snapshot(run_copy) == before               # the old run, untouched
    assert (staging_folder(run_copy) / "config.json").exists()   # the new one waits beside it
    monkeypatch.undo()
    replaced = launch.run(plan, run_copy, overwrite=True, registry=registry, log=lambda line: None)
    assert replaced == run_copy and (run_copy / "metrics.json").exists() and not staging_folder(run_copy).exists()
    assert not list(run_copy.parent.glob(".*xmcbench-replaced"))


def test_two_runs_given_the_same_output(tmp_path, tiny_model_dir, tiny_dataset):
    from xmcbench.rundir import claim_output

    output = tmp_path / "shared"
    claimed = claim_output(output, overwrite=False, is_finished=lambda folder: False)  # a run in progress
    try:
        for extra in ([], ["--overwrite"]):
            second = xmcbench(*run_args(tiny_model_dir, tiny_dataset, output, *extra))
            assert_one_line_error(second, "another xmcbench process is writing", str(output),
                                  progress_lines=len(second.stderr.splitlines()) - 1)
        resumed = xmcbench("run", "--resume", str(output))
        assert resumed.returncode == 2 and "Traceback" not in resumed.stderr
    finally:
        claimed.release()


# A third-party plugin, installed for the command line: a recaller that reads label texts (its check refuses a
# dataset without them) from a file its required path option names.
TEXT_RECALLER_PLUGIN = '''
from xmcbench.config import MethodSpec, Option
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench_lightxml.recaller import build_cluster_linear


def needs_label_texts(config, label_info):
    if not label_info.has_texts:
        raise XmcError(f"it reads label texts, and none of the {label_info.num_labels} labels has one; use a "
                       "dataset with label texts")


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("recaller", "text-recaller", build_cluster_linear, check=needs_label_texts,
                           options=(Option("label_file", "path", None, "one text per label", required=True),))


@hookimpl
def xmcbench_register_methods(registry):
    registry.add_method(MethodSpec("text-method", "LightXML whose recaller reads label texts", defaults={
        "encoder": "transformer-cls", "recaller": "text-recaller", "ranker": "bottleneck", "sampler": "dynamic"}))
'''


@pytest.fixture
def text_method(tmp_path, monkeypatch, tiny_model_dir) -> list[str]:
    """TEXT_RECALLER_PLUGIN installed where `xmcbench` subprocesses find it; returns the tiny run settings."""
    from tests.test_registry import install_plugin, unique_package

    site = tmp_path / "site"
    install_plugin(site, unique_package(site), TEXT_RECALLER_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return [argument for setting in (f"model_name={tiny_model_dir}", *TINY_SETTINGS) for argument in ("--set", setting)]


def test_a_component_that_refuses_the_run(text_method, tmp_path, tiny_dataset, run_copy):
    (tmp_path / "texts.txt").write_text("a text\n")
    args = ["run", "text-method", "--dataset", str(tiny_dataset), *text_method, "--set",
            f"options.label_file={tmp_path / 'texts.txt'}", "--output"]
    refused = xmcbench(*args, str(tmp_path / "out"))
    assert_one_line_error(refused, "recaller text-recaller refuses this run: it reads label texts, and none of the 8 "
                                   "labels has one; use a dataset with label texts")
    assert not (tmp_path / "out").exists()   # refused while planned: no folder, no .xmcbench-run
    before = snapshot(run_copy)
    assert_one_line_error(xmcbench(*args, str(run_copy), "--overwrite"), "recaller text-recaller refuses this run")
    assert snapshot(run_copy) == before and not list(run_copy.parent.glob(".*xmcbench-replacement"))


def test_a_required_option_that_is_not_set(text_method, tmp_path, tiny_dataset):
    refused = xmcbench("run", "text-method", "--dataset", str(tiny_dataset), *text_method, "--output",
                       str(tmp_path / "out"))
    assert_one_line_error(refused, "recaller text-recaller needs options.label_file (one text per label), which has no "
                                   "default: add --set options.label_file=VALUE")
    assert not (tmp_path / "out").exists()


def test_a_path_option_that_names_no_readable_file(text_method, tmp_path, tiny_dataset):
    for value, message in ((tmp_path / "missing.txt", f"options.label_file={tmp_path / 'missing.txt'}: no such file"),
                           (tmp_path, f"options.label_file={tmp_path} is a folder; give the path of a file")):
        refused = xmcbench("run", "text-method", "--dataset", str(tiny_dataset), *text_method, "--set",
                           f"options.label_file={value}", "--output", str(tmp_path / "out"))
        assert_one_line_error(refused, message)
    assert not (tmp_path / "out").exists()


def _resign(model: Path, change) -> None:
    """Edit model.json as an attacker would: consistently, with its own checksum recomputed."""
    from xmcbench.modelio import signed_description
    meta = json.loads((model / "model.json").read_text())
    change(meta)
    meta.pop("model_json_sha256", None)
    (model / "model.json").write_text(json.dumps(signed_description(meta)))


@pytest.mark.slow
def test_a_model_folder_that_reaches_outside_itself(run_copy, tiny_model_dir):
    from xmcbench.modelio import load_model_dir
    from xmcbench.registry import build_registry

    registry, model = build_registry(), run_copy / "model"
    original = (model / "model.json").read_text()
    for value in (str(tiny_model_dir), "bert-base-uncased", "../elsewhere"):
        _resign(model, lambda meta: meta["encoder_params"].update(model_name=value))
        with pytest.raises(XmcError, match="may only refer to its own encoder/ folder") as error:
            load_model_dir(run_copy, registry)
        one_line(error)
        (model / "model.json").write_text(original)
    _resign(model, lambda meta: meta.pop("files"))                         # checksums switched off
    with pytest.raises(XmcError, match="'files'"):
        load_model_dir(run_copy, registry)
    (model / "model.json").write_text(original)
    meta = json.loads(original)
    meta["config"]["hidden_size"] = 9                                       # edited, not re-signed
    (model / "model.json").write_text(json.dumps(meta))
    with pytest.raises(XmcError, match="does not match its own checksum"):
        load_model_dir(run_copy, registry)


def test_a_checkpoint_pointer_outside_the_run(tmp_path):
    from xmcbench.checkpoint import load_checkpoint

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in (str(elsewhere), "../elsewhere", ".."):
        (checkpoints / "latest.json").write_text(json.dumps({"directory": name, "step": 1}))
        with pytest.raises(XmcError, match="not a checkpoint folder inside") as error:
            load_checkpoint(checkpoints)
        one_line(error)


def test_cr_only_line_endings(tmp_path):
    folder = write(tmp_path / "mac", {"train_texts.txt": "alpha beta\rgamma\rdelta epsilon\r",
                                       "train_labels.txt": "a b\rb\rc\r"})
    with pytest.raises(XmcError, match="lone carriage return") as error:
        load_dataset_from_path(folder)
    assert "train_texts.txt" in one_line(error)
    kept = load_dataset_from_path(write(tmp_path / "inside", {"train_texts.txt": "alpha\rbeta\ngamma\ndelta\n"}))
    assert kept.train_texts[0] == "alpha\rbeta" and kept.report["lone_carriage_returns"] == 1


@pytest.mark.slow
def test_predict_reads_lines_on_newline_only(finished_run):
    texts = "alpha\x0cbeta\ngamma\x85delta\u2028epsilon\nzeta\r\n".encode()
    found = subprocess.run([sys.executable, "-m", "xmcbench", "predict", str(finished_run)], input=texts,
                           capture_output=True)
    assert found.returncode == 0, found.stderr
    assert len(found.stdout.decode().splitlines()) == 3
    binary = subprocess.run([sys.executable, "-m", "xmcbench", "predict", str(finished_run)],
                            input=bytes(range(256)) * 4, capture_output=True)
    assert binary.returncode == 0 and b"Traceback" not in binary.stderr, binary.stderr
    for top_k in ("0", "100000"):
        refused = subprocess.run([sys.executable, "-m", "xmcbench", "predict", str(finished_run), "--top-k", top_k],
                                 input=b"alpha\n", capture_output=True, text=False)
        assert refused.returncode == 2 and b"--top-k must be between 1 and 1000" in refused.stderr


def test_labels_are_separated_by_spaces_and_tabs_only(tmp_path):
    folder = write(tmp_path / "unicode", {"train_labels.txt": "a\u00a0b\nb\tc\nc\u2028d\n"})
    ds = load_dataset_from_path(folder)
    assert {"a\u00a0b", "b", "c", "c\u2028d"} <= set(ds.label_names)
    assert data.split_labels("x\u00a0y  z\tw") == ["x\u00a0y", "z", "w"]


OUT_OF_RANGE = ["epochs=0", "epochs=-1", "validation_size=-10", "max_train_docs=-60", "top_clusters=0",
                "hidden_size=0", "weight_decay=-5", "max_length=0", "max_length=100000", "batch_size=0", "lr=-1",
                "lr=nan", "dropout=2", "threads=-3", "seed=-1", "eval_batch_size=0", "swa_every_steps=0",
                "top_k=1", "num_clusters=6", "head_lr=inf", "patience=-1"]


@pytest.mark.parametrize("setting", OUT_OF_RANGE)
def test_settings_out_of_range(setting, tiny_dataset):
    from xmcbench.registry import build_registry

    with pytest.raises(XmcError, match=setting.split("=")[0]) as error:
        plan_run(build_registry(), "lightxml", str(tiny_dataset), set_options=[setting])
    one_line(error)


def test_settings_out_of_range_on_the_command_line(tmp_path, tiny_dataset):
    refused = xmcbench("run", "lightxml", "--dataset", str(tiny_dataset), "--output", str(tmp_path / "run"),
                       "--threads", "-3")
    assert_one_line_error(refused, "threads=-3 is out of range")
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_with_a_bad_or_damaged_config(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"method": "lightxml", "dataset": "x", "config": {"epochs": 0}}))
    assert_one_line_error(xmcbench("run", "--resume", str(run_dir)), "epochs=0 is out of range")
    (run_dir / "config.json").write_text('{"method": "lightxml", "data')
    assert_one_line_error(xmcbench("run", "--resume", str(run_dir)), "config.json is damaged")


def test_dataset_names_that_clash_or_differ_in_case(tmp_path, tiny_dataset):
    import shutil
    from xmcbench.registry import build_registry

    registry = build_registry()
    named_like_a_preset = Path(shutil.copytree(tiny_dataset, tmp_path / "Wiki-500K"))
    plan = plan_run(registry, "lightxml", str(named_like_a_preset))
    assert plan.preset == "wiki500k" and plan.config.num_clusters == 8192
    (tmp_path / "debian-debtags-mini").mkdir()
    refused = xmcbench("config", "lightxml", "--dataset", "debian-debtags-mini", cwd=tmp_path)
    assert_one_line_error(refused, "both a registered dataset and a folder", "./debian-debtags-mini")


def test_plugins_that_exit_raise_or_print_at_import(tmp_path, monkeypatch, capsys):
    import importlib.metadata
    from xmcbench.registry import build_registry

    bodies = {"exits": "import sys\nsys.exit(0)\n", "interrupts": "raise KeyboardInterrupt\n",
              "prints": "print('hello from a plugin')\n"}
    for name, body in bodies.items():
        (tmp_path / f"plugin_that_{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [importlib.metadata.EntryPoint(name, f"plugin_that_{name}", "xmcbench") for name in bodies]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: points + list(real(**kw)) if kw.get("group") == "xmcbench" else real(**kw))
    registry = build_registry()
    failed = {f.name: f.error for f in registry.failed}
    assert "SystemExit" in failed["exits"] and "KeyboardInterrupt" in failed["interrupts"]
    assert "lightxml" in registry.methods
    captured = capsys.readouterr()
    assert captured.out == "" and "hello from a plugin" in captured.err


def test_os_errors_end_in_one_line(tmp_path, tiny_dataset, monkeypatch, capsys):
    from xmcbench import cli

    config_file = tmp_path / "bad.toml"
    config_file.write_bytes(b"epochs = 2\n# caf\xe9\n")
    assert_one_line_error(xmcbench("config", "lightxml", "--config", str(config_file)), "not UTF-8")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    refused = xmcbench("run", "lightxml", "--dataset", str(tiny_dataset), "--output", str(a_file),
                       "--set", "epochs=1")
    assert_one_line_error(refused, "is a file", progress_lines=len(refused.stderr.splitlines()) - 1)
    assert a_file.read_text() == "mine\n"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "metrics.json"))

    monkeypatch.setattr(launch, "run", disk_full)
    monkeypatch.setattr(sys, "argv", ["xmcbench", "run", "lightxml", "--dataset", str(tiny_dataset)])
    with pytest.raises(SystemExit) as exit_status:
        cli.main()
    assert exit_status.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "No space left on device" in error and "metrics.json" in error


def test_a_huge_line_is_cut_before_tokenizing(tiny_model_dir):
    from xmcbench.tokenization import MAX_CHARACTERS_PER_TOKEN, load_tokenizer, tokenize

    tokenizer = load_tokenizer(str(tiny_model_dir))
    seen = []
    real_call = type(tokenizer).__call__

    def spy(self, texts, *args, **kwargs):
        seen.extend(len(text) for text in texts)
        return real_call(self, texts, *args, **kwargs)

    huge = "word " * 2_000_000                                  # 10 MB
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(tokenizer), "__call__", spy)
        tokens = tokenize([huge, "short"], tokenizer, 16, texts_key=None)
    assert max(seen) <= 16 * MAX_CHARACTERS_PER_TOKEN and tokens.lengths.tolist()[0] == 16


@pytest.mark.slow
def test_a_model_trained_elsewhere_loads_here_and_can_be_shared(run_copy):
    import os
    import stat

    _resign(run_copy / "model", lambda meta: meta["config"].update(device="cuda:3", threads=64))
    assert len(predict_texts(run_copy, ["alpha beta"], top_k=2)) == 1   # runs here, on this machine's device
    mask = os.umask(0o022)
    os.umask(mask)
    for path in (run_copy / "model" / "weights.safetensors", run_copy / "metrics.json"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o044 == 0o644 & ~mask & 0o044, (path, oct(mode))


# ---------------------------------------------------------------------------------------- saved files reused, run
# folders received from others, reports, full disks (the third reliability pass)


def _copy(source: Path, destination: Path) -> Path:
    import shutil
    return Path(shutil.copytree(source, destination))


def _dataset_of(run: Path) -> str:
    return json.loads((run / "config.json").read_text())["dataset"]


def _with_file_size_limit(limit: int, *args: str) -> subprocess.CompletedProcess:
    """An xmcbench command whose writes beyond `limit` bytes per file fail, as on a full disk (RLIMIT_FSIZE)."""
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return subprocess.run([sys.executable, "-m", "xmcbench", *args], capture_output=True, text=True,
                          preexec_fn=limited)


def _rewrite(path: Path, change) -> None:
    """Change the arrays of a safetensors file in place, as an edit after the run would."""
    from safetensors.numpy import load_file, save_file

    arrays = load_file(str(path))
    change(arrays)
    save_file(arrays, str(path))


def test_a_run_folder_that_steers_writes_outside_itself(run_copy, tmp_path, monkeypatch, capsys):
    import types

    from xmcbench.config import TrainConfig
    from xmcbench.rundir import run_path

    # a received run whose tensorboard/ links elsewhere: resuming it is refused before anything is written
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_copy / "metrics.json").unlink()
    config = json.loads((run_copy / "config.json").read_text())
    config["config"]["loggers"] = ["tensorboard"]
    (run_copy / "config.json").write_text(json.dumps(config))
    (run_copy / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    refused = xmcbench("run", "--resume", str(run_copy))
    assert_one_line_error(refused, f"{run_copy / 'tensorboard'} is a symbolic link", "a run folder may hold no links",
                          progress_lines=len(refused.stderr.splitlines()) - 1)
    assert not any(elsewhere.iterdir())
    with pytest.raises(XmcError, match="is a symbolic link"):
        run_path(run_copy, "tensorboard", "events")
    with pytest.raises(XmcError, match="not a path inside the run folder"):
        run_path(run_copy, "../outside")

    # a received run whose mlflow_run.json names another store: the run's own store is used, and it says so
    from xmcbench_loggers import mlflow_log

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    foreign = tmp_path / "foreign-store"
    received = tmp_path / "received"
    received.mkdir()
    (received / "mlflow_run.json").write_text(json.dumps({"tracking_uri": foreign.as_uri(), "run_id": "0" * 32}))
    logger = mlflow_log.build(received, TrainConfig())
    logger.on_train_begin(types.SimpleNamespace(step=0))
    assert not foreign.exists() and logger.run_id is not None and not logger.failed
    assert logger.tracking_uri == mlflow_log._local_tracking_uri(received)
    assert "does not choose where its metrics go" in capsys.readouterr().err


HOSTILE_METHOD = '<img src=x onerror="alert(1)"> <iframe src="javascript:alert(2)"></iframe> | x $\\oops$ `a`'
HOSTILE_DATASET = "[click](javascript:alert(3))\n# a heading of its own | x"
HOSTILE_MODEL = "<script>alert(4)</script>\r\n<b>bold</b>"


def _rendered(markdown: str) -> tuple[str, str, list[list[str]]]:
    """A report as GitHub renders it (CommonMark with tables and raw HTML, every link kept, so that a link a
    name slipped in shows): the HTML, its text, and the text of the cells of each table row."""
    import html
    import re
    from markdown_it import MarkdownIt

    renderer = MarkdownIt("commonmark", {"html": True}).enable("table")
    renderer.validateLink = lambda url: True
    page = renderer.render(markdown)
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    rows = [[html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", page, re.S)]
    return page, text, rows


def test_report_names_from_run_folders_are_escaped(tmp_path):
    import re

    from xmcbench import report

    results = _copy(REPO / "tests" / "fixtures" / "report" / "results", tmp_path / "results")
    for seed in range(3):
        run = results / "lightxml-static" / f"seed{seed}"
        config = json.loads((run / "config.json").read_text())
        config.update(method=HOSTILE_METHOD, dataset_name=HOSTILE_DATASET)
        config["config"]["model_name"] = HOSTILE_MODEL
        (run / "config.json").write_text(json.dumps(config))
    runs = report.load_runs([results], log=lambda line: None)
    page, text, rows = _rendered(report.write_report(runs, tmp_path / "report", baseline="lightxml").read_text())
    assert not re.search(r"<(iframe|script|b)\b", page) and "javascript:" not in " ".join(
        re.findall(r'href="[^"]*"', page))
    assert set(re.findall(r'<img src="([^"]*)"', page)) == {"loss_curves.png", "precision.png"}   # its figures only
    assert page.count("<h1>") == 1   # the report's own title: no heading from a name
    assert any(row[0] == HOSTILE_METHOD for row in rows)   # one cell, shown as it is: the | split nothing
    assert "[click](javascript:alert(3)) # a heading of its own | x" in text   # shown, line break as a space
    assert "<script>alert(4)</script> <b>bold</b>" in text
    for name in ("loss_curves.png", "precision.png"):   # `$\oops$` drawn as text, not read as a formula
        assert (tmp_path / "report" / name).stat().st_size > 0
    latex = report.write_report(runs, tmp_path / "latex", fmt="latex").parent / "table.tex"
    assert not any(line.startswith(("# a heading", "<b>")) for line in latex.read_text().splitlines())
    rows_json = json.loads(report.render_table(report.summarize(runs), "json"))["rows"]
    assert any(row["method"] == HOSTILE_METHOD for row in rows_json)


def test_a_model_folder_holds_exactly_the_files_it_lists(run_copy):
    from xmcbench.modelio import load_model_dir
    from xmcbench.registry import build_registry

    added = run_copy / "model" / "encoder" / "special_tokens_map.json"
    added.write_text(json.dumps({"cls_token": "[SEP]"}))   # would change every prediction; no checksum covers it
    with pytest.raises(XmcError) as error:
        load_model_dir(run_copy, build_registry())
    assert f"{added} is not one of the files model.json lists" in one_line(error)
    refused = subprocess.run([sys.executable, "-m", "xmcbench", "predict", str(run_copy)], input="alpha\n",
                             capture_output=True, text=True)
    assert_one_line_error(refused, "special_tokens_map.json", "not one of the files model.json lists")


def test_an_ensemble_or_a_conversion_that_fails_midway_keeps_what_was_there(finished_run, tmp_path, monkeypatch):
    member = _copy(finished_run, tmp_path / "member")
    output = tmp_path / "ensemble"
    built = xmcbench("ensemble", str(finished_run), str(member), "--output", str(output))
    assert built.returncode == 0, built.stderr
    before = snapshot(output)
    # the same ensemble again, on a disk that cannot hold its largest file (metrics.json, written last)
    full = _with_file_size_limit(max(len(content) for content in before.values()) - 1, "ensemble",
                                 str(finished_run), str(member), "--output", str(output), "--overwrite")
    assert_one_line_error(full, "File too large", progress_lines=len(full.stderr.splitlines()) - 1)
    assert snapshot(output) == before and not list(tmp_path.glob(".ensemble.xmcbench-*"))

    # convert: a format's writer that fails on its third file leaves no half-written dataset
    import xmcbench_formats.raw_text as raw_text
    from xmcbench.formats import write_dataset
    from xmcbench.registry import build_registry

    written = []
    real_write = raw_text.atomic_write

    def third_fails(path, write):
        written.append(path)
        if len(written) == 3:
            raise OSError(28, "No space left on device", str(path))
        real_write(path, write)

    monkeypatch.setattr(raw_text, "atomic_write", third_fails)
    dataset = load_dataset_from_path(write(tmp_path / "d"))
    with pytest.raises(OSError):
        write_dataset(build_registry(), dataset, tmp_path / "converted", "raw_text")
    assert not (tmp_path / "converted").exists() and not list(tmp_path.glob(".converted.xmcbench-*"))


def test_a_report_over_runs_of_two_datasets(finished_run, tmp_path):
    from xmcbench import report

    other = _copy(finished_run, tmp_path / "other")
    for name, key in (("config.json", "dataset_name"), ("metrics.json", "dataset")):
        recorded = json.loads((other / name).read_text())
        recorded[key] = "other-topics"
        (other / name).write_text(json.dumps(recorded))
    runs = report.load_runs([finished_run, other], log=lambda line: None)
    assert all(run.frequency_bins for run in runs)
    text = report.write_report(runs, tmp_path / "report").read_text()
    first = json.loads((finished_run / "config.json").read_text())["dataset_name"]
    for dataset in (first, "other-topics"):
        assert text.count(f"### {dataset}") == 2   # its results, and its head and tail
    assert (tmp_path / "report" / "frequency_bins.png").stat().st_size > 0


def test_a_score_matrix_whose_structure_is_inconsistent(finished_run, tmp_path):

    matrix = sp.load_npz(finished_run / "predictions.npz").tocsr()
    indptr = matrix.indptr.copy()
    indptr[1] = indptr[-1] + 7   # row 0 claims more entries than the matrix holds
    path = tmp_path / "scores.npz"
    np.savez(path, data=matrix.data, indices=matrix.indices, indptr=indptr, format=np.array(b"csr"),
             shape=np.array(matrix.shape))
    with pytest.raises(XmcError) as error:
        evaluate_predictions(path, _dataset_of(finished_run))
    assert one_line(error).startswith(f"{path} is not a consistent sparse matrix (")
    assert_one_line_error(xmcbench("evaluate", "--predictions", str(path), "--dataset", _dataset_of(finished_run)),
                          "is not a consistent sparse matrix")


def _set(array_name: str, index, value):
    def change(arrays):
        arrays[array_name][index] = value
    return change


DAMAGE = {   # what a member's saved test predictions may hold after an edit, and the line that refuses it
    "label 999": (_set("labels", (0, 0), 999), "row 0 holds label id 999, outside the"),
    "label -5": (_set("labels", (0, 0), -5), "row 0 holds label id -5"),
    "a NaN score": (_set("scores", (0, 0), np.nan), "row 0 has a score that is not a finite number"),
    "a repeated label": (lambda arrays: arrays["labels"].__setitem__((0, 1), arrays["labels"][0, 0]), "twice"),
    "unsorted scores": (_set("scores", (0, 1), 5.0), "not in descending order"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_saved_predictions_damaged_after_they_were_written(finished_run, tmp_path, damage):
    from xmcbench import ensemble, report

    change, fragment = DAMAGE[damage]
    member = _copy(finished_run, tmp_path / "member")
    _rewrite(member / "predictions.safetensors", change)
    with pytest.raises(XmcError) as error:   # an ensemble member's
        ensemble.build_ensemble([finished_run, member], tmp_path / "ensemble", log=lambda line: None)
    message = one_line(error)
    assert message.startswith(f"{member / 'predictions.safetensors'}: ") and fragment in message
    assert "delete it, and the ensemble predicts the test split with the model of" in message
    assert not (tmp_path / "ensemble").exists()
    before = snapshot(member)
    with pytest.raises(XmcError, match=fragment):   # rescore's, which leaves metrics.json as it was
        rescore_run(member, log=lambda line: None)
    assert snapshot(member) == before
    assert report.load_runs([member], log=lambda line: None)[0].top1 is None   # the report's checks skip it


def test_saved_predictions_that_cannot_be_read_or_validation_labels_repeated(finished_run, tmp_path):
    from xmcbench import ensemble

    run = _copy(finished_run, tmp_path / "unreadable")
    (run / "predictions.safetensors").write_bytes(b"\x00\x01 not safetensors \xff" * 20)
    before = snapshot(run)
    with pytest.raises(XmcError) as error:
        rescore_run(run, log=lambda line: None)
    assert one_line(error).startswith(f"{run / 'predictions.safetensors'} cannot be read (")
    assert snapshot(run) == before

    # weighted fusion: validation predictions that repeat one label would weigh that member wrongly
    members = [_copy(finished_run, tmp_path / name) for name in ("a", "b")]
    rows = np.arange(8)
    labels = np.tile(np.arange(5), (len(rows), 1))
    scores = np.tile(np.linspace(0.9, 0.5, 5, dtype=np.float32), (len(rows), 1))
    for member in members:
        save_validation_predictions(member / VALIDATION_PREDICTIONS_FILE, labels, scores, rows)
    repeated = labels.copy()
    repeated[:, 1:] = repeated[:, :1]
    save_validation_predictions(members[1] / VALIDATION_PREDICTIONS_FILE, repeated, scores, rows)
    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble(members, tmp_path / "weighted", top_k=5, fusion="weighted", log=lambda line: None)
    assert one_line(error).startswith(f"{members[1] / VALIDATION_PREDICTIONS_FILE}: row 0 names label 0 twice")


def test_a_pecos_folder_with_nan_features(tmp_path):
    from xmcbench.registry import build_registry

    folder = tmp_path / "pecos"
    folder.mkdir()
    features = sp.csr_matrix(np.array([[1.0, 0.0], [np.nan, 2.0], [0.5, 0.5], [0.0, 1.0]], dtype=np.float32))
    for short in ("trn", "tst"):
        sp.save_npz(folder / f"Y.{short}.npz", sp.csr_matrix(np.eye(4, 3, dtype=np.float32)))
        sp.save_npz(folder / f"X.{short}.npz", features)
    with pytest.raises(XmcError) as error:
        open_dataset(build_registry(), str(folder))
    assert one_line(error).startswith(f"{folder / 'X.trn.npz'}: a feature value is not a finite number")
    converted = xmcbench("convert", str(folder), str(tmp_path / "out"), "--to", "xc_sparse")
    assert_one_line_error(converted, "X.trn.npz", "not a finite number")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_full_disk_during_a_run_is_one_line(finished_run, tiny_model_dir, tiny_dataset, tmp_path):
    weights = (finished_run / "model" / "weights.safetensors").stat().st_size
    full = _with_file_size_limit(weights // 2, *run_args(tiny_model_dir, tiny_dataset, tmp_path / "run"))
    error = assert_one_line_error(full, "File too large", "free space or fix the permissions there",
                                  progress_lines=len(full.stderr.splitlines()) - 1)
    assert str(tmp_path / "run") in error


def test_predict_arguments_of_the_wrong_type(finished_run):
    from xmcbench import api

    predictor = api.load(finished_run)
    for arguments, fragment in (({"top_k": 2.5}, "top_k must be a whole number"), ({"top_k": "3"}, "got '3' (str)"),
                                ({"top_k": True}, "got True (bool)"), ({"threshold": "0.5"}, "threshold must be"),
                                ({"threshold": float("nan")}, "got nan")):
        with pytest.raises(XmcError) as error:
            predictor.predict(["alpha"], **arguments)
        assert fragment in one_line(error), arguments
    assert len(predictor.predict(["alpha"], top_k=np.int64(2), threshold=0)[0]["labels"]) <= 2
    refused = subprocess.run([sys.executable, "-m", "xmcbench", "predict", str(finished_run), "--threshold", "nan"],
                             input="alpha\n", capture_output=True, text=True)
    assert_one_line_error(refused, "threshold must be a finite number")


def test_a_setting_given_wins_over_a_tree_the_method_derives(tiny_model_dir, tiny_dataset):
    from xmcbench.indexing import num_clusters_for, resolve_num_clusters
    from xmcbench.registry import build_registry

    registry = build_registry()
    if "cascade" not in registry.methods:
        pytest.skip("the cascade plugin package (plugins/xmcbench-cascade) is not installed")
    plan = plan_run(registry, "cascade", str(tiny_dataset), set_options=[f"model_name={tiny_model_dir}",
                                                                        "cluster_size=2"])
    labels = plan.statistics.labels
    assert plan.config.cluster_size == 2
    assert resolve_num_clusters(plan.config, labels) == num_clusters_for(labels, 2)


def test_a_tracking_server_that_does_not_answer(tmp_path, monkeypatch, capsys):
    import socket
    import threading
    import time
    import types

    from xmcbench.config import TrainConfig
    from xmcbench_loggers import mlflow_log

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)   # connections are accepted by the system, and never answered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.getsockname()[1]}")
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    # the bound, shortened for the test (10 s and one retry by default)
    monkeypatch.setattr(mlflow_log, "BOUNDED_WAITS", {"MLFLOW_HTTP_REQUEST_TIMEOUT": "1",
                                                      "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                                                      "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}, raising=False)
    logger = mlflow_log.build(tmp_path, TrainConfig())
    fake = types.SimpleNamespace(step=1)
    started = time.perf_counter()
    session = threading.Thread(target=lambda: (logger.on_train_begin(fake),
                                               logger.on_log(fake, [{"step": 1, "loss": 0.5}]),
                                               logger.on_train_end(fake)), daemon=True)
    session.start()
    session.join(timeout=60)
    server.close()
    assert not session.is_alive(), "the logger is still waiting for the tracking server"
    assert time.perf_counter() - started < 30
    warned = [line for line in capsys.readouterr().err.splitlines() if "mlflow" in line]
    assert len(warned) == 1 and "training goes on without MLflow logging" in warned[0]
    assert logger.failed and logger.run_id is None


def test_latin1_bytes_in_a_csv_are_counted(tmp_path):
    from xmcbench.registry import build_registry

    folder = tmp_path / "csv"
    folder.mkdir()
    (folder / "train.csv").write_bytes(b"text,labels\ncaf\xe9 au lait,a|b\nplain text,b\ncr\xe8me,c\n")
    (folder / "test.csv").write_bytes(b"text,labels\nna\xefve,a\nplain \xef\xbf\xbd,b\n")   # a real U+FFFD too
    dataset = open_dataset(build_registry(), str(folder))
    assert dataset.train_texts[0] == "caf\ufffd au lait" and dataset.test_texts[1] == "plain \ufffd"
    assert dataset.report["non_utf8_lines"] == 3   # as the raw-text reader counts the same repair


def test_jsonl_label_cells_that_name_no_label(tmp_path):
    from xmcbench.registry import build_registry

    for cell, document, what in (({"a": 1}, 1, "it holds a JSON object"), ([["a", "b"], "c"], 2,
                                                                           "its list holds a JSON list")):
        folder = tmp_path / f"jsonl-{document}"
        folder.mkdir()
        rows = [{"text": "alpha", "labels": ["a"]}, {"text": "beta", "labels": ["b"]}]
        rows[document - 1]["labels"] = cell
        for name in ("train.jsonl", "test.jsonl"):
            (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(XmcError) as error:
            open_dataset(build_registry(), str(folder))
        assert one_line(error).startswith(f"{folder / 'test.jsonl'}: the label cell of document {document} names "
                                          f"no label: {what}") or \
            one_line(error).startswith(f"{folder / 'train.jsonl'}: the label cell of document {document} names "
                                       f"no label: {what}")


def test_evaluate_with_label_names_of_another_dataset(finished_run, tmp_path):
    columns = sp.load_npz(finished_run / "predictions.npz").shape[1]
    names = tmp_path / "names.json"
    names.write_text(json.dumps([f"not-a-label-{i}" for i in range(columns)]))
    refused = xmcbench("evaluate", "--predictions", str(finished_run / "predictions.npz"), "--dataset",
                       _dataset_of(finished_run), "--labels", str(names))
    assert_one_line_error(refused, f"none of the {columns} label names in {names}", "every prediction would miss")


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
# Label names: anything but the separators (space, tab) and line ends; Unicode spaces (NBSP, U+2028, form
# feed) belong to the name.
LABEL_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters=" \t\n\r\ufeff")
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
        try:
            expected = data._read_lines(path, whole)
        except XmcError as refusal:   # more lone \r than lines: refused, whatever the blocks
            assert "lone carriage return" in str(refusal)
            expected = refusal
        original = data._BLOCK_BYTES
        data._BLOCK_BYTES = block
        try:
            cut: dict[str, int] = {}
            if isinstance(expected, XmcError):
                with pytest.raises(XmcError, match="lone carriage return"):
                    data._read_lines(path, cut)
                return
            assert data._read_lines(path, cut) == expected
        finally:
            data._BLOCK_BYTES = original
    assert cut == whole
    ended = content.removeprefix(b"\xef\xbb\xbf")
    ended += b"" if not ended or ended.endswith(b"\n") else b"\n"   # as the reader ends the last line
    assert whole.get("lone_carriage_returns", 0) == ended.replace(b"\r\n", b"").count(b"\r") <= len(expected)
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


# ------------------------------------------------------------------------------ property tests: settings, stdin

NUMBERS = st.integers(-10**12, 10**12) | st.floats(allow_nan=True, allow_infinity=True) | \
    st.sampled_from([0, 1, -1, 5, 1000, 1001, 2**32, 0.5, 1.0])


@settings(max_examples=200, deadline=None)
@given(values=st.dictionaries(st.sampled_from(sorted(SETTING_RANGES) + ["dropout"]), NUMBERS, max_size=4))
def test_the_settings_validator_accepts_exactly_the_ranges(values):
    """Any numbers for any settings: either every value is within its documented range and the settings pass,
    or one XmcError line names an offending setting. Never another exception."""
    import math
    from xmcbench.config import TrainConfig, apply_overrides

    try:
        config = apply_overrides(TrainConfig(), {k: str(v) for k, v in values.items()}, "--set")
    except XmcError:   # a float for an int setting: refused by type, before ranges
        return
    try:
        config.validate()
    except XmcError as error:
        assert "\n" not in str(error) and any(f"{key}=" in str(error) for key in values), str(error)
        return
    for key in values:
        value = getattr(config, key)
        if key == "dropout":
            assert 0 <= value < 1
            continue
        low, high = SETTING_RANGES[key]
        assert not (isinstance(value, float) and not math.isfinite(value))
        assert (low is None or value >= low) and (high is None or value <= high)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=80) | st.lists(st.sampled_from(
    [b"\n", b"\r\n", b"\r", b"\x0c", b"\x0b", b"\x1c", b"\xc2\x85", b"\xe2\x80\xa8", b"\xff", b"ab", b" "]),
    max_size=20).map(b"".join))
def test_stdin_is_split_on_newlines_only(raw):
    """predict's stdin: one text per \\n (a \\r\\n counts once), whatever else the bytes hold; CR-only input refused."""
    try:
        lines = data.lines_of_bytes(raw, "stdin")
    except XmcError as error:
        assert "lone carriage return" in str(error)
        return
    expected = raw.count(b"\n") + (1 if raw and not raw.endswith(b"\n") else 0)
    assert len(lines) == expected and all("\n" not in line for line in lines)


def test_resume_of_a_whole_method_without_checkpoints(tmp_path):
    pytest.importorskip("napkinxc")
    data = write_tiny_dataset(tmp_path / "tiny")
    run = tmp_path / "run"
    assert xmcbench("run", "plt", "--dataset", str(data), "--output", str(run)).returncode == 0
    (run / "metrics.json").unlink()   # as if the fit had been interrupted
    before = sorted(path.name for path in run.iterdir())
    assert_one_line_error(xmcbench("run", "--resume", str(run)), "plt keeps no checkpoint while it fits",
                          "--overwrite")
    assert sorted(path.name for path in run.iterdir()) == before


def test_a_whole_method_on_a_device_it_cannot_use(tmp_path):
    pytest.importorskip("napkinxc")
    data = write_tiny_dataset(tmp_path / "tiny")
    result = xmcbench("run", "plt", "--dataset", str(data), "--output", str(tmp_path / "run"), "--set", "device=cuda")
    # without a GPU torch refuses cuda first; with one, plt refuses it as a CPU-only method
    assert_one_line_error(result, "device=cuda")
    assert not (tmp_path / "run").exists()


def test_an_unknown_score_combiner(tmp_path):
    assert_one_line_error(xmcbench("config", "lightxml", "--set", "score_combiner=max"),
                          "score_combiner='max' is not one of product, weighted-sum")
    assert_one_line_error(xmcbench("config", "lightxml", "--set", "ranker_weight=1.5"), "ranker_weight=1.5 is out of range")


def test_an_unknown_validation_split(tmp_path):
    assert_one_line_error(xmcbench("config", "lightxml", "--set", "validation_split=by-package"),
                          "validation_split='by-package' is not one of random, grouped")


def test_a_zero_shot_share_out_of_range(tmp_path):
    assert_one_line_error(xmcbench("config", "lightxml", "--set", "zero_shot_labels=1"),
                          "zero_shot_labels=1 is out of range")

