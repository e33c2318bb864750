"""CPU seconds the `xmcbench` command spends before it answers: `--help`, `--version`, `plugins`, `datasets`.

Each command runs in a fresh process (`python -m xmcbench ...`) --rounds times, its CPU time (user + system, from
the children's resource usage) measured; the median is printed. CPU time, not wall time, so other work on the
machine moves it little. --source DIR imports another checkout's xmcbench package instead of the installed one (the
plugins stay the installed ones), to compare two versions in one run:

    python benchmarks/cli_start.py
    git worktree add /tmp/before HEAD~1 && python benchmarks/cli_start.py --source /tmp/before
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

COMMANDS = (["--help"], ["--version"], ["plugins"], ["datasets"])


# The child imports xmcbench from SOURCE: an editable install's import hook would otherwise win over sys.path.
FROM_SOURCE = """import sys
sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in type(finder).__module__.lower()]
sys.path.insert(0, {source!r})
sys.argv = ["xmcbench", *{args!r}]
from xmcbench.cli import main
main()
"""


def command_line(args: list[str], source: str | None) -> list[str]:
    if source is None:
        return [sys.executable, "-m", "xmcbench", *args]
    return [sys.executable, "-c", FROM_SOURCE.format(source=source, args=args)]


def cpu_seconds(args: list[str], source: str | None) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command_line(args, source), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--source", help="a checkout whose xmcbench package is imported instead of the installed one")
    args = parser.parse_args()
    source = os.path.abspath(args.source) if args.source else None
    for command in COMMANDS:
        if subprocess.run(command_line(command, source), capture_output=True).returncode != 0:
            print(f"xmcbench {' '.join(command):<10} (this version does not have it)")
            continue
        seconds = [cpu_seconds(command, source) for _ in range(args.rounds)]
        print(f"xmcbench {' '.join(command):<10} {statistics.median(seconds):.2f} s CPU (median of {args.rounds})")


if __name__ == "__main__":
    main()
