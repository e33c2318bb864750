"""Progress bars (rich) on a terminal; elsewhere (logs, CI) one summary line per finished task."""

from __future__ import annotations

import contextlib
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _status(fields: dict) -> str:
    return "  ".join(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
                     for key, value in fields.items())


@contextlib.contextmanager
def progress_bar(description: str, total: int):
    """Yields advance(n, **fields); fields such as loss=... are shown beside the bar."""
    if not sys.stderr.isatty():
        state = {"done": 0, "fields": {}}
        started = time.perf_counter()

        def advance(n: int = 1, **fields) -> None:
            state["done"] += n
            state["fields"] = fields or state["fields"]

        yield advance
        print(f"{description}: {state['done']}/{total} in {time.perf_counter() - started:.1f} s  "
              f"{_status(state['fields'])}".rstrip(), file=sys.stderr)
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(description, total=total, status="")

        def advance(n: int = 1, **fields) -> None:
            progress.update(task, advance=n, **({"status": _status(fields)} if fields else {}))

        yield advance
