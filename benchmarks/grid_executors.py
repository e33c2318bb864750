"""One grid of tiny cells through two executors: their wall times, and whether every cell's metrics and weights
are the same.

    python benchmarks/grid_executors.py                          # --executor ray against the serial loop
    python benchmarks/grid_executors.py --executors local slurm  # any executors; slurm as local submitit jobs

Builds a tiny transformer (`xmcbench.testing.make_tiny_transformer`) and a tiny dataset
(`xmcbench.testing.write_tiny_dataset`, --train documents) in a temporary folder, then runs for each executor,
one after the other, in a fresh process and with a fresh cache (so none reuses another's tokenized texts or
clusters):

    xmcbench compare lightxml lightxml-random-neg --seeds 0 1 --cell-cpus 1 --executor NAME --set epochs=E ...

and prints the wall time of each command (process start, Ray's start, every cell, the report) and, per cell,
whether metrics.json and model/weights.safetensors are byte for byte those of the first executor's run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xmcbench.testing import make_tiny_transformer, write_tiny_dataset

TINY = ("pretrained_weights=false", "num_layers=2", "hidden_size=8", "max_length=32", "cluster_size=2",
        "top_clusters=2")
EXTRA_OPTIONS = {"slurm": ["--time-limit", "30", "--executor-option", "cluster=local"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", nargs="+", default=["local", "ray"])
    parser.add_argument("--train", type=int, default=400, help="training documents of the tiny dataset")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="xmcbench-grid-") as scratch:
        scratch = Path(scratch)
        model_dir = make_tiny_transformer(scratch / "model")
        dataset = write_tiny_dataset(scratch / "data", train=args.train, test=args.train // 4)
        outputs, seconds = {}, {}
        for executor in args.executors:
            output = scratch / f"grid-{executor}"
            command = ["xmcbench", "compare", "lightxml", "lightxml-random-neg", "--dataset", str(dataset),
                       "--output", str(output), "--seeds", "0", "--seeds", "1", "--cell-cpus", "1",
                       "--executor", executor, *EXTRA_OPTIONS.get(executor, [])]
            for setting in (f"model_name={model_dir}", f"epochs={args.epochs}", *TINY):
                command += ["--set", setting]
            environment = {**os.environ, "XMCBENCH_CACHE": str(scratch / f"cache-{executor}")}
            started = time.perf_counter()
            finished = subprocess.run([sys.executable, "-m", "xmcbench", *command[1:]], env=environment,
                                      capture_output=True, text=True)
            seconds[executor] = time.perf_counter() - started
            if finished.returncode != 0:
                sys.exit(f"{executor}: exit status {finished.returncode}\n{finished.stderr[-3000:]}")
            outputs[executor] = output
            print(f"{executor}: {seconds[executor]:.1f} s wall  ({' '.join(command)})", flush=True)

        first, *others = args.executors
        cells = sorted(path.name for path in (outputs[first] / "runs").iterdir())
        for other in others:
            same = [all((outputs[first] / "runs" / cell / name).read_bytes()
                        == (outputs[other] / "runs" / cell / name).read_bytes()
                        for name in ("metrics.json", "model/weights.safetensors")) for cell in cells]
            print(f"{other} against {first}: {sum(same)} of {len(cells)} cells with identical metrics.json and "
                  f"weights; wall time ratio {seconds[other] / seconds[first]:.2f}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
