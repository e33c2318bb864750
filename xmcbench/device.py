"""Where and how a run computes: its device, CPU threads, mixed precision, host-to-device copies and seeds."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import torch

from xmcbench.config import TrainConfig
from xmcbench.distributed import Distributed
from xmcbench.errors import XmcError


def pick_device(config: TrainConfig, dist: Distributed | None = None) -> torch.device:
    """config.device; in a distributed run "auto" and "cuda" mean this process's GPU (cuda:LOCAL_RANK)."""
    if dist is not None and dist.enabled and torch.cuda.is_available() and config.device in ("auto", "cuda"):
        return torch.device("cuda", dist.local_rank)
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise XmcError(f"device={config.device!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise XmcError("device=cuda but torch sees no CUDA device; use --set device=cpu")
    return device


def set_threads(config: TrainConfig) -> int:
    """Torch's CPU threads: config.threads, else one per core available to this process."""
    threads = config.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device, config: TrainConfig):
    if device.type == "cuda" and config.amp:
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host tensors onto `device`. To a GPU through pinned memory without waiting: a copy from ordinary
    memory would wait until the GPU has finished everything queued before it."""
    if device.type != "cuda":
        return tuple(tensor.to(device) for tensor in tensors)
    return tuple(tensor.pin_memory().to(device, non_blocking=True) for tensor in tensors)
