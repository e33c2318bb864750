"""Grid executors (`xmcbench compare --executor`): the built-in local, ray and slurm executors and a third
party's, registered through the hook, pass the conformance check; a grid on Ray gives the metrics and weights
of the serial loop, reports a failed cell while the others go on and retrains only that cell when run again;
Ctrl-C cancels the grid's cells and leaves the finished ones as they were; two grids writing into one folder
at once train each cell once; options an executor cannot use are refused in one line before anything runs.

The Ray tests share one local Ray instance (2 CPUs, started once, its processes checked gone afterwards); the
slurm executor is tested with submitit's local jobs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xmcbench.cli import app
from xmcbench.compare import run_cells
from xmcbench.errors import XmcError
from xmcbench.executors import CELL_LOG, GRID_LOG, INTERRUPTED, RESUMED, Executor, ExecutorOptions, LocalExecutor, \
    cell_is_running, cell_task, run_cell
from xmcbench.registry import build_registry
from xmcbench.testing import check_executor
from xmcbench.training import TrainingInterrupted
from xmcbench import formats
from xmcbench.formats import open_dataset
from xmcbench.rundir import is_finished
from xmcbench.runs.plan import plan_run

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
TINY = ["pretrained_weights=false", "num_layers=2", "hidden_size=8", "epochs=1", "max_length=32", "cluster_size=2",
        "top_clusters=2"]
cli = CliRunner()


def settings(model_dir: Path, *extra: str) -> list[str]:
    return [f"model_name={model_dir}", *TINY, *extra]


def compare_args(model_dir: Path, dataset: Path, output: Path, methods=("lightxml",), seeds=(0, 1), *extra: str):
    args = ["compare", *methods, "--dataset", str(dataset), "--output", str(output)]
    for seed in seeds:
        args += ["--seeds", str(seed)]
    for setting in settings(model_dir):
        args += ["--set", setting]
    return args + list(extra)


def finished_runs(output: Path) -> dict[str, Path]:
    return {path.name: path for path in sorted((output / "runs").iterdir()) if is_finished(path)}


def same_results(first: Path, second: Path) -> bool:
    return all((first / name).read_bytes() == (second / name).read_bytes()
               for name in ("metrics.json", "model/weights.safetensors"))


def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in folder.rglob("*") if path.is_file()}


# -- registration and options ------------------------------------------------------------------------------

def test_the_builtin_executors_are_registered_and_listed():
    registry = build_registry()
    assert not registry.failures_of("xmcbench-executors"), registry.failures_of("xmcbench-executors")
    assert {name: spec.extra for name, spec in ((n, registry.executor(n)) for n in registry.executors)} == \
        {"local": None, "ray": "ray", "slurm": "slurm"}
    listed = cli.invoke(app, ["plugins"])
    assert listed.exit_code == 0, listed.output
    assert re.search(r"^ray +xmcbench-executors +xmcbench\[ray\] +each cell a Ray task", listed.output, re.M)
    assert re.search(r"^slurm +xmcbench-executors +xmcbench\[slurm\]", listed.output, re.M)


@pytest.mark.parametrize("extra, message", [
    (["--executor", "rya"], "unknown executor 'rya' for --executor: did you mean 'ray'?"),
    (["--address", "auto"], "--address does not apply to --executor local; drop it (it takes --cell-cpus)"),
    (["--executor", "ray", "--partition", "gpu"], "--partition does not apply to --executor ray"),
    (["--executor", "ray", "--executor-option", "x=1"], "--executor-option x=... is not an option of --executor ray"),
    (["--executor", "ray", "--executor-option", "x"], "--executor-option expects key=value, got 'x'"),
    (["--cell-cpus", "0"], "--cell-cpus 0: give a whole number of CPUs per cell, at least 1"),
    (["--executor", "ray", "--cell-gpus", "-1"], "--cell-gpus -1.0: give GPUs per cell, 0 or more"),
    (["--cell-cpus", "2", "--set", "threads=1"], "--cell-cpus 2 sets threads=2, but --set threads=1 asks for another"),
    (["--executor", "slurm"], "--executor slurm needs --time-limit MINUTES"),
    (["--executor", "slurm", "--time-limit", "5", "--cell-gpus", "0.5"], "a Slurm job gets whole GPUs"),
    (["--executor", "slurm", "--time-limit", "5", "--executor-option", "cluster=k8s"], "cluster=k8s: choose slurm"),
    (["--executor", "slurm", "--time-limit", "5"], "submits jobs with sbatch, which is not on this machine's PATH"),
])
def test_what_an_executor_cannot_do_is_refused_in_one_line_before_anything_runs(extra, message, tiny_model_dir,
                                                                                tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))   # no sbatch, whatever this machine has
    result = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, tmp_path / "out", ("lightxml",), (0,), *extra))
    assert isinstance(result.exception, XmcError), result.output
    assert message in str(result.exception) and "\n" not in str(result.exception)
    assert not (tmp_path / "out").exists()


# -- conformance --------------------------------------------------------------------------------------------

def contributing_example() -> types.ModuleType:
    """The executor plugin of CONTRIBUTING.md's section on xmcbench_register_executors, as a module."""
    text = CONTRIBUTING.read_text(encoding="utf-8")
    code = re.search(r"```python\n# xmcbench_pool/plugin.py\n(.*?)```", text, re.S).group(1)
    module = types.ModuleType("xmcbench_pool_plugin")
    exec(compile(code, "CONTRIBUTING.md (xmcbench_pool/plugin.py)", "exec"), module.__dict__)
    return module


@pytest.mark.slow
def test_a_third_party_executor_registers_through_the_hook_and_conforms():
    registry = build_registry(extra_plugins=[("pool", contributing_example())])
    assert not registry.failures_of("pool"), registry.failures_of("pool")
    spec = registry.executor("pool")
    assert spec.description == "the cells in a pool of two processes" and spec.extra is None
    check_executor(spec.factory)


@pytest.mark.slow
def test_the_local_executor_conforms():
    check_executor(LocalExecutor)


class AnsweringTwice(LocalExecutor):
    def wait(self, timeout):
        return 2 * super().wait(timeout)


@pytest.mark.slow
def test_the_check_catches_an_executor_that_breaks_the_rules():
    with pytest.raises(AssertionError, match=r"^executor .*AnsweringTwice: each submitted cell must end in exactly "
                                             r"one result: 'lightxml-seed0' came twice"):
        check_executor(AnsweringTwice)


@pytest.mark.slow
def test_the_slurm_executor_conforms_with_submitits_local_jobs():
    pytest.importorskip("submitit")
    from xmcbench_executors import slurm_grid

    check_executor(slurm_grid.build, ExecutorOptions(time_limit=10, options={"cluster": "local"}))


@pytest.mark.slow
def test_a_cell_on_a_worker_stops_at_sigint_before_it_trains(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    """Engines may start workers with SIGINT ignored, and cancel a running cell with SIGINT (ray.cancel, scancel
    --signal=INT): a cell interrupted while it reads its data stops there instead of training to the end."""
    registry = build_registry()
    dataset = open_dataset(registry, str(tiny_dataset))
    plan = plan_run(registry, "lightxml", str(tiny_dataset), None, settings(tiny_model_dir, "threads=1"), 0,
                           loaded=dataset)
    task = cell_task("cell", "lightxml", 0, plan, tmp_path / "runs" / "cell", dataset.version, tmp_path / "grid")
    opened = open_dataset

    def cancelled_while_reading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        return opened(*args, **kwargs)

    monkeypatch.setattr(formats, "open_dataset", cancelled_while_reading)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)   # as a worker may start
    try:
        result = run_cell(task)   # no driver context: as on a worker
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.status == INTERRUPTED and not (task.run_dir / "config.json").exists(), result
    assert not cell_is_running(task.lock)


# -- Ray --------------------------------------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for this module's tests (its start takes seconds); its processes must be gone
    once it is shut down."""
    ray = pytest.importorskip("ray")
    before = set(descendants(os.getpid()))   # not Ray's (multiprocessing's resource tracker, say)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        started = [pid for pid in descendants(os.getpid()) if pid not in before]
        ray.shutdown()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in started if alive(pid)]
        assert not left, f"Ray processes outlived ray.shutdown(): {left}"


@pytest.mark.slow
def test_the_ray_executor_conforms(ray_address):
    from xmcbench_executors import ray_grid

    check_executor(ray_grid.build, ExecutorOptions(cell_cpus=1))


@pytest.mark.slow
def test_a_grid_on_ray_matches_the_serial_loop_and_retrains_only_its_failed_cell(ray_address, tiny_model_dir,
                                                                                  tiny_dataset, tmp_path):
    output, serial = tmp_path / "ray", tmp_path / "local"
    seeds = (0, 1, 2)
    # the serial loop first: its run folder names (method, seed, result key) are the grid's
    done = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, serial, ("lightxml",), seeds, "--cell-cpus", "1"))
    assert done.exit_code == 0, done.output
    expected = finished_runs(serial)
    blocked = output / "runs" / next(name for name in expected if name.startswith("lightxml-seed1-"))
    blocked.mkdir(parents=True)
    (blocked / "notes.txt").write_text("not a run\n")

    failed = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, ("lightxml",), seeds,
                                          "--executor", "ray", "--cell-cpus", "1"))
    error = str(failed.exception)
    assert isinstance(failed.exception, XmcError) and "\n" not in error, failed.output
    assert error.startswith(f"1 of 3 cells failed (lightxml seed 1: {blocked} is not empty and holds no xmcbench run")
    assert "run the same command again to train only the missing and failed cells" in error
    assert sorted(finished_runs(output)) == sorted(name for name in expected if name != blocked.name)
    grid_log = (output / "grid" / GRID_LOG).read_text()
    assert "lightxml seed 1: FAILED:" in grid_log and "grid: 2 done, 0 running, 1 failed, 0 queued of 3 cells" in grid_log
    assert "training into" in (output / "runs" / next(iter(finished_runs(output))) / CELL_LOG).read_text()

    (blocked / "notes.txt").unlink()
    again = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, ("lightxml",), seeds,
                                         "--executor", "ray", "--cell-cpus", "1"))
    assert again.exit_code == 0, again.output
    assert again.output.count("reusing") == 2 and again.output.count("trained in") == 1
    assert "lightxml seed 1: trained in" in again.output
    assert sorted(finished_runs(output)) == sorted(expected)
    for name, path in expected.items():
        assert same_results(output / "runs" / name, path), f"{name} differs between --executor ray and local"


class CtrlCWhenTraining(Executor):
    """Ctrl-C in the driver once the cells under `runs` matching `pattern` have each written a checkpoint."""

    def __init__(self, inner: Executor, runs: Path, patterns: list[str]) -> None:
        self.inner, self.runs, self.patterns = inner, runs, patterns
        self.results = []
        self.pressed = False

    def start(self, context):
        self.inner.start(context)

    def submit(self, task):
        self.inner.submit(task)

    def wait(self, timeout):
        if not self.pressed and all(any(self.runs.glob(f"{pattern}/checkpoints/*")) for pattern in self.patterns):
            self.pressed = True
            raise KeyboardInterrupt
        found = self.inner.wait(timeout)
        self.results += found
        return found

    def cancel(self):
        self.inner.cancel()

    def close(self):
        self.inner.close()


@pytest.mark.slow
def test_ctrl_c_cancels_the_grid_on_ray_and_leaves_finished_cells_intact(ray_address, tiny_model_dir, tiny_dataset,
                                                                         tmp_path):
    from xmcbench_executors import ray_grid

    registry, output = build_registry(), tmp_path / "grid"
    options = settings(tiny_model_dir, "threads=1", "epochs=20")

    def grid(seeds, executor=None):
        return run_cells(registry, ["lightxml"], str(tiny_dataset), seeds, options, None, output / "runs",
                         log=lambda line: None, executor=executor)

    first = grid([0])["lightxml"][0]
    before = files_of(first)
    interrupting = CtrlCWhenTraining(ray_grid.build(ExecutorOptions(cell_cpus=1)), output / "runs",
                                     ["lightxml-seed1-*", "lightxml-seed2-*"])
    with pytest.raises(TrainingInterrupted, match=r"^grid interrupted: 0 of 3 cells finished and are kept; run the "
                                                  r"same command again"):
        grid([0, 1, 2, 3], interrupting)
    assert files_of(first) == before, "a finished cell was touched"
    assert not any(cell_is_running(lock) for lock in (output / "grid" / "cells").iterdir()), "a cell still runs"
    interrupted = sorted(output.glob("runs/lightxml-seed[12]-*"))
    assert len(interrupted) == 2
    for run_dir in interrupted:   # stopped by SIGINT after a step: a checkpoint to resume from
        assert (run_dir / "config.json").exists() and not is_finished(run_dir)
        assert any((run_dir / "checkpoints").iterdir())
    assert not list(output.glob("runs/lightxml-seed3-*")), "a queued cell started after the grid was cancelled"
    assert "grid: interrupted; cancelling its cells" in (output / "grid" / GRID_LOG).read_text()

    resumed = ray_grid.build(ExecutorOptions(cell_cpus=1))
    watched = CtrlCWhenTraining(resumed, output / "runs", ["never"])
    cells = grid([0, 1, 2, 3], watched)["lightxml"]
    assert all(is_finished(path) for path in cells)
    assert sorted(result.status for result in watched.results) == [RESUMED, RESUMED, "trained"]
    for run_dir in interrupted:
        assert re.search(r"resuming .* at step [1-9]", (run_dir / CELL_LOG).read_text())


@pytest.mark.slow
def test_two_grids_into_one_folder_at_once_train_each_cell_once(ray_address, tiny_model_dir, tiny_dataset, tmp_path):
    """A serial grid in another process and a grid on Ray from this one, into one folder: each cell is trained
    by one of them, the other waits for it or finds it finished, and both end with every cell finished."""
    output = tmp_path / "shared"
    args = compare_args(tiny_model_dir, tiny_dataset, output, ("lightxml", "lightxml-random-neg"), (0, 1),
                        "--cell-cpus", "1")
    serial = subprocess.Popen([sys.executable, "-m", "xmcbench", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(output.glob("grid/cells/*.lock")) and serial.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)   # until the serial grid works on its first cell
        on_ray = cli.invoke(app, [*args, "--executor", "ray"])
        serial_log = serial.communicate(timeout=600)[0]
    finally:
        serial.kill()
    assert on_ray.exit_code == 0 and serial.returncode == 0, on_ray.output + "\n----\n" + serial_log
    runs = sorted((output / "runs").iterdir())
    assert len(runs) == 4 and all(is_finished(path) for path in runs)
    for log in (on_ray.output, serial_log):   # each grid trained a cell, or found it finished before or meanwhile
        ended = [re.findall(pattern, log) for pattern in (r"seed \d: trained in", r"seed \d: reusing",
                                                          r"seed \d: reused \(another grid finished it meanwhile")]
        assert sum(map(len, ended)) == 4, log
    trained = on_ray.output.count("trained in") + serial_log.count("trained in")
    assert trained == 4, f"{trained} trainings of 4 cells:\n{on_ray.output}\n----\n{serial_log}"
    assert not [path for path in output.rglob("*") if "xmcbench-replace" in path.name]
