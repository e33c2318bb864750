"""Claiming a run folder, so that a run never destroys what it did not write, and never writes outside it.

Every run folder holds RUN_MARKER, a file only xmcbench writes, locked (flock) by the process writing the
run for as long as it runs: a second process given the same folder is refused instead of writing over it,
and `--overwrite` deletes only folders that carry the marker. A run that replaces an earlier one is
written to a hidden sibling folder and swapped in when it has finished, so a run that fails, is
interrupted or is refused leaves the earlier run as it was. Ensembles and `xmcbench convert` write their
folders the same way (written_beside).

What a run writes stays inside its folder (run_path): no part of a path inside it may be a symbolic link,
`..` or absolute, so a run folder received from someone else (a tensorboard/ that links elsewhere, a
checkpoints/latest.json naming another folder) cannot steer a write, or a read, outside it. Resuming a run
checks its whole folder once (check_no_links); loggers and other writers ask run_path for their paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import xmcbench
from xmcbench.errors import XmcError
from xmcbench.storage import umask_mode

RUN_MARKER = ".xmcbench-run"


@dataclass
class ClaimedRun:
    """target: where the run ends up (--output). directory: where this process writes it, target itself or
    a staging sibling that replaces target in finish(). locks: the open, locked markers."""

    target: Path
    directory: Path
    locks: list = field(default_factory=list, repr=False)

    def finish(self) -> Path:
        """Swap a staged run into place (the replaced run is deleted only then) and release the locks."""
        if self.directory != self.target:
            replace_folder(self.directory, self.target)
            _write_marker(self.target / RUN_MARKER, replaces=None)
            self.directory = self.target
        self.release()
        return self.target

    def release(self) -> None:
        for handle in self.locks:
            handle.close()   # closing the descriptor releases its flock
        self.locks.clear()


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


def run_path(run_dir: Path, *parts: str) -> Path:
    """run_dir / parts, for a file or folder that xmcbench writes (or reads back) inside a run folder: every
    part is a plain name (no `..`, no absolute path) and nothing on the way below run_dir is a symbolic link,
    so the path stays inside the folder; anything else is refused in one XmcError line."""
    path = Path(run_dir)
    for part in parts:
        relative = PurePath(part)
        if relative.is_absolute() or ".." in relative.parts:
            raise XmcError(f"{run_dir}: {part!r} is not a path inside the run folder")
        for name in relative.parts:
            path = path / name
            if path.is_symlink():
                raise _link_error(path)
    return path


def check_no_links(run_dir: Path) -> None:
    """Refuse a run folder that holds a symbolic link anywhere inside it (run_path's rule, for the whole
    folder at once): resuming a run writes its checkpoints, logs and model into it."""
    for root, folders, files in os.walk(run_dir):   # os.walk does not descend into linked folders
        for name in sorted(folders + files):
            if os.path.islink(os.path.join(root, name)):
                raise _link_error(Path(root) / name)


def _link_error(path: Path) -> XmcError:
    return XmcError(f"{path} is a symbolic link (to {os.readlink(path)}): what a run writes stays inside its folder, "
                    "so a run folder may hold no links; replace the link by a copy of what it points to, or start "
                    "a new run")


def claim_output(output: Path, overwrite: bool, is_finished) -> ClaimedRun:
    """Claim `output` for a new run. is_finished(folder) -> bool tells a finished run from an unfinished one.

    Empty or missing: the run is written there. Holding a run (the marker): refused unless overwrite, then
    the new run is staged beside it and replaces it only when finished. Anything else: refused."""
    output = Path(output)
    try:
        if output.exists() and not output.is_dir():
            raise XmcError(f"--output {output} is a file, not a folder; choose another --output")
        output.mkdir(parents=True, exist_ok=True)
        if not any(output.iterdir()):
            lock = _create_locked_marker(output, replaces=None)
            if lock is not None:
                return ClaimedRun(output, output, [lock])
        if not (output / RUN_MARKER).exists():
            raise XmcError(f"{output} is not empty and holds no xmcbench run (no {RUN_MARKER} file); "
                           "choose another --output")
        target_lock = _lock_marker(output)
        if {path.name for path in output.iterdir()} == {RUN_MARKER}:   # claimed, then stopped before writing
            return ClaimedRun(output, output, [target_lock])
        if not overwrite:
            target_lock.close()
            if is_finished(output):
                raise XmcError(f"{output} already holds a finished run; choose another --output or pass --overwrite")
            raise XmcError(f"{output} holds an unfinished run; continue it with `xmcbench run --resume {output}` "
                           "or pass --overwrite")
        staging = staging_folder(output)
        if staging.exists():   # an earlier replacement that never finished: it is ours to discard
            _lock_marker(staging).close()
            shutil.rmtree(staging)
        staging.mkdir()
        return ClaimedRun(output, staging, [target_lock, _create_locked_marker(staging, replaces=output.name)])
    except OSError as error:
        raise XmcError(f"cannot use --output {output}: {error.strerror or error}") from None


def claim_existing(run_dir: Path) -> ClaimedRun:
    """Claim an unfinished run folder to resume it; a staged replacement keeps its target."""
    run_dir = Path(run_dir)
    check_no_links(run_dir)
    marker = run_dir / RUN_MARKER
    if not marker.exists():   # a run started before markers existed (the caller checked its config.json)
        lock = _create_locked_marker(run_dir, replaces=None)
        if lock is not None:
            return ClaimedRun(run_dir, run_dir, [lock])
    try:
        replaces = json.loads(marker.read_text(encoding="utf-8")).get("replaces")
    except (OSError, ValueError, AttributeError):
        raise XmcError(f"{marker} is damaged; this run cannot be resumed, start a new one") from None
    locks = [_lock_marker(run_dir)]
    if replaces is None:
        return ClaimedRun(run_dir, run_dir, locks)
    if not isinstance(replaces, str) or Path(replaces).name != replaces:
        raise XmcError(f"{marker} names {replaces!r} as the run it replaces: not a sibling folder name")
    target = run_dir.with_name(replaces)
    if target.exists():
        locks.insert(0, _lock_marker(target))
    return ClaimedRun(target, run_dir, locks)


def _write_marker(path: Path, replaces: str | None) -> None:
    path.write_text(json.dumps({"xmcbench": xmcbench.__version__, "replaces": replaces}) + "\n", encoding="utf-8")


def _create_locked_marker(folder: Path, replaces: str | None):
    """The marker, locked before it appears (written aside, locked, then linked into place so no other
    process can see it unlocked). None when another process created it first."""
    aside = folder / f"{RUN_MARKER}.{os.getpid()}"
    _write_marker(aside, replaces)
    handle = open(aside, "rb")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        os.link(aside, folder / RUN_MARKER)
    except FileExistsError:
        handle.close()
        return None
    finally:
        aside.unlink()
    return handle


def _lock_marker(folder: Path):
    handle = open(folder / RUN_MARKER, "rb")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise XmcError(f"another xmcbench process is writing {folder}; wait for it to end or choose another "
                       "--output") from None
    return handle


def model_bytes(run_dir: Path) -> int:
    """The size of a run's model: model/weights.safetensors for a component method, every file a whole method's
    save wrote (model/method/) for a whole method; 0 if neither is there."""
    weights = Path(run_dir) / "model" / "weights.safetensors"
    if weights.is_file():
        return weights.stat().st_size
    folder = Path(run_dir) / "model" / "method"
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file()) if folder.is_dir() else 0
