"""Progress: a rich bar on a terminal; elsewhere (a log file, CI, a batch scheduler) a plain line at a steady
interval, as the Hugging Face and Lightning trainers print, and one summary line per finished task.

The interval is XMCBENCH_PROGRESS_SECONDS (default 30 seconds; 0 prints a line at every update).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from xmcbench.errors import XmcError

DEFAULT_INTERVAL_SECONDS = 30.0
TERMINAL_STATUS_SECONDS = 1.0   # the fields beside a terminal bar are evaluated at most this often


def _status(fields: dict) -> str:
    """Fields as `key value`; a callable value is called now (it may be costly: a training loss read from a
    GPU), and left out when it returns None."""
    values = {key: value() if callable(value) else value for key, value in fields.items()}
    return "  ".join(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
                     for key, value in values.items() if value is not None)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def log_interval() -> float:
    value = os.environ.get("XMCBENCH_PROGRESS_SECONDS", "")
    if not value:
        return DEFAULT_INTERVAL_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise XmcError(f"XMCBENCH_PROGRESS_SECONDS={value!r} must be a number of seconds >= 0 (e.g. 60)")
    return seconds


@contextlib.contextmanager
def progress_bar(description: str, total: int, unit: str = "", completed: int = 0):
    """Yields advance(n, **fields); fields such as loss=... are shown beside the bar (a callable field is
    called only when shown).

    total, completed: units of work in all and already done before this session (a resumed epoch); the rate
    and ETA count only this session's work. unit names what is counted ("documents"): lines then show the
    rate in units/s."""
    if sys.stderr.isatty():
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[status]}")]
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task(description, total=total, completed=completed, status="")
            shown = {"at": -float("inf")}

            def advance(n: int = 1, **fields) -> None:
                now = time.perf_counter()
                if fields and now - shown["at"] >= TERMINAL_STATUS_SECONDS:   # rich redraws a few times a second
                    shown["at"] = now
                    progress.update(task, advance=n, status=_status(fields))
                else:
                    progress.update(task, advance=n)

            yield advance
        return

    interval = log_interval()
    state = {"done": completed, "fields": {}}
    started = last_line = time.perf_counter()
    noun = f" {unit}" if unit else ""

    def line(final: bool) -> str:
        elapsed = time.perf_counter() - started
        rate = (state["done"] - completed) / elapsed if elapsed > 0 else 0.0
        where = f" in {elapsed:.1f} s" if final else f" ({100 * state['done'] / max(total, 1):.0f}%)"
        parts = [f"{description}: {state['done']}/{total}{noun}{where}"]
        if not final:
            parts.append(f"elapsed {duration(elapsed)}")
            if rate > 0:
                parts.append(f"ETA {duration((total - state['done']) / rate)}")
        if unit and rate > 0:
            parts.append(f"{rate:.1f} {unit}/s")
        return "  ".join(parts + [_status(state["fields"])]).rstrip()

    def advance(n: int = 1, **fields) -> None:
        nonlocal last_line
        state["done"] += n
        state["fields"] = fields or state["fields"]
        now = time.perf_counter()
        if now - last_line >= interval and state["done"] < total:
            last_line = now
            print(line(final=False), file=sys.stderr, flush=True)

    yield advance
    print(line(final=True), file=sys.stderr, flush=True)
