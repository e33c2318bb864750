"""Several processes, one run: `torchrun --nproc_per_node N -m xmcbench run ...` (and multi-node through
torchrun's rendezvous). torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; without them
everything here is a no-op and the run is an ordinary single process.

How a distributed run divides the work, so its results are comparable with a single process:
- `batch_size` is the GLOBAL batch. Every process draws the same global batches (same seed, same data order)
  and takes its contiguous share (`np.array_split(rows, world_size)[rank]`): the per-process batch is
  batch_size / world_size. Each loss part is weighted by its share of the global count, so the summed
  gradient is the single-process gradient of the same global batch.
- Dense gradients are averaged by DistributedDataParallel; the sparse label-embedding gradient (only the rows
  a step touched) is gathered from every process and averaged the same way, never densified.
- Prediction (test, validation, a static sampler's candidates) is sharded by rows and gathered, so every
  process holds the full result; only rank 0 writes the run directory, checkpoints and logs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from xmcbench.errors import XmcError


@dataclass
class Distributed:
    """This process's place in the run. world_size == 1: a single process (the default)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, rows: np.ndarray) -> np.ndarray:
        """This process's contiguous share of a global batch (sizes differ by at most one)."""
        if not self.enabled:
            return rows
        return np.array_split(rows, self.world_size)[self.rank]

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over processes, on values' device (`values` itself in a single process)."""
        if not self.enabled:
            return values
        moved = values.to(_collective_device(values.device))
        torch.distributed.all_reduce(moved)
        return moved.to(values.device)

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. fills a cache); the others run it after, reading what it wrote."""
        if self.enabled and not self.is_main:
            self.barrier()
        yield
        if self.enabled and self.is_main:
            self.barrier()

    def gather_rows(self, rows: np.ndarray, values: np.ndarray, total: int, fill) -> np.ndarray:
        """Assemble a (total, ...) array from every process's `values` (len(rows), ...) for its `rows`.

        Each process passes the rows it computed; the result, identical on every process, has `fill` where no
        process wrote. Shapes beyond the first must agree across processes."""
        full = np.full((total, *values.shape[1:]), fill, dtype=values.dtype)
        if not self.enabled:
            full[rows] = values
            return full
        device = _collective_device()
        largest = self._max(len(rows))
        padded_rows = torch.full((largest,), -1, dtype=torch.long, device=device)
        padded_rows[:len(rows)] = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        padded_values = torch.zeros((largest, *values.shape[1:]), dtype=_torch_dtype(values.dtype), device=device)
        padded_values[:len(rows)] = torch.from_numpy(np.ascontiguousarray(values))
        all_rows = [torch.empty_like(padded_rows) for _ in range(self.world_size)]
        all_values = [torch.empty_like(padded_values) for _ in range(self.world_size)]
        torch.distributed.all_gather(all_rows, padded_rows)
        torch.distributed.all_gather(all_values, padded_values)
        for gathered_rows, gathered_values in zip(all_rows, all_values):
            keep = gathered_rows >= 0
            full[gathered_rows[keep].cpu().numpy()] = gathered_values[keep].cpu().numpy()
        return full

    def _max(self, value: int) -> int:
        if not self.enabled:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=_collective_device())
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    def average_sparse_gradient(self, parameter: torch.Tensor) -> None:
        """Replace a sparse (COO) gradient by its average over processes (what DistributedDataParallel does for
        dense ones), still sparse: only touched rows travel.

        parameter.grad: (L, h) sparse with n_r touched rows on process r -> the same on every process: the rows
        of all processes, duplicates summed, divided by world_size. A process that touched nothing sends none."""
        if not self.enabled:
            return
        grad = parameter.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long, device=parameter.device),
                                           torch.zeros((0, *parameter.shape[1:]), dtype=parameter.dtype,
                                                       device=parameter.device), parameter.shape)
        grad = grad.coalesce()
        indices, values = grad.indices()[0], grad.values()
        device = _collective_device(parameter.device)
        largest = self._max(len(indices))
        padded_indices = torch.full((largest,), -1, dtype=torch.long, device=device)
        padded_indices[:len(indices)] = indices.to(device)
        padded_values = torch.zeros((largest, *values.shape[1:]), dtype=values.dtype, device=device)
        padded_values[:len(indices)] = values.to(device)
        all_indices = [torch.empty_like(padded_indices) for _ in range(self.world_size)]
        all_values = [torch.empty_like(padded_values) for _ in range(self.world_size)]
        torch.distributed.all_gather(all_indices, padded_indices)
        torch.distributed.all_gather(all_values, padded_values)
        gathered_indices, gathered_values = torch.cat(all_indices), torch.cat(all_values)
        keep = gathered_indices >= 0
        parameter.grad = torch.sparse_coo_tensor(
            gathered_indices[keep].unsqueeze(0).to(parameter.device),
            gathered_values[keep].to(parameter.device) / self.world_size, parameter.shape,
            check_invariants=False).coalesce()


_collective_backend = {"name": None}


def _collective_device(preferred: torch.device | None = None) -> torch.device:
    """NCCL moves CUDA tensors only; gloo moves CPU tensors."""
    if _collective_backend["name"] == "nccl":
        return preferred if preferred is not None and preferred.type == "cuda" else \
            torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def is_main_process() -> bool:
    """Rank 0 of a torchrun run, or a single process (from the environment torchrun sets)."""
    return os.environ.get("RANK", "0") == "0"


def broadcast_text(dist: Distributed, text: str) -> str:
    """Rank 0's `text` on every process (a short string, e.g. the run directory)."""
    if not dist.enabled:
        return text
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    length = torch.tensor([len(data) if dist.is_main else 0], dtype=torch.long, device=_collective_device())
    torch.distributed.broadcast(length, src=0)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=_collective_device())
    if dist.is_main:
        buffer[:] = torch.from_numpy(data.copy())
    torch.distributed.broadcast(buffer, src=0)
    return bytes(buffer.cpu().numpy()).decode()


def from_environment() -> Distributed:
    """The process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK), joined; a single process when
    WORLD_SIZE is unset or 1. Backend: nccl when CUDA is present, gloo otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise XmcError("WORLD_SIZE is set but RANK is missing or not a number; start distributed runs with "
                       "torchrun --nproc_per_node N -m xmcbench run ...") from None
    if not torch.distributed.is_initialized():
        use_cuda = torch.cuda.is_available() and os.environ.get("XMCBENCH_DIST_BACKEND", "") != "gloo"
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group(backend=backend)
        _collective_backend["name"] = backend
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank)


def shutdown(dist: Distributed, together: bool = False) -> None:
    """Leave the process group (a no-op in a single process or once left).

    together=True: every process calls this at the same point, after the run's last collective. The barrier makes
    each process wait until all have finished their collectives before any tears down its connections. Without it,
    a non-main process left as soon as its last gather returned, and once on a loaded 2-core machine it ended in
    SIGABRT ("terminate called without an active exception") while rank 0 was still writing."""
    if not (dist.enabled and torch.distributed.is_initialized()):
        return
    if together:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def end_other_process() -> NoReturn:
    """End a non-main process of a torchrun run whose part is done (it has left the process group): exit 0 without
    the interpreter's finalization.

    In that finalization, after every atexit handler, about one two-process run in twenty on a loaded 2-core
    machine aborted ("terminate called without an active exception": a C++ thread still joinable when its owner was
    destroyed). torchrun then sent SIGTERM to process 0 while it was still writing the run's files, and the run was
    lost. os._exit skips those destructors; the process holds nothing left to write."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
