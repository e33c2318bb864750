"""The "ray" executor (`xmcbench compare --executor ray`): each cell a Ray task, on a Ray instance started on
this machine for the grid, or on the Ray cluster at `--address` (`auto`, `HOST:6379`, or `ray://HOST:10001`
through Ray Client).

A task asks for `--cell-cpus` CPUs (default 1; the cells' torch threads are set to it by `compare`) and
`--cell-gpus` GPUs: a fraction such as 0.125 lets eight cells share one GPU, and without it a cell sees no
GPU (Ray hides the GPUs from tasks that ask for none). The task receives the cell's CellTask (settings and
paths) and reads the dataset from its path: run folders, the grid folder and the data must be on a filesystem
every node reaches. A worker that dies fails its cell (no retry: a cell that ran out of memory would again);
Ctrl-C cancels the tasks: Ray sends SIGINT to the running ones, which checkpoint and stop.
"""

from __future__ import annotations

from xmcbench.errors import XmcError, error_line
from xmcbench.executors import FAILED, INTERRUPTED, CellResult, CellTask, Executor, ExecutorOptions, GridContext, \
    run_cell

NAME = "ray"
EXTRA = "ray"
DESCRIPTION = ("each cell a Ray task asking for --cell-cpus and --cell-gpus (fractions share a GPU), on this "
               "machine or the Ray cluster at --address")
CANCEL_GRACE_SECONDS = 120   # how long cancelled cells may take to write their checkpoint before they are killed


def build(options: ExecutorOptions) -> "RayExecutor":
    options.check_used(NAME, used=("cell_cpus", "cell_gpus", "address"))
    try:
        import ray  # noqa: F401
    except ImportError:
        raise XmcError("--executor ray needs Ray: pip install 'xmcbench[ray]'") from None
    return RayExecutor(options)


class RayExecutor(Executor):
    def __init__(self, options: ExecutorOptions) -> None:
        self.options = options
        self.tasks: dict = {}   # ObjectRef -> CellTask, for the cells without a result yet
        self.started_ray = False
        self.remote = None

    def start(self, context: GridContext) -> None:
        import ray

        super().start(context)
        if not ray.is_initialized():
            where = {"address": self.options.address} if self.options.address else {"include_dashboard": False}
            try:
                ray.init(**where, log_to_driver=False)   # each cell's output goes to its own cell.log
            except (ConnectionError, RuntimeError, ValueError) as error:
                raise XmcError(f"cannot start or reach Ray{f' at {self.options.address}' if self.options.address else ''}"
                               f": {error_line(error)}") from None
            self.started_ray = True
        self.remote = ray.remote(run_cell)

    def submit(self, task: CellTask) -> None:
        ref = self.remote.options(num_cpus=self.options.cell_cpus or 1, num_gpus=self.options.cell_gpus or 0,
                                  max_retries=0, name=f"xmcbench {task.name}").remote(task)
        self.tasks[ref] = task

    def wait(self, timeout: float) -> list[CellResult]:
        import ray

        if not self.tasks:
            return []
        ready, _ = ray.wait(list(self.tasks), num_returns=1, timeout=timeout)
        if ready:   # every one that has ended by now
            ready, _ = ray.wait(list(self.tasks), num_returns=len(self.tasks), timeout=0)
        return [self._result(ref) for ref in ready]

    def _result(self, ref) -> CellResult:
        import ray
        from ray.exceptions import TaskCancelledError

        task = self.tasks.pop(ref)
        try:
            return ray.get(ref)
        except TaskCancelledError:
            return CellResult(task.name, INTERRUPTED, "cancelled")
        except ray.exceptions.RayError as error:   # the worker died, or the task could not run there
            cause = getattr(error, "cause", None) or error
            return CellResult(task.name, FAILED, f"its Ray task failed: {error_line(cause)}")

    def cancel(self) -> None:
        import ray

        refs = list(self.tasks)
        for ref in reversed(refs):   # the last submitted first: queued ones never start; running ones get SIGINT
            ray.cancel(ref)
        _, stuck = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_GRACE_SECONDS) if refs else ([], [])
        for ref in stuck:
            ray.cancel(ref, force=True)
        if stuck:
            ray.wait(stuck, num_returns=len(stuck), timeout=30)

    def close(self) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
