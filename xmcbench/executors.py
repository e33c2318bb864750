"""Grids beyond one process: the contract of a grid executor, the work of one cell wherever it runs, and the
loop that runs a grid's cells through an executor and shows its progress.

A grid is the cells (method × seed) of `xmcbench compare`. The driver (the process running `compare`) plans
every cell, names its run folder by its result key and hands each cell without a finished run to an executor
as a CellTask: the cell's resolved plan, its run folder, and where its data is, by path, never the data
itself. Wherever the executor runs the cell (this process, a Ray worker, a Slurm job), the cell's work is
`run_cell(task)`: it reads the dataset once, trains (or resumes an interrupted run, or finds that another grid
finished it) and returns a CellResult; a cell's own failure is a result, never an exception.

Two grids may write into one folder at once: a cell holds a lock (flock on GRID/cells/NAME.lock) while it
works, so each cell is trained once; the other grid waits for it and reuses it. The run folder's own claim
(xmcbench.rundir) still refuses any other process. The driver reads the same locks to count running cells.

Executors are plugins (`xmcbench_register_executors`); `local`, the default, is LocalExecutor below: the
cells one after another in the driver's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import io
import os
import signal
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from xmcbench.config import parse_set_options
from xmcbench.data import IN_MEMORY, Dataset, data_dir_from_env
from xmcbench.errors import XmcError, error_line, first_line, joined_line
from xmcbench.progress import duration, log_interval
from xmcbench.registry import Registry, build_registry

if TYPE_CHECKING:   # the run layer (torch, transformers) is imported where a grid runs, not when plugins load
    from xmcbench.runs.plan import Plan

# What became of a cell (CellResult.status).
TRAINED, RESUMED, REUSED, FAILED, INTERRUPTED = "trained", "resumed", "reused", "failed", "interrupted"
FINISHED = (TRAINED, RESUMED, REUSED)
CELL_LOG = "cell.log"   # a cell's own log, in its run folder
GRID_LOG = "grid.log"   # the grid's progress, in the grid folder (every grid using the folder appends to it)
POLL_SECONDS = 1.0   # how often the driver looks at the cells while none ends
LOCK_TRIES = 5   # a worker tries its cell's lock this often (50 ms apart) before it says it waits for another grid
FLAGS = {"cell_cpus": "--cell-cpus", "cell_gpus": "--cell-gpus", "address": "--address",
         "partition": "--partition", "time_limit": "--time-limit"}


@dataclass
class CellTask:
    """One cell as a worker receives it: plain settings and paths (data travels by path, never pickled).

    plan: the cell's settings as the driver resolved them (plan.loaded is None); dataset_version: the version
    the driver read, which the worker's copy must match; run_dir: the run folder (absolute); lock: the cell's
    lock file in the grid folder; data_dir: where registered datasets are (absolute, or None)."""

    name: str
    method: str
    seed: int
    run_dir: Path
    plan: Plan
    dataset_version: str
    lock: Path
    data_dir: Path | None = None

    def describe(self) -> str:
        return f"{self.method} seed {self.seed}"


def cell_task(name: str, method: str, seed: int, plan: Plan, run_dir: Path, dataset_version: str,
              grid_folder: Path, data_dir: Path | None = None) -> CellTask:
    """A CellTask whose paths hold wherever the cell runs: absolute, with a dataset path (not a registered name)
    resolved, and the plan without its loaded dataset."""
    dataset = plan.dataset
    if not dataset.startswith(IN_MEMORY) and Path(dataset).expanduser().exists():
        dataset = str(Path(dataset).expanduser().resolve())
    data_dir = data_dir_from_env(data_dir)
    return CellTask(name, method, seed, Path(run_dir).resolve(), dataclasses.replace(plan, loaded=None,
                                                                                     dataset=dataset),
                    dataset_version, (Path(grid_folder) / "cells" / f"{name}.lock").resolve(),
                    data_dir.resolve() if data_dir is not None else None)


@dataclass
class CellResult:
    """What became of a cell: status (TRAINED, RESUMED, REUSED, FAILED, INTERRUPTED), error (one line, for
    FAILED and INTERRUPTED), seconds (the cell's time where it ran), log (what the cell logged before its run
    folder could hold it: the lines of a cell that failed before its run started)."""

    name: str
    status: str
    error: str | None = None
    seconds: float = 0.0
    log: str = ""


@dataclass
class ExecutorOptions:
    """What `xmcbench compare` passes an executor's factory. cell_cpus: CPUs per cell (the cells' torch
    threads are set to it too); cell_gpus: GPUs per cell, a fraction packs cells onto one GPU (Ray); address:
    the engine to connect to (a Ray cluster); partition, time_limit (minutes): a batch scheduler's; options:
    `--executor-option key=value` pairs, the executor's own. None: not given."""

    cell_cpus: int | None = None
    cell_gpus: float | None = None
    address: str | None = None
    partition: str | None = None
    time_limit: int | None = None
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cell_cpus is not None and self.cell_cpus < 1:
            raise XmcError(f"--cell-cpus {self.cell_cpus}: give a whole number of CPUs per cell, at least 1")
        if self.cell_gpus is not None and not self.cell_gpus >= 0:
            raise XmcError(f"--cell-gpus {self.cell_gpus}: give GPUs per cell, 0 or more (0.25: four cells per GPU)")
        if self.time_limit is not None and self.time_limit < 1:
            raise XmcError(f"--time-limit {self.time_limit}: give each cell's time limit in minutes, at least 1")

    def check_used(self, executor: str, used: tuple[str, ...] = (), options: tuple[str, ...] | None = ()) -> None:
        """Refuse, in one line, what the executor named `executor` would ignore: a flag whose field is not in
        `used`, an `--executor-option` key not in `options` (None: the executor takes any key)."""
        ignored = [flag for name, flag in FLAGS.items() if getattr(self, name) is not None and name not in used]
        if ignored:
            raise XmcError(f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} not apply to --executor "
                           f"{executor}; drop {'it' if len(ignored) == 1 else 'them'}"
                           + (f" (it takes {', '.join(FLAGS[name] for name in used)})" if used else ""))
        unknown = sorted(set(self.options) - set(options)) if options is not None else []
        if unknown:
            raise XmcError(f"--executor-option {unknown[0]}=... is not an option of --executor {executor}; "
                           + (f"it takes {', '.join(options)}" if options else "it takes none"))


def parse_executor_options(pairs: list[str]) -> dict[str, str]:
    """`["account=abc", "qos=high"]` -> {"account": "abc", "qos": "high"} (read as --set is)."""
    for pair in pairs:
        try:
            parse_set_options([pair])
        except XmcError:
            raise XmcError(f"--executor-option expects key=value, got {pair!r} (e.g. --executor-option "
                           "account=abc)") from None
    return parse_set_options(list(pairs))


def with_cell_threads(set_options: list[str], cell_cpus: int | None) -> list[str]:
    """The --set options of every cell: `threads=cell_cpus` first, so that a cell's torch uses the CPUs it
    declares (the thread count is a setting of the run, part of its result key)."""
    if cell_cpus is None:
        return list(set_options)
    given = parse_set_options(list(set_options)).get("threads")
    if given is not None and given != str(cell_cpus):
        raise XmcError(f"--cell-cpus {cell_cpus} sets threads={cell_cpus}, but --set threads={given} asks for "
                       "another thread count; drop one of them")
    return [f"threads={cell_cpus}", *set_options]


@dataclass
class GridContext:
    """The driver's side of a grid, given to Executor.start: its registry and dataset (read once in this
    process: an executor running cells here passes them to run_cell), its log, and the grid folder
    (OUTPUT/grid: the cells' locks, grid.log, an engine's own files), which workers must reach too."""

    registry: Registry
    dataset: Dataset
    log: Callable[[str], None]
    folder: Path


class Executor(ABC):
    """Runs the cells of a grid. The driver calls start(context) once, submit(task) for each cell, then
    wait(timeout) until every submitted cell has its result; cancel() on Ctrl-C; close() at the end, always."""

    context: GridContext | None = None

    def start(self, context: GridContext) -> None:
        """Before the first submit; start or connect to the engine here, not in the factory."""
        self.context = context

    @abstractmethod
    def submit(self, task: CellTask) -> None:
        """Queue or start the cell; its work, wherever it runs, is `run_cell(task)` (in the driver's process:
        `run_cell(task, self.context)`)."""

    @abstractmethod
    def wait(self, timeout: float) -> list[CellResult]:
        """The results of cells that ended since the last call, each cell's exactly once; waits up to
        `timeout` seconds for one (an executor that runs cells in this process may take the time of a cell).
        A cell the engine lost (a worker that died) ends as FAILED, a cancelled one as INTERRUPTED."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop every cell without a result: a queued one never starts, a running one gets Ctrl-C (SIGINT:
        training checkpoints and stops). Return once none runs any more; wait then returns their results."""

    def close(self) -> None:
        """Release the engine (shut down what start started); called once, after the grid or its cancel."""


def run_grid(executor: Executor, tasks: list[CellTask], context: GridContext) -> dict[str, CellResult]:
    """Run `tasks` through `executor`; return their results by cell name.

    A failed cell is reported and the others go on; afterwards one XmcError line names the failed cells (a
    rerun trains only what is missing or failed). Ctrl-C, or a cell that was interrupted, cancels the rest
    (running cells checkpoint) and raises TrainingInterrupted; finished cells stay as they are."""
    from xmcbench.training import TrainingInterrupted

    progress = GridProgress(tasks, context)
    results: dict[str, CellResult] = {}
    interrupted = False

    def record(found: list[CellResult]) -> bool:
        for result in found:
            if result.name in results or result.name not in progress.tasks:
                raise RuntimeError(f"{type(executor).__qualname__}.wait returned {result.name!r}, which is not a "
                                   "cell waiting for its result (each cell ends exactly once)")
            results[result.name] = result
            progress.ended(result)
        return any(result.status == INTERRUPTED for result in found)

    try:
        try:
            executor.start(context)
            for task in tasks:
                executor.submit(task)
            progress.show(results)
            while len(results) < len(tasks):
                if record(executor.wait(POLL_SECONDS)):
                    raise TrainingInterrupted("a cell was interrupted")
                progress.show(results)
        except (KeyboardInterrupt, TrainingInterrupted):
            interrupted = True
            progress.line("grid: interrupted; cancelling its cells (running ones write a checkpoint)")
            executor.cancel()
            record([result for result in executor.wait(0.0) if result.name not in results])
    finally:
        executor.close()
    finished = sum(result.status in FINISHED for result in results.values())
    progress.show(results)
    if interrupted:
        raise TrainingInterrupted(f"grid interrupted: {finished} of {len(tasks)} cells finished and are kept; run "
                                  "the same command again to train the rest (interrupted cells resume from their "
                                  "last checkpoint)")
    failed = [result for result in results.values() if result.status == FAILED]
    if failed:
        shown = "; ".join(f"{progress.tasks[r.name].describe()}: {shorten(r.error or '', 160)}" for r in failed[:3])
        raise XmcError(f"{len(failed)} of {len(tasks)} cells failed ({shown}{'; ...' if len(failed) > 3 else ''}); "
                       f"their logs: {CELL_LOG} in their run folders and {context.folder / GRID_LOG}; run the same "
                       "command again to train only the missing and failed cells")
    return results


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


class GridProgress:
    """A grid's progress: cells done, running, failed and queued, elapsed time and an ETA, as lines to the
    driver's log (the terminal) and to GRID/grid.log (each line with the time and the driver's process id, as
    two grids may share the folder). A line when the counts change, else every XMCBENCH_PROGRESS_SECONDS."""

    def __init__(self, tasks: list[CellTask], context: GridContext) -> None:
        self.tasks = {task.name: task for task in tasks}
        self.log = context.log
        self.path = context.folder / GRID_LOG
        self.started = time.monotonic()
        self.interval = log_interval()
        self.shown: tuple | None = None
        self.shown_at = 0.0
        self.running_since: dict[str, float] = {}
        self.concurrency = 1
        self.durations: list[float] = []

    def line(self, text: str, to_terminal: bool = True) -> None:
        if to_terminal:
            self.log(text)
        stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as file:
            file.write("".join(f"{stamp} [{os.getpid()}] {part}\n" for part in text.splitlines() or [""]))

    def ended(self, result: CellResult) -> None:
        task = self.tasks[result.name]
        since = self.running_since.pop(result.name, None)
        if result.status in (TRAINED, RESUMED):
            self.durations.append(result.seconds if result.seconds > 0 else time.monotonic() - (since or self.started))
        if result.log and result.status != REUSED:   # lines the cell's run folder could not take (it failed first)
            self.line(f"{task.describe()}: its log before it failed:\n{result.log.rstrip()}", to_terminal=False)
        what = {TRAINED: f"trained in {duration(result.seconds)}", RESUMED: f"resumed, done in "
                f"{duration(result.seconds)}", REUSED: "reused (another grid finished it meanwhile)",
                FAILED: f"FAILED: {result.error}", INTERRUPTED: f"stopped: {result.error}"}[result.status]
        self.line(f"{task.describe()}: {what}" + (f" ({task.run_dir})" if result.status in FINISHED else ""))

    def show(self, results: dict[str, CellResult]) -> None:
        now = time.monotonic()
        waiting = [name for name in self.tasks if name not in results]
        running = [name for name in waiting if cell_is_running(self.tasks[name].lock)]
        for name in running:
            self.running_since.setdefault(name, now)
        for name in list(self.running_since):
            if name not in running and name not in results:
                del self.running_since[name]
        self.concurrency = max(self.concurrency, len(running))
        failed = sum(result.status == FAILED for result in results.values())
        stopped = sum(result.status == INTERRUPTED for result in results.values())
        counts = (len(results) - failed - stopped, len(running), failed, len(waiting) - len(running), stopped)
        if counts == self.shown and now - self.shown_at < self.interval:
            return
        self.shown, self.shown_at = counts, now
        eta = "?"
        if self.durations and waiting:
            mean = sum(self.durations) / len(self.durations)
            left = sum(max(mean - (now - self.running_since[name]), 0.0) for name in running) + mean * counts[3]
            eta = duration(left / self.concurrency)
        elif not waiting:
            eta = "0:00"
        self.line(f"grid: {counts[0]} done, {counts[1]} running, {counts[2]} failed, "
                  + (f"{stopped} interrupted, " if stopped else "")
                  + f"{counts[3]} queued of {len(self.tasks)} cells; elapsed {duration(now - self.started)}, ETA {eta}")


def cell_is_running(lock: Path) -> bool:
    """Whether a process holds the cell's lock (it is working on the cell), asked without waiting."""
    try:
        handle = open(lock, "rb")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@contextlib.contextmanager
def cell_lock(task: CellTask, log: Callable[[str], None]):
    """Hold the cell's lock while working on it; when another grid holds it, say so and wait for it."""
    task.lock.parent.mkdir(parents=True, exist_ok=True)
    with open(task.lock, "a") as handle:   # closing the file releases the lock
        for _ in range(LOCK_TRIES):   # the driver's cell_is_running holds it for an instant now and then
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
        else:
            log(f"{task.describe()}: another grid is working on this cell; waiting for it to end")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


class CellLog(io.TextIOBase):
    """A cell's log, RUN_DIR/cell.log (appended to: a resumed cell continues it), written once the run has
    written its config.json (before, the run folder must stay empty for the run to claim it, see
    xmcbench.rundir), held in memory until then. A text file, so that a worker can send its stderr (progress
    lines) here too. echo: also gets every log line (the driver's log, when the cell runs in its process)."""

    def __init__(self, run_dir: Path, echo: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.path, self.ready = Path(run_dir) / CELL_LOG, Path(run_dir) / "config.json"
        self.echo = echo
        self.held: list[str] = []
        self.file = None

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def _open_when_ready(self) -> None:
        if self.file is None and self.ready.exists():
            self.file = open(self.path, "a", encoding="utf-8")
            self.file.write("".join(self.held))
            self.held.clear()

    def write(self, text: str) -> int:
        self._open_when_ready()
        if self.file is not None:
            self.file.write(text)
            self.file.flush()
        else:
            self.held.append(text)
        return len(text)

    def line(self, text: str) -> None:
        if self.echo is not None:
            self.echo(text)
        self.write(text + "\n")

    def finish(self) -> str:
        """Close the file; return what never reached it (the run never wrote its config.json)."""
        self._open_when_ready()
        if self.file is not None:
            self.file.close()
            self.file = None
        held, self.held = "".join(self.held), []
        return held


def run_cell(task: CellTask, context: GridContext | None = None) -> CellResult:
    """The work of one cell, wherever it runs: under the cell's lock, reuse the run if it is finished (another
    grid finished it), resume it if it is unfinished, else train it. Never raises for the cell's own failure.

    context: the driver's, when the cell runs in the driver's process (its registry and dataset are reused,
    its log shows the cell's lines). None on a worker: the registry comes from the installed plugins, the
    dataset is read from its path (once), and stderr (progress lines) goes to the cell's log."""
    from xmcbench.training import TrainingInterrupted

    started = time.perf_counter()
    cell_log = CellLog(task.run_dir, echo=context.log if context is not None else None)
    status, error = FAILED, None
    try:
        with contextlib.ExitStack() as stack:
            if context is None:
                stack.enter_context(contextlib.redirect_stderr(cell_log))
                stack.enter_context(_interruptible())
            stack.enter_context(cell_lock(task, cell_log.line))
            status = _work(task, context, cell_log.line)
    except (TrainingInterrupted, KeyboardInterrupt) as stop:
        status, error = INTERRUPTED, first_line(stop) or "interrupted"
    except XmcError as failure:
        error = joined_line(failure)
    except Exception as failure:   # a bug: its traceback goes to the cell's log
        error = error_line(failure)
        cell_log.write(traceback.format_exc())
    if error is not None:   # the driver reports it too; this line is for the cell's own log
        cell_log.write(f"{task.describe()}: {status}: {error}\n")
    return CellResult(task.name, status, error, time.perf_counter() - started, cell_log.finish())


@contextlib.contextmanager
def _interruptible():
    """SIGINT raises KeyboardInterrupt while a worker runs a cell (training turns it into a checkpoint and a
    stop): engines may start their workers with SIGINT ignored, and they cancel a running cell with SIGINT
    (Ray's `ray.cancel`, `scancel --signal=INT`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _work(task: CellTask, context: GridContext | None, log: Callable[[str], None]) -> str:
    from xmcbench.formats import open_dataset
    from xmcbench.rundir import is_finished
    from xmcbench.runs import launch
    from xmcbench.runs.plan import plan_resume

    if is_finished(task.run_dir):
        log(f"{task.describe()}: another grid finished it meanwhile ({task.run_dir})")
        return REUSED
    registry = context.registry if context is not None else build_registry()
    if context is not None:
        dataset = context.dataset
    else:
        dataset = open_dataset(registry, task.plan.dataset, task.data_dir, task.plan.reading)
    if dataset.version != task.dataset_version:
        raise XmcError(f"the dataset {task.plan.dataset} read here has version {dataset.version}, but the grid was "
                       f"planned on version {task.dataset_version}; give every worker the same files (a shared "
                       "--data-dir)")
    if (task.run_dir / "config.json").exists() and not launch.continues_from_scratch(registry, task.method):
        log(f"{task.describe()}: resuming {task.run_dir}")
        plan = plan_resume(task.run_dir)
        plan.loaded = dataset
        launch.run(plan, task.run_dir, task.data_dir, registry=registry, log=log, resume=True)
        return RESUMED
    log(f"{task.describe()}: training into {task.run_dir}")
    # overwrite: only an unfinished run of a method that cannot resume is there to be replaced
    launch.run(dataclasses.replace(task.plan, loaded=dataset), task.run_dir, task.data_dir, registry=registry, log=log,
               overwrite=True)
    return TRAINED


class LocalExecutor(Executor):
    """The cells one after another in the driver's process, as `compare` always ran them (the default)."""

    def __init__(self, options: ExecutorOptions | None = None) -> None:
        (options or ExecutorOptions()).check_used("local", used=("cell_cpus",))
        self.queue: list[CellTask] = []

    def submit(self, task: CellTask) -> None:
        self.queue.append(task)

    def wait(self, timeout: float) -> list[CellResult]:
        return [run_cell(self.queue.pop(0), self.context)] if self.queue else []

    def cancel(self) -> None:
        self.queue.clear()
