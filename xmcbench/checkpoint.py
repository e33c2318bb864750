"""Training checkpoints: tensors in safetensors, everything else in JSON, never pickled.

Layout inside a run directory:

    checkpoints/step-00000120/state.json          structure, numbers, RNG states
    checkpoints/step-00000120/tensors.safetensors every tensor the structure refers to
    checkpoints/latest.json                       {"directory": "step-00000120", "step": 120}

A checkpoint is written into a temporary folder, fsynced and renamed; only then is `latest.json`
replaced (atomically). Readers follow `latest.json` alone, so a process killed at any moment leaves
either the previous checkpoint or the new one, never a partly written file that is read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from xmcbench.errors import DamagedModel, XmcError, error_line
from xmcbench.storage import read_json, write_errors_as_os_errors, write_json

POINTER = "latest.json"


def split_state(value: Any, tensors: dict[str, torch.Tensor], path: str = "s") -> Any:
    """Replace every tensor in a nested dict/list/tuple by a reference into `tensors`; JSON-ready."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and "__tensor__" not in value:
            return {key: split_state(item, tensors, f"{path}.{key}") for key, item in value.items()}
        return {"__items__": [[key, split_state(item, tensors, f"{path}.{index}")]
                              for index, (key, item) in enumerate(value.items())]}
    if isinstance(value, tuple):
        return {"__tuple__": [split_state(item, tensors, f"{path}.{i}") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [split_state(item, tensors, f"{path}.{i}") for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint a value of type {type(value).__name__} at {path}")


def join_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of split_state."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__items__" in value:
            return {key: join_state(item, tensors) for key, item in value["__items__"]}
        if "__tuple__" in value:
            return tuple(join_state(item, tensors) for item in value["__tuple__"])
        return {key: join_state(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [join_state(item, tensors) for item in value]
    return value


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_checkpoint(directory: Path, state: dict, step: int) -> Path:
    """Write `state` as checkpoint `step` under `directory`, then point latest.json at it and remove
    older checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    temporary = directory / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        tensors: dict[str, torch.Tensor] = {}
        skeleton = split_state(state, tensors)
        with write_errors_as_os_errors(directory):   # a full disk: one line naming the folder, as any OSError
            save_file(tensors, str(temporary / "tensors.safetensors"))
        write_json(temporary / "state.json", skeleton)
        _fsync_file(temporary / "tensors.safetensors")
    except BaseException:   # a full disk or Ctrl-C leaves no half-written folder (the previous checkpoint stays)
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    final = directory / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_directory(directory)
    write_json(directory / POINTER, {"directory": name, "step": step})
    for old in directory.iterdir():
        if old.is_dir() and old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(directory: Path) -> dict | None:
    """The state of the checkpoint latest.json points to, or None when there is none yet."""
    pointer = directory / POINTER
    if not pointer.exists():
        return None
    try:
        name = read_json(pointer)["directory"]
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise DamagedModel(f"{pointer} names {name!r}, which is not a checkpoint folder inside {directory}; "
                               f"delete {directory} to restart the run from scratch")
        target = directory / name
        skeleton = read_json(target / "state.json")
        tensors = load_file(str(target / "tensors.safetensors"))
    except XmcError:
        raise
    except Exception as error:  # JSON, key and safetensors errors all mean the same thing here
        raise DamagedModel(f"the checkpoint in {directory} cannot be read ({error_line(error)}); delete {directory} "
                           "to restart the run from scratch") from None
    return join_state(skeleton, tensors)
