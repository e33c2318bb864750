"""The "slurm" executor (`xmcbench compare --executor slurm`): each cell a Slurm job submitted through
submitit from the machine running `compare` (a login node), with no sbatch script to write.

Each job asks for one task with `--cell-cpus` CPUs (default 1; the cells' torch threads are set to it by
`compare`), `--cell-gpus` whole GPUs, `--time-limit` minutes (required) on `--partition`;
`--executor-option KEY=VALUE` adds any other sbatch option (`account=abc`, `qos=high`, `constraint=a100`).
`--executor-option cluster=local` runs the jobs as local processes through submitit instead, without Slurm
(to try a grid out, and in the tests). submitit's own files (the pickled CellTask, each job's stdout and
stderr) are in GRID/submitit/JOB_ID/; the run folders, the grid folder and the data must be on a filesystem
the compute nodes reach, and the job runs the same Python (`sys.executable`), so xmcbench must be installed
there too.

Ctrl-C cancels the jobs: running ones get SIGINT (`scancel --signal=INT`), so training checkpoints and stops,
and queued ones are cancelled.
"""

from __future__ import annotations

import shutil
import subprocess
import time

from xmcbench.errors import XmcError, error_line
from xmcbench.executors import FAILED, INTERRUPTED, CellResult, CellTask, Executor, ExecutorOptions, GridContext, run_cell

NAME = "slurm"
EXTRA = "slurm"
DESCRIPTION = ("each cell a Slurm job through submitit (--partition, --time-limit, --cell-cpus, whole "
               "--cell-gpus; --executor-option KEY=VALUE for other sbatch options)")
CLUSTERS = ("slurm", "local")   # --executor-option cluster=...: submitit's Slurm executor, or its local one
CANCEL_GRACE_SECONDS = 120   # how long cancelled cells may take to write their checkpoint
POLL_SECONDS = 1.0


def build(options: ExecutorOptions) -> "SlurmExecutor":
    options.check_used(NAME, used=("cell_cpus", "cell_gpus", "partition", "time_limit"), options=None)
    if options.time_limit is None:
        raise XmcError("--executor slurm needs --time-limit MINUTES: each cell's Slurm time limit (e.g. "
                       "--time-limit 120); a cell stopped by it resumes from its checkpoint when compare runs again")
    gpus = options.cell_gpus or 0
    if gpus != int(gpus):
        raise XmcError(f"--cell-gpus {gpus}: a Slurm job gets whole GPUs; to pack several cells onto one GPU use "
                       "--executor ray")
    cluster = options.options.get("cluster", "slurm")
    if cluster not in CLUSTERS:
        raise XmcError(f"--executor-option cluster={cluster}: choose slurm (the default) or local (jobs as local "
                       "processes, without Slurm)")
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise XmcError("--executor slurm needs submitit: pip install 'xmcbench[slurm]'") from None
    if cluster == "slurm" and shutil.which("sbatch") is None:
        raise XmcError("--executor slurm submits jobs with sbatch, which is not on this machine's PATH; run "
                       "compare on a Slurm login node (--executor-option cluster=local runs the jobs as local "
                       "processes instead)")
    return SlurmExecutor(options, cluster)


class SlurmExecutor(Executor):
    def __init__(self, options: ExecutorOptions, cluster: str) -> None:
        self.options, self.cluster = options, cluster
        self.jobs: dict = {}   # submitit Job -> CellTask, for the cells without a result yet
        self.executor = None
        self.cancelled = False

    def start(self, context: GridContext) -> None:
        import submitit

        super().start(context)
        sbatch = {key: value for key, value in self.options.options.items() if key != "cluster"}
        self.executor = submitit.AutoExecutor(folder=context.folder / "submitit" / "%j", cluster=self.cluster)
        self.executor.update_parameters(
            name="xmcbench", timeout_min=self.options.time_limit, nodes=1, tasks_per_node=1,
            cpus_per_task=self.options.cell_cpus or 1, gpus_per_node=int(self.options.cell_gpus or 0),
            **({"slurm_partition": self.options.partition} if self.options.partition and self.cluster == "slurm"
               else {}),
            **({"slurm_additional_parameters": sbatch} if sbatch and self.cluster == "slurm" else {}))

    def submit(self, task: CellTask) -> None:
        self.executor.update_parameters(name=f"xmcbench-{task.name}")
        try:
            self.jobs[self.executor.submit(run_cell, task)] = task
        except Exception as error:   # sbatch refused it: a wrong partition, account or limit
            raise XmcError(f"submitting {task.describe()} failed: {error_line(error)}") from None

    def wait(self, timeout: float) -> list[CellResult]:
        deadline = time.monotonic() + timeout
        while True:
            done = [job for job in self.jobs if job.done()]
            if done or time.monotonic() >= deadline:
                return [self._result(job) for job in done]
            time.sleep(min(POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))

    def _result(self, job) -> CellResult:
        task = self.jobs.pop(job)
        try:
            return job.result()
        except Exception as error:   # the job was killed (time limit, memory, cancel) or could not start
            if self.cancelled:
                return CellResult(task.name, INTERRUPTED, f"its job {job.job_id} was cancelled")
            return CellResult(task.name, FAILED, f"its job {job.job_id} ended without a result: {error_line(error)} "
                                                  f"(its output: {job.paths.stderr})")

    def cancel(self) -> None:
        self.cancelled = True
        for job in list(self.jobs):
            if self.cluster == "slurm" and job.state == "RUNNING":
                subprocess.call(["scancel", "--signal=INT", str(job.job_id)])   # training checkpoints and stops
            else:   # queued on Slurm; or a local process, which submitit stops with SIGINT
                job.cancel(check=False)
        deadline = time.monotonic() + CANCEL_GRACE_SECONDS
        while any(not job.done() for job in self.jobs) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        for job in self.jobs:
            if not job.done():
                job.cancel(check=False)
