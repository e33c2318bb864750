"""Small file helpers shared by caches and run directories: atomic writes, the cache folder, hashing."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
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


_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def write_errors_as_os_errors(path: Path):
    """Inside the block, a library's report of a failed write (safetensors' SafetensorError "... No space
    left on device (os error 28)") is raised as the OSError it stands for, about `path`, so that it ends in
    the one line every OSError gets (a full disk, a read-only folder); an OSError that names no file (a
    write() on an open file) gets `path`; other errors pass as they are."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error
    except Exception as error:
        match = _OS_ERROR_CODE.search(str(error)) if type(error).__name__ == "SafetensorError" else None
        if match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(path)) from error


def atomic_write(path: Path, write) -> None:
    """Call write(file_path) on a temporary file beside `path`, fsync it, then rename it over `path`,
    so a reader never sees a partly written file. A write that fails for lack of space or permission
    raises OSError, whichever library wrote (write_errors_as_os_errors)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        with write_errors_as_os_errors(path):
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


def staging_folder(target: Path) -> Path:
    return target.with_name(f".{target.name}.xmcbench-replacement")


def replace_folder(new: Path, target: Path) -> None:
    """Put the finished folder `new` (a sibling of target) in target's place; an earlier target is moved
    aside first and deleted only once `new` is in place."""
    replaced = target.with_name(f".{target.name}.xmcbench-replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():
        os.rename(target, replaced)
    os.rename(new, target)
    shutil.rmtree(replaced, ignore_errors=True)


@contextlib.contextmanager
def written_beside(target: Path):
    """A new, empty folder beside `target` to write a whole folder into (an ensemble, a converted dataset);
    when the block ends without an error it replaces target (replace_folder), otherwise it is deleted and
    target stays as it was. A full disk or Ctrl-C midway never leaves a half-written target."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.xmcbench-new-"))
    try:
        os.chmod(staging, umask_mode(folder=True))   # mkdtemp's 0700 would keep the folder from other users
        yield staging
        replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


COMPRESSED_SUFFIXES = (".xz", ".gz", ".bz2")
OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}


@contextlib.contextmanager
def open_binary(file):
    """A binary stream of the file's contents (a path, or an importlib.resources Traversable), decompressing
    by suffix (COMPRESSED_SUFFIXES)."""
    file = Path(file) if isinstance(file, str) else file
    opener = next((OPENERS[ext] for ext in COMPRESSED_SUFFIXES if file.name.endswith(ext)), None)
    with file.open("rb") as raw:
        if opener is None:
            yield raw
        else:
            # The decompressor does not close a stream it was handed; the outer `with` does.
            with opener(raw) as stream:
                yield stream
