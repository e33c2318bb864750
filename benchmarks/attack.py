"""Attack xmcbench as a careless or hostile user would, and count what happens.

    python benchmarks/attack.py                      # the installed xmcbench
    python benchmarks/attack.py --code OLD_CHECKOUT  # another checkout (its xmcbench/ and plugins/ first on the path)
    python benchmarks/attack.py --only "issue 27"    # the cases whose name holds this text

The cases named "issue 27: N ..." are the 18 cases of that issue (a run folder that steers writes outside
itself, hostile names in reports, a model folder with files it does not list, a full disk, saved predictions
damaged after they were written, trackers that do not answer, ...); case 1 has two ways in (MLflow, TensorBoard).
A full disk is a file size limit (RLIMIT_FSIZE) on the command: its writes beyond it fail as on a full disk.

Every case runs the `xmcbench` command line in a fresh process, on tiny models and datasets built here, and is
classified as one of:
    clear       exit status 2 and one `xmcbench: error: ...` line on stderr (what a refusal should be)
    ok          the command worked, and its result is right
    traceback   a Python traceback reached the user
    silent      exit status 0 with a wrong result, or a bad input accepted without a word
    data-loss   files the user had were changed or deleted
    security    a run or model folder made xmcbench read something outside itself
Prints one line per case and the counts per class.
"""

from __future__ import annotations

import argparse
import collections
import functools
import html.parser
import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from xmcbench.testing import make_tiny_transformer, write_tiny_dataset

TINY = ("pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32", "threads=1", "cluster_size=2",
        "top_clusters=2", "hidden_size=8")
BAD_SETTINGS = ("epochs=0", "epochs=-1", "validation_size=-10", "max_train_docs=-60", "top_clusters=0",
                "hidden_size=0", "weight_decay=-5", "max_length=0", "batch_size=0", "lr=-1", "lr=nan", "dropout=2",
                "seed=-1", "eval_batch_size=0", "swa_every_steps=0", "max_length=100000", "top_k=1",
                "num_clusters=6", "patience=-1", "threads=-3")


class Attack:
    def __init__(self, code: Path | None, work: Path):
        self.work = work
        self.env = dict(os.environ, XMCBENCH_CACHE=str(work / "cache"), XMCBENCH_PROGRESS_SECONDS="3600")
        if code is not None:   # the core, the built-in plugins and the plugin packages (cascade, ...) of that checkout
            packages = sorted(str(folder) for folder in (code / "plugins").glob("xmcbench-*") if folder.is_dir())
            self.env["PYTHONPATH"] = os.pathsep.join([str(code), str(code / "plugins"), *packages])
        self.model = make_tiny_transformer(work / "tiny-bert")
        self.dataset = write_tiny_dataset(work / "tiny-topics")
        self.finished = self.train(work / "finished", "keep_checkpoint=true")

    def xmcbench(self, *args: str, stdin: bytes = b"", env: dict | None = None, cwd: Path | None = None,
                 file_size_limit: int | None = None, timeout: float | None = None):
        """The command in a fresh process. file_size_limit: writes beyond this many bytes per file fail, as on a
        full disk (RLIMIT_FSIZE; Python ignores the signal it sends, so a write fails with EFBIG)."""
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))

        # run from the work folder: `python -m` puts the current folder first on the path, which would pick
        # a checkout's xmcbench/ over --code's
        return subprocess.run([sys.executable, "-m", "xmcbench", *args], input=stdin, capture_output=True,
                              env=env or self.env, cwd=cwd or self.work, timeout=timeout,
                              preexec_fn=limit if file_size_limit is not None else None)

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess:
        """A Python snippet in a fresh process with the attacked code first on the path."""
        return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, env=self.env,
                              cwd=self.work, text=True)

    @functools.cached_property
    def second(self) -> Path:
        """A second finished run (another seed), for ensembles."""
        return self.train(self.work / "second", "seed=1")

    @functools.cached_property
    def validated(self) -> Path:
        """A finished run with a validation split (validation_predictions.safetensors), for weighted ensembles."""
        return self.train(self.work / "validated", "validation_size=8")

    @functools.cached_property
    def other_dataset(self) -> Path:
        """A finished run on a second dataset, for reports over several datasets."""
        return self.train(self.work / "other-dataset", dataset=write_tiny_dataset(self.work / "tiny-other", seed=1))

    def run_args(self, output: Path, *settings: str, dataset: str | None = None) -> list[str]:
        args = ["run", "lightxml", "--dataset", dataset or str(self.dataset), "--output", str(output),
                "--set", f"model_name={self.model}"]
        for setting in (*TINY, *settings):
            args += ["--set", setting]
        return args

    def train(self, output: Path, *settings: str, dataset: Path | None = None) -> Path:
        done = self.xmcbench(*self.run_args(output, *settings, dataset=str(dataset) if dataset else None))
        if done.returncode != 0:
            raise SystemExit(f"cannot train the tiny run: {done.stderr.decode()[-2000:]}")
        return output

    def copy(self, name: str, run: Path | None = None) -> Path:
        return Path(shutil.copytree(run or self.finished, self.work / name, symlinks=True))


def verdict(result, expect: str = "clear") -> str:
    """The class of a result from its exit status and stderr (cases add their own checks on top)."""
    stderr = result.stderr.decode(errors="replace")
    if "Traceback" in stderr:
        return "traceback"
    lines = [line for line in stderr.splitlines() if line.startswith("xmcbench: error: ")]
    if result.returncode == 2 and len(lines) == 1:
        return "clear"
    if result.returncode == 0:
        return "ok" if expect == "ok" else "silent"
    return "traceback" if result.returncode not in (0, 2) else "silent"


# how long a run with an MLflow server that never answers may take before it counts as hanging
MLFLOW_WAIT = 150


class _Elements(html.parser.HTMLParser):
    """The tags of rendered HTML (tag -> their href or src, "" for others) and the text of its table cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, list[str]] = {}
        self.cells: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        self.tags.setdefault(tag, []).append(values.get("href") or values.get("src") or "")
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def render_markdown(text: str):
    """Markdown as GitHub renders reports (CommonMark with tables and raw HTML, every link kept, so that one a
    name slipped in shows) -> (the text of every table cell, the tags found), or None without markdown-it-py."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        return None
    renderer = MarkdownIt("commonmark", {"html": True}).enable("table")
    renderer.validateLink = lambda url: True
    elements = _Elements()
    elements.feed(renderer.render(text))
    return elements.cells, elements.tags


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def edit_model_json(model: Path, change) -> None:
    """Edit model.json consistently, as a hostile sender would (re-signing it when the format has a checksum)."""
    path = model / "model.json"
    meta = json.loads(path.read_text())
    change(meta)
    if "model_json_sha256" in meta:
        from xmcbench.modelio import signed_description
        meta.pop("model_json_sha256")
        meta = signed_description(meta)
    path.write_text(json.dumps(meta))


def cases(attack: Attack):
    """(name, function returning a class) for every case."""
    work = attack.work

    def overwrite_project():
        project = work / "project"
        (project / "src").mkdir(parents=True)
        (project / "src" / "main.py").write_text("print('mine')\n")
        (project / "config.json").write_text("{}\n")
        before = snapshot(project)
        result = attack.xmcbench(*attack.run_args(project, "epochs=1"), "--overwrite")
        return "data-loss" if snapshot(project) != before else verdict(result)

    def overwrite_with(name, *settings, dataset=None):
        def case():
            old = attack.copy(name)
            before = snapshot(old)
            result = attack.xmcbench(*attack.run_args(old, *settings, dataset=dataset), "--overwrite")
            return "data-loss" if snapshot(old) != before else verdict(result)
        return case

    def overwrite_killed():
        old = attack.copy("killed")
        before = snapshot(old)
        process = subprocess.Popen([sys.executable, "-m", "xmcbench", *attack.run_args(old, "epochs=50"),
                                    "--overwrite"], env=attack.env, cwd=work, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        staging = old.with_name(f".{old.name}.xmcbench-replacement")
        deadline = time.time() + 900
        while time.time() < deadline and process.poll() is None:   # until the new run has begun writing
            if not (old / "metrics.json").exists() or (staging / "config.json").exists():
                break
            time.sleep(0.2)
        time.sleep(3)
        process.kill()
        process.wait()
        return "data-loss" if snapshot(old) != before else "ok"

    def two_at_once():
        output = work / "twice"
        processes = [subprocess.Popen([sys.executable, "-m", "xmcbench", *attack.run_args(output, f"seed={seed}")],
                                      env=attack.env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                     for seed in (1, 2)]
        codes = [p.wait() for p in processes]
        return "data-loss" if codes == [0, 0] else "clear" if sorted(codes) == [0, 2] else "traceback"

    def model_name_elsewhere(value):
        def case():
            run = attack.copy(f"elsewhere-{abs(hash(value))}")
            edit_model_json(run / "model", lambda meta: meta["encoder_params"].update(model_name=value))
            result = attack.xmcbench("predict", str(run), stdin=b"alpha\n")
            return "security" if result.returncode == 0 else verdict(result)
        return case

    def checksums_removed():
        run = attack.copy("no-checksums")
        edit_model_json(run / "model", lambda meta: meta.pop("files"))
        result = attack.xmcbench("predict", str(run), stdin=b"alpha\n")
        return "security" if result.returncode == 0 else verdict(result)

    def model_json_edited():
        run = attack.copy("edited")
        path = run / "model" / "model.json"
        meta = json.loads(path.read_text())
        meta["files"].pop("labels.json", None)   # unsigned edit: one file no longer checked
        path.write_text(json.dumps(meta))
        result = attack.xmcbench("predict", str(run), stdin=b"alpha\n")
        return "security" if result.returncode == 0 else verdict(result)

    def files_outside():
        run = attack.copy("files-outside")
        edit_model_json(run / "model", lambda meta: meta["files"].update(
            {"../../../etc/hostname": {"bytes": 1, "sha256": "0" * 64}}))
        result = attack.xmcbench("predict", str(run), stdin=b"alpha\n")
        return "security" if result.returncode == 0 else verdict(result)

    def checkpoint_pointer(value_of):
        def case():
            run = attack.copy(f"pointer-{value_of.__name__}")
            (run / "metrics.json").unlink()
            elsewhere = Path(shutil.copytree(run / "checkpoints", work / f"elsewhere-{value_of.__name__}"))
            pointer = run / "checkpoints" / "latest.json"
            pointer.write_text(json.dumps({"directory": value_of(elsewhere, run), "step": 3}))
            result = attack.xmcbench("run", "--resume", str(run))
            return "security" if result.returncode == 0 else verdict(result)
        return case

    def absolute(elsewhere, run):
        return str(next(p for p in elsewhere.iterdir() if p.is_dir()))

    def parent(elsewhere, run):
        return ".."

    def mac_line_ends():
        folder = write_tiny_dataset(work / "mac")
        for name in ("train_texts.txt", "train_labels.txt", "test_texts.txt", "test_labels.txt"):
            path = folder / name
            path.write_bytes(path.read_bytes().replace(b"\n", b"\r"))
        result = attack.xmcbench(*attack.run_args(work / "mac-run", dataset=str(folder)))
        return verdict(result)

    def stdin_form_feed():
        result = attack.xmcbench("predict", str(attack.finished), stdin="a\x0cb\nc\u2028d\ne\x85f\n".encode())
        if verdict(result, "ok") != "ok":
            return verdict(result, "ok")
        return "ok" if len(result.stdout.splitlines()) == 3 else "silent"

    def stdin_binary():
        return verdict(attack.xmcbench("predict", str(attack.finished), stdin=bytes(range(256)) * 8), "ok")

    def labels_unicode_space():
        folder = write_tiny_dataset(work / "nbsp")
        path = folder / "train_labels.txt"
        path.write_text(path.read_text().replace(" ", "\u00a0", 1))
        probe = ("from xmcbench.data import load_dataset_from_path as l; import sys; "
                 f"d = l(sys.argv[1]); print(any('\\u00a0' in n for n in d.label_names))")
        result = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, env=attack.env,
                                cwd=work)
        return "ok" if result.stdout.strip() == b"True" else "silent"

    def bad_setting(setting):
        def case():
            name = setting.replace("=", "-")
            result = attack.xmcbench(*attack.run_args(work / f"bad-{name}", setting))
            return verdict(result)
        return case

    def top_k(value):
        def case():
            return verdict(attack.xmcbench("predict", str(attack.finished), "--top-k", value, stdin=b"alpha\n"))
        return case

    def resume_replays_bad_setting():
        run = attack.copy("replay")
        (run / "metrics.json").unlink()
        config = json.loads((run / "config.json").read_text())
        config["config"]["batch_size"] = 0
        (run / "config.json").write_text(json.dumps(config))
        return verdict(attack.xmcbench("run", "--resume", str(run)))

    def resume_damaged_config():
        run = attack.copy("damaged-config")
        (run / "metrics.json").unlink()
        (run / "config.json").write_text('{"method": "lightxml", "data')
        return verdict(attack.xmcbench("run", "--resume", str(run)))

    def preset_case():
        folder = Path(shutil.copytree(attack.dataset, work / "Wiki-500K"))
        result = attack.xmcbench("config", "lightxml", "--dataset", str(folder))
        if result.returncode != 0:
            return verdict(result, "ok")
        return "ok" if json.loads(result.stdout).get("num_clusters") == 8192 else "silent"

    def registered_and_folder():
        here = work / "clash"
        (here / "debian-debtags-mini").mkdir(parents=True)
        write_tiny_dataset(here / "debian-debtags-mini")
        return verdict(attack.xmcbench("config", "lightxml", "--dataset", "debian-debtags-mini", cwd=here))

    def hostile_plugin(body: str, check):
        def case():
            site = Path(tempfile.mkdtemp(dir=work, prefix="site-"))
            (site / "hostile_plugin.py").write_text(body)
            info = site / "hostile_plugin-0.1.dist-info"
            info.mkdir()
            (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-plugin\nVersion: 0.1\n")
            (info / "entry_points.txt").write_text("[xmcbench]\nhostile = hostile_plugin\n")
            env = dict(attack.env, PYTHONPATH=os.pathsep.join(filter(None, [str(site), attack.env.get("PYTHONPATH")])))
            return check(env)
        return case

    def plugins_still_listed(env):
        result = attack.xmcbench("plugins", env=env)
        return "ok" if result.returncode == 0 and b"lightxml" in result.stdout else (
            "traceback" if b"Traceback" in result.stderr else "silent")

    def predict_output_is_json(env):
        result = attack.xmcbench("predict", str(attack.finished), stdin=b"alpha\n", env=env)
        try:
            [json.loads(line) for line in result.stdout.splitlines()]
        except ValueError:
            return "silent"
        return verdict(result, "ok")

    def output_is_a_file():
        path = work / "a-file"
        path.write_text("mine\n")
        result = attack.xmcbench(*attack.run_args(path))
        return "data-loss" if path.read_text() != "mine\n" else verdict(result)

    def config_not_utf8():
        path = work / "latin1.toml"
        path.write_bytes(b"epochs = 1\n# caf\xe9\n")
        return verdict(attack.xmcbench("config", "lightxml", "--config", str(path)))

    def trained_on_cuda():
        run = attack.copy("cuda-model")
        edit_model_json(run / "model", lambda meta: meta["config"].update(device="cuda:3"))
        return verdict(attack.xmcbench("predict", str(run), stdin=b"alpha\n"), "ok")

    def shareable():
        mode = stat.S_IMODE((attack.finished / "model" / "weights.safetensors").stat().st_mode)
        mask = os.umask(0)
        os.umask(mask)
        return "ok" if mode & 0o044 == 0o644 & ~mask & 0o044 else "silent"

    def resume_twice():
        run = attack.copy("resume-twice")
        (run / "metrics.json").unlink()
        config = json.loads((run / "config.json").read_text())
        config["config"]["epochs"] = 8
        (run / "config.json").write_text(json.dumps(config))
        first = subprocess.Popen([sys.executable, "-m", "xmcbench", "run", "--resume", str(run)], env=attack.env,
                                 cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in first.stderr:   # until the first one has taken the run and is training
            if line.startswith("resuming"):
                break
        second = attack.xmcbench("run", "--resume", str(run))
        first.kill()
        first.wait()
        return "data-loss" if second.returncode == 0 else verdict(second)

    yield "overwrite a project folder holding config.json", overwrite_project
    yield "overwrite with device=cuda on a CPU machine", overwrite_with("ow-cuda", "device=cuda")
    yield "overwrite with a misspelled dataset", overwrite_with("ow-dataset", dataset="debian-debtag")
    yield "overwrite with epochs=0", overwrite_with("ow-epochs", "epochs=0")
    yield "overwrite killed midway (kill -9)", overwrite_killed
    yield "two runs started at once into one --output", two_at_once
    yield "resume the same run twice at once", resume_twice
    yield "model.json model_name at another local folder", model_name_elsewhere(str(attack.model))
    yield "model.json model_name at a Hub name", model_name_elsewhere("bert-base-uncased")
    yield "model.json model_name at ../", model_name_elsewhere("../../tiny-bert")
    yield "model.json without its checksums", checksums_removed
    yield "model.json edited by hand", model_json_edited
    yield "model.json files entry outside the folder", files_outside
    yield "latest.json naming an absolute path", checkpoint_pointer(absolute)
    yield "latest.json naming ..", checkpoint_pointer(parent)
    yield "dataset with classic Mac line ends", mac_line_ends
    yield "predict stdin with form feed, U+2028, \\x85", stdin_form_feed
    yield "predict binary stdin", stdin_binary
    yield "labels with a no-break space", labels_unicode_space
    for setting in BAD_SETTINGS:
        yield f"--set {setting}", bad_setting(setting)
    yield "predict --top-k 0", top_k("0")
    yield "predict --top-k 100000", top_k("100000")
    yield "resume a run whose config.json holds batch_size=0", resume_replays_bad_setting
    yield "resume a run whose config.json is damaged", resume_damaged_config
    yield "a folder named Wiki-500K", preset_case
    yield "a registered name that is also a folder here", registered_and_folder
    yield "a plugin calling sys.exit(0) at import", hostile_plugin("import sys\nsys.exit(0)\n", plugins_still_listed)
    yield "a plugin raising KeyboardInterrupt at import", hostile_plugin("raise KeyboardInterrupt\n",
                                                                         plugins_still_listed)
    yield "a plugin printing at import, then predict", hostile_plugin("print('hello')\n", predict_output_is_json)
    yield "--output that is a file", output_is_a_file
    yield "a --config file that is not UTF-8", config_not_utf8
    yield "a model trained with device=cuda used on a CPU", trained_on_cuda
    yield "model files readable by another user (umask)", shareable

    # -- issue 27 ("Reliability, third pass"): its 18 cases, in its order ---------------------------------

    def worst(outcomes) -> str:
        """The worst of several tries of one case."""
        order = ("security", "data-loss", "traceback", "silent", "clear", "ok")
        return min(outcomes, key=order.index)

    def resumable(name: str, **settings) -> Path:
        """A copy of the finished run (its last checkpoint kept) made unfinished, with settings changed in its
        config.json, so that `run --resume` trains one more epoch."""
        run = attack.copy(name)
        (run / "metrics.json").unlink()
        config = json.loads((run / "config.json").read_text())
        config["config"].update(epochs=2, **settings)
        (run / "config.json").write_text(json.dumps(config))
        return run

    def without_mlflow_settings() -> dict:
        return {key: value for key, value in attack.env.items() if not key.startswith("MLFLOW_")}

    def resume_with_foreign_mlflow_store():
        elsewhere = work / "mlflow-store-elsewhere"
        run = resumable("mlflow-foreign", loggers=["mlflow"])
        (run / "mlflow_run.json").write_text(json.dumps({"tracking_uri": elsewhere.as_uri(),
                                                         "experiment": "xmcbench"}))
        result = attack.xmcbench("run", "--resume", str(run), env=without_mlflow_settings())
        return "security" if elsewhere.exists() else verdict(result, "ok")

    def resume_with_linked_tensorboard():
        elsewhere = work / "tensorboard-elsewhere"
        elsewhere.mkdir()
        run = resumable("tensorboard-link", loggers=["tensorboard"])
        (run / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
        result = attack.xmcbench("run", "--resume", str(run))
        return "security" if any(elsewhere.iterdir()) else verdict(result)

    hostile_method = '<img src=x onerror="alert(1)"> <iframe src="javascript:alert(2)"></iframe> | cell'
    hostile_dataset = "[click](javascript:alert(3))\n# a heading of its own | x"

    def report_with_hostile_names():
        run = attack.copy("hostile-names")
        config = json.loads((run / "config.json").read_text())
        config.update(method=hostile_method, dataset_name=hostile_dataset)
        config["config"]["model_name"] = "<script>alert(4)</script>"
        (run / "config.json").write_text(json.dumps(config))
        metrics = json.loads((run / "metrics.json").read_text())
        metrics["dataset"] = hostile_dataset
        (run / "metrics.json").write_text(json.dumps(metrics))
        result = attack.xmcbench("report", str(run), "--output", str(work / "hostile-report"))
        if result.returncode != 0:
            return verdict(result)
        rendered = render_markdown((work / "hostile-report" / "report.md").read_text())
        if rendered is None:
            raise RuntimeError("markdown-it-py is needed to render the report (pip install markdown-it-py)")
        cells, tags = rendered
        own_figures = {"loss_curves.png", "precision.png", "frequency_bins.png"}
        injected = bool({"iframe", "script"} & set(tags)) or not set(tags.get("img", [])) <= own_figures \
            or len(tags.get("h1", [])) > 1 or any(href.startswith("javascript:") for href in tags.get("a", [])) \
            or hostile_method not in cells
        return "security" if injected else "ok"

    def unlisted_file_in_model():
        run = attack.copy("unlisted-file")
        (run / "model" / "encoder" / "special_tokens_map.json").write_text(json.dumps({"cls_token": "[SEP]"}))
        result = attack.xmcbench("predict", str(run), stdin=b"alpha\n")
        return "security" if result.returncode == 0 else verdict(result)

    def ensemble_overwritten_on_a_full_disk():
        output = work / "ensemble-full-disk"
        built = attack.xmcbench("ensemble", str(attack.finished), str(attack.second), "--output", str(output))
        if built.returncode != 0:
            raise RuntimeError(f"cannot build the ensemble: {built.stderr.decode()[-500:]}")
        before = snapshot(output)
        # the same ensemble again: its largest file (written last) no longer fits
        result = attack.xmcbench("ensemble", str(attack.finished), str(attack.second), "--output", str(output),
                                 "--overwrite", file_size_limit=max(len(data) for data in before.values()) - 1)
        if snapshot(output) != before:
            return "data-loss"
        return verdict(result)

    def report_over_two_datasets():
        output = work / "report-two-datasets"
        result = attack.xmcbench("report", str(attack.finished), str(attack.other_dataset), "--output", str(output))
        if verdict(result, "ok") != "ok":
            return verdict(result, "ok")
        text = (output / "report.md").read_text()
        return "ok" if "### tiny-topics" in text and "### tiny-other" in text else "silent"

    def evaluate_inconsistent_csr():
        import scipy.sparse as sp

        matrix = sp.load_npz(attack.finished / "predictions.npz").tocsr()
        indptr = matrix.indptr.copy()
        indptr[1] = indptr[-1] + 7   # row 0 claims more entries than the matrix holds
        path = work / "inconsistent.npz"
        np.savez(path, data=matrix.data, indices=matrix.indices, indptr=indptr, format=np.array(b"csr"),
                 shape=np.array(matrix.shape))
        return verdict(attack.xmcbench("evaluate", "--predictions", str(path), "--dataset", str(attack.dataset)))

    def rescore_unreadable_predictions():
        run = attack.copy("rescore-unreadable")
        (run / "predictions.safetensors").write_bytes(b"\x00\x01 not safetensors \xff" * 20)
        before = snapshot(run)
        result = attack.xmcbench("rescore", str(run))
        return "data-loss" if snapshot(run) != before else verdict(result)

    def convert_pecos_with_nan():
        import scipy.sparse as sp

        folder = work / "pecos-nan"
        folder.mkdir()
        labels = sp.csr_matrix(np.eye(4, 3, dtype=np.float32))
        features = sp.csr_matrix(np.array([[1.0, 0.0], [np.nan, 2.0], [0.5, 0.5], [0.0, 1.0]], dtype=np.float32))
        for short in ("trn", "tst"):
            sp.save_npz(folder / f"Y.{short}.npz", labels)
            sp.save_npz(folder / f"X.{short}.npz", features)
        output = work / "pecos-nan-converted"
        result = attack.xmcbench("convert", str(folder), str(output), "--to", "xc_sparse")
        if result.returncode == 0:
            return "silent"
        return verdict(result) if not output.exists() or verdict(result) != "clear" else "silent"

    def run_on_a_full_disk():
        weights = (attack.finished / "model" / "weights.safetensors").stat().st_size
        result = attack.xmcbench(*attack.run_args(work / "full-disk-run"), file_size_limit=weights // 2)
        return verdict(result)

    def predictor_with_wrong_types():
        probe = textwrap.dedent("""
            import sys, xmcbench
            from xmcbench.errors import XmcError
            predictor = xmcbench.load(sys.argv[1])
            for arguments in ({"top_k": 2.5}, {"top_k": "3"}, {"top_k": True}, {"threshold": "0.5"}):
                try:
                    predictor.predict(["alpha"], **arguments)
                    print("silent")
                except XmcError as error:
                    print("clear" if "\\n" not in str(error) else "traceback")
                except Exception:
                    print("traceback")
            """)
        result = attack.python(probe, attack.finished)
        outcomes = result.stdout.split()
        return worst(outcomes) if len(outcomes) == 4 else "traceback"

    def corrupt_predictions(run: Path, name: str, change) -> None:
        from safetensors.numpy import load_file, save_file

        arrays = load_file(str(run / name))
        change(arrays["labels"], arrays["scores"])
        save_file(arrays, str(run / name))

    corruptions = {
        "label 999": lambda labels, scores: labels.__setitem__((0, 0), 999),
        "label -5": lambda labels, scores: labels.__setitem__((0, 0), -5),
        "a NaN score": lambda labels, scores: scores.__setitem__((0, 0), np.nan),
        "a repeated label": lambda labels, scores: labels.__setitem__((0, 1), labels[0, 0]),
    }

    def damaged_member_predictions():
        outcomes = []
        for what, change in corruptions.items():
            member = attack.copy(f"damaged-{what.replace(' ', '-')}", attack.second)
            corrupt_predictions(member, "predictions.safetensors", change)
            outcomes.append(verdict(attack.xmcbench("ensemble", str(attack.finished), str(member), "--output",
                                                    str(work / f"ensemble-{member.name}"))))
        run = attack.copy("rescore-repeated")
        corrupt_predictions(run, "predictions.safetensors", corruptions["a repeated label"])
        before = (run / "metrics.json").read_bytes()
        result = attack.xmcbench("rescore", str(run))
        outcomes.append("silent" if result.returncode == 0 and (run / "metrics.json").read_bytes() != before
                        else verdict(result))
        return worst(outcomes)

    def weighted_fusion_on_repeated_validation_labels():
        member = attack.copy("validated-repeated", attack.validated)
        corrupt_predictions(member, "validation_predictions.safetensors",
                            lambda labels, scores: labels.__setitem__((slice(None), slice(1, None)), labels[:, :1]))
        return verdict(attack.xmcbench("ensemble", str(attack.validated), str(member), "--fusion", "weighted",
                                       "--output", str(work / "weighted-repeated")))

    def predict_threshold_nan():
        result = attack.xmcbench("predict", str(attack.finished), "--threshold", "nan", stdin=b"alpha\nbeta\n")
        return verdict(result)

    def cascade_cluster_size_set():
        from xmcbench.indexing import num_clusters_for

        result = attack.xmcbench("config", "cascade", "--dataset", str(attack.dataset), "--set",
                                 f"model_name={attack.model}", "--set", "cluster_size=2")
        if result.returncode != 0:
            return verdict(result, "ok")
        config = json.loads(result.stdout)
        labels = len(set((attack.dataset / "train_labels.txt").read_text().split()))
        leaves = config["num_clusters"] or num_clusters_for(labels, config["cluster_size"])
        return "ok" if leaves == num_clusters_for(labels, 2) else "silent"

    def mlflow_server_that_does_not_answer():
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(64)   # connections are accepted by the system, and never answered
        env = dict(without_mlflow_settings(), MLFLOW_TRACKING_URI=f"http://127.0.0.1:{server.getsockname()[1]}")
        output = work / "mlflow-no-answer"
        try:
            result = attack.xmcbench(*attack.run_args(output, "loggers=mlflow"), env=env, timeout=MLFLOW_WAIT)
        except subprocess.TimeoutExpired:
            return "silent"   # still waiting: training is held up without a word
        finally:
            server.close()
        if result.returncode == 0:
            said = b"mlflow" in result.stderr
            return "ok" if said and (output / "metrics.json").is_file() else "silent"
        return verdict(result)

    def latin1_csv_counted():
        folder = work / "csv-latin1"
        folder.mkdir()
        (folder / "train.csv").write_bytes(b"text,labels\ncaf\xe9 au lait,a|b\nplain text,b\ncr\xe8me,c\n")
        (folder / "test.csv").write_bytes(b"text,labels\nna\xefve,a\nplain,b\n")
        probe = textwrap.dedent("""
            import json, sys
            from xmcbench.formats import open_dataset
            from xmcbench.registry import build_registry
            print(json.dumps(open_dataset(build_registry(), sys.argv[1]).report))
            """)
        result = attack.python(probe, folder)
        if result.returncode != 0:
            return "traceback" if "Traceback" in result.stderr else "clear"
        return "ok" if json.loads(result.stdout).get("non_utf8_lines") == 3 else "silent"

    def jsonl_label_cells_that_name_no_label():
        folder = work / "jsonl-objects"
        folder.mkdir()
        rows = [{"text": "alpha beta", "labels": {"a": 1, "b": 2}}, {"text": "gamma", "labels": [["a", "b"], "c"]},
                {"text": "delta", "labels": ["c"]}]
        for name in ("train.jsonl", "test.jsonl"):
            (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return verdict(attack.xmcbench("config", "lightxml", "--dataset", str(folder), "--set",
                                       f"model_name={attack.model}"))

    def evaluate_with_foreign_label_names():
        import scipy.sparse as sp

        columns = sp.load_npz(attack.finished / "predictions.npz").shape[1]
        names = work / "foreign-labels.json"
        names.write_text(json.dumps([f"not-a-label-{i}" for i in range(columns)]))
        return verdict(attack.xmcbench("evaluate", "--predictions", str(attack.finished / "predictions.npz"),
                                       "--dataset", str(attack.dataset), "--labels", str(names)))

    yield "issue 27: 1 resume: mlflow_run.json names a store elsewhere", resume_with_foreign_mlflow_store
    yield "issue 27: 1 resume: tensorboard/ links elsewhere", resume_with_linked_tensorboard
    yield "issue 27: 2 report of hostile method, dataset, model_name", report_with_hostile_names
    yield "issue 27: 3 a file model.json does not list in model/", unlisted_file_in_model
    yield "issue 27: 4 ensemble --overwrite on a full disk", ensemble_overwritten_on_a_full_disk
    yield "issue 27: 5 report over runs of two datasets", report_over_two_datasets
    yield "issue 27: 6 evaluate --predictions, inconsistent indptr", evaluate_inconsistent_csr
    yield "issue 27: 7 rescore, unreadable predictions.safetensors", rescore_unreadable_predictions
    yield "issue 27: 8 convert a PECOS folder with NaN features", convert_pecos_with_nan
    yield "issue 27: 9 a run on a full disk", run_on_a_full_disk
    yield "issue 27: 10 Predictor.predict(top_k=2.5|'3'|True, threshold='0.5')", predictor_with_wrong_types
    yield "issue 27: 11 saved predictions 999/-5/NaN/repeated (ensemble, rescore)", damaged_member_predictions
    yield "issue 27: 12 weighted fusion, validation labels repeated", weighted_fusion_on_repeated_validation_labels
    yield "issue 27: 13 predict --threshold nan", predict_threshold_nan
    yield "issue 27: 14 config cascade --set cluster_size=2", cascade_cluster_size_set
    yield "issue 27: 15 MLFLOW_TRACKING_URI at a port that never answers", mlflow_server_that_does_not_answer
    yield "issue 27: 16 Latin-1 bytes in a CSV are counted", latin1_csv_counted
    yield "issue 27: 17 JSONL label cells holding an object or a list", jsonl_label_cells_that_name_no_label
    yield "issue 27: 18 evaluate --labels naming none of the labels", evaluate_with_foreign_label_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, help="a checkout whose xmcbench/ and plugins/ to attack")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--only", help="run only the cases whose name holds this text, e.g. 'issue 27'")
    args = parser.parse_args()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="xmcbench-attack-"))
    try:
        attack = Attack(args.code.resolve() if args.code else None, work)
        counts = collections.Counter()
        for name, case in cases(attack):
            if args.only and args.only not in name:
                continue
            try:
                outcome = case()
            except Exception as error:   # the harness itself, not xmcbench: shown, not counted as a class
                outcome = f"harness error {type(error).__name__}: {error}"
            counts[outcome if not outcome.startswith("harness") else "harness error"] += 1
            print(f"{outcome:10s}  {name}", flush=True)
        print(f"{sum(counts.values())} cases: " + ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
              + f" ({time.perf_counter() - started:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
