"""Progress bars (rich), silent when output is not a terminal so logs and CI stay readable."""

from __future__ import annotations

import contextlib
import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextlib.contextmanager
def progress_bar(description: str, total: int):
    """Yields advance(n, **fields); fields such as loss=... are shown beside the bar."""
    if not sys.stderr.isatty():
        yield lambda n=1, **fields: None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(description, total=total, status="")

        def advance(n: int = 1, **fields) -> None:
            status = "  ".join(f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
                               for key, value in fields.items())
            progress.update(task, advance=n, **({"status": status} if fields else {}))

        yield advance
