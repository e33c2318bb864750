"""Attack xmcbench as a careless or hostile user would, and count what happens.

    python benchmarks/attack.py                      # the installed xmcbench
    python benchmarks/attack.py --code OLD_CHECKOUT  # another checkout (its xmcbench/ and plugins/ first on the path)

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
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
        if code is not None:
            self.env["PYTHONPATH"] = os.pathsep.join([str(code), str(code / "plugins")])
        self.model = make_tiny_transformer(work / "tiny-bert")
        self.dataset = write_tiny_dataset(work / "tiny-topics")
        self.finished = self.train(work / "finished", "keep_checkpoint=true")

    def xmcbench(self, *args: str, stdin: bytes = b"", env: dict | None = None, cwd: Path | None = None):
        # run from the work folder: `python -m` puts the current folder first on the path, which would pick
        # a checkout's xmcbench/ over --code's
        return subprocess.run([sys.executable, "-m", "xmcbench", *args], input=stdin, capture_output=True,
                              env=env or self.env, cwd=cwd or self.work)

    def run_args(self, output: Path, *settings: str, dataset: str | None = None) -> list[str]:
        args = ["run", "lightxml", "--dataset", dataset or str(self.dataset), "--output", str(output),
                "--set", f"model_name={self.model}"]
        for setting in (*TINY, *settings):
            args += ["--set", setting]
        return args

    def train(self, output: Path, *settings: str) -> Path:
        done = self.xmcbench(*self.run_args(output, *settings))
        if done.returncode != 0:
            raise SystemExit(f"cannot train the tiny run: {done.stderr.decode()[-2000:]}")
        return output

    def copy(self, name: str) -> Path:
        return Path(shutil.copytree(self.finished, self.work / name, symlinks=True))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, help="a checkout whose xmcbench/ and plugins/ to attack")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="xmcbench-attack-"))
    try:
        attack = Attack(args.code.resolve() if args.code else None, work)
        counts = collections.Counter()
        for name, case in cases(attack):
            try:
                outcome = case()
            except Exception as error:   # the harness itself, not xmcbench: shown, not counted as a class
                outcome = f"harness error {type(error).__name__}: {error}"
            counts[outcome if not outcome.startswith("harness") else "harness error"] += 1
            print(f"{outcome:10s}  {name}", flush=True)
        print(f"{sum(counts.values())} cases: " + ", ".join(f"{n} {kind}" for kind, n in counts.most_common()))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
