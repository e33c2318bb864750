"""Small file helpers shared by caches and run directories: atomic writes, the cache folder, hashing."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from xmcbench.errors import XmcError


def cache_dir() -> Path:
    """$XMCBENCH_CACHE, else ~/.cache/xmcbench."""
    return Path(os.environ.get("XMCBENCH_CACHE") or Path.home() / ".cache" / "xmcbench")


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-serialisable parts, used as a cache key."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def umask_mode(folder: bool = False) -> int:
    """The permissions a plain open()/mkdir() would give under the process's umask (mkstemp and mkdtemp
    make private 0600/0700 files and folders, which another user sharing a model or cache cannot read)."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def atomic_write(path: Path, write) -> None:
    """Call write(file_path) on a temporary file beside `path`, fsync it, then rename it over `path`,
    so a reader never sees a partly written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temporary))
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.chmod(temporary, umask_mode())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json(path: Path, value: Any) -> None:
    atomic_write(path, lambda temporary: temporary.write_text(json.dumps(value, indent=2, default=str) + "\n"))


def read_json(path: Path, what: str | None = None, remedy: str = "") -> Any:
    """The JSON value in `path`. Without `what`, a missing or unreadable file or bad JSON raises as it is
    (OSError, UnicodeDecodeError, json.JSONDecodeError). With `what` (what the file holds: "the label list"),
    each ends in one XmcError line that names the file and says what is wrong, followed by "; remedy" when a
    remedy (what to do) is given."""
    path = Path(path)
    if what is None:
        return json.loads(path.read_text(encoding="utf-8"))
    end = f"; {remedy}" if remedy else ""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise XmcError(f"{path} is missing ({what}){end}") from None
    except OSError as error:
        raise XmcError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise XmcError(f"{path} is not valid JSON (it is not UTF-8 text): {what} is damaged{end}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        problem = "it is empty" if not text.strip() else f"{error.msg} at line {error.lineno} column {error.colno}"
        raise XmcError(f"{path} is not valid JSON ({problem}): {what} is damaged or truncated{end}") from None
