"""Counting the operations that make the host wait for a GPU, on any device (the CPU included).

On CUDA the host queues kernels and runs ahead, until an operation needs a value computed on the device: a
tensor read as a Python number (`.item()`, `bool(t)`, `if t:`), a result whose size depends on the data
(`nonzero`, boolean-mask indexing, `unique`, `masked_select`, coalescing a sparse tensor), each of which
waits for every kernel queued before it. Counted per training step, they are what keeps a fast GPU idle
between kernels. The same operations are dispatched on the CPU, so they can be counted (and kept out of
a step by tests) without a GPU.

    with count_host_syncs() as syncs:
        trainer.train_step(rows)
    print(syncs.total, dict(syncs))
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPERATIONS = {
    "aten._local_scalar_dense": "a tensor read as a Python number",
    "aten.nonzero": "nonzero (output size depends on the data)",
    "aten.masked_select": "masked_select (output size depends on the data)",
    "aten._unique": "unique", "aten._unique2": "unique", "aten.unique_dim": "unique",
    "aten.unique_consecutive": "unique_consecutive",
    "aten._coalesce": "coalescing a sparse tensor",
    "aten.equal": "torch.equal (a Python bool)",
    "aten.is_nonzero": "a tensor used as a Python bool",
}


def _operation(func) -> str:
    return str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)


class _HostSyncCounter(TorchDispatchMode, Counter):
    """Counts syncing operations by name; boolean-mask indexing and repeat_interleave without output_size
    count as the nonzero they run."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        Counter.__init__(self)

    @property
    def total(self) -> int:
        return sum(self.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _operation(func)
        if name in SYNCING_OPERATIONS:
            self[name] += 1
        elif name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self[f"{name} (boolean mask)"] += 1
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None and (
                len(args) < 3 or args[2] is None) and isinstance(args[0], torch.Tensor) and \
                not isinstance(args[1] if len(args) > 1 else None, int):
            self[f"{name} (no output_size)"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs():
    """Yields a Counter {operation: times} of what would wait for the device, inside the block (forward,
    backward and optimizer steps included)."""
    counter = _HostSyncCounter()
    with counter:
        yield counter
