"""Forked worker processes that share numpy / scipy arrays with the process that starts them.

Label features (xmcbench.features) and the balanced label tree (xmcbench.clustering) split their work over
such workers: scipy's products hold the GIL, so threads would not help, and forked workers read the
parent's matrices without a copy and without pickling.
"""

from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import os
import signal
import warnings

import numpy as np

from xmcbench.errors import XmcError, error_line
from xmcbench.progress import progress_bar


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def run_forked(workers: int, work, description: str, total: int) -> None:
    """Run work(worker, advance) in `workers` forked processes, with a progress bar of `total` steps that
    counts what they pass to advance(n). When one fails, the others are ended and one line names the
    stage (`description`) and the cause. Forked, the workers inherit the parent's arrays without a copy and
    nothing is pickled; they must use numpy and scipy only (no threads, and no locks that the parent may
    have held when it forked)."""
    counters_memory = mmap.mmap(-1, 8 * workers)
    errors_memory = mmap.mmap(-1, _ERROR_BYTES * workers)   # each worker's one-line cause, if it fails
    counters = np.frombuffer(counters_memory, dtype=np.int64, count=workers)
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_forked_main,
                                 args=(work, worker, counters[worker:worker + 1], errors_memory),
                                 name=f"xmcbench-{worker}", daemon=True) for worker in range(workers)]
    try:
        # Started before the progress bar opens: no display thread of ours runs while the process forks.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for process in processes:
                process.start()
        with progress_bar(description, total=total) as advance:
            shown = 0
            while True:
                done = int(counters.sum())
                advance(done - shown)
                shown = done
                _raise_if_failed(processes, description, errors_memory)
                running = [process.sentinel for process in processes if process.exitcode is None]
                if not running:
                    _raise_if_failed(processes, description, errors_memory)   # one may have failed last
                    break
                multiprocessing.connection.wait(running, timeout=0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
        counters = None  # a view of the shared memory must go before it closes
        counters_memory.close()
        errors_memory.close()


_ERROR_BYTES = 1024
_WORKER_FAILED = 3   # the exit code of a worker that recorded its error


def _forked_main(work, worker: int, counter: np.ndarray, errors_memory: mmap.mmap) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the workers

    def advance(n: int = 1) -> None:
        counter[0] += n

    try:
        work(worker, advance)
    except BaseException as error:  # noqa: BLE001 -- reported by the parent in one line, not a traceback
        cause = error_line(error).encode("utf-8", "replace")[:_ERROR_BYTES]
        errors_memory[worker * _ERROR_BYTES:worker * _ERROR_BYTES + len(cause)] = cause
        os._exit(_WORKER_FAILED)


def _raise_if_failed(processes, description: str, errors_memory: mmap.mmap) -> None:
    for worker, process in enumerate(processes):
        code = process.exitcode
        if code is not None and code < 0:
            raise XmcError(
                f"{description}: worker process {worker} of {len(processes)} was killed by signal {-code} (the "
                f"system may be out of memory); use fewer threads or a machine with more memory"
            )
        if code:
            recorded = errors_memory[worker * _ERROR_BYTES:(worker + 1) * _ERROR_BYTES].rstrip(b"\0")
            cause = recorded.decode("utf-8", "replace") or f"it exited with code {code}"
            raise XmcError(f"{description}: worker process {worker} of {len(processes)} failed: {cause}")
