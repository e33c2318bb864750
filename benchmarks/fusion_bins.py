"""Weighted fusion with one weight per member against weights per bin of training documents, on saved runs.

Builds the weighted ensemble of the given runs twice (xmcbench.ensemble.build_ensemble): once with weights per
bin where the validation rows allow (what `xmcbench ensemble --fusion weighted` does), once with one weight per
member (bins disabled by raising MIN_BIN_POSITIVES out of reach), and prints the test metrics of both beside the
members'. Weights are chosen on the members' validation rows in both; the test set only scores.

    python benchmarks/fusion_bins.py OUT RUN_DIR RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from xmcbench import ensemble, fusion

SHOWN = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5")


def build(runs: list[Path], output: Path, per_bin: bool) -> dict:
    reachable = fusion.MIN_BIN_POSITIVES
    if not per_bin:
        fusion.MIN_BIN_POSITIVES = float("inf")
    try:
        directory = ensemble.build_ensemble(runs, output, fusion="weighted", overwrite=True, log=print)
    finally:
        fusion.MIN_BIN_POSITIVES = reachable
    return json.loads((directory / "metrics.json").read_text())


def row(name: str, metrics: dict) -> str:
    bins = {b["bin"]: b["P@5_contribution"] for b in metrics["frequency_bins"]["bins"]}
    tail = " / ".join(f"{bins.get(name, 0.0):.2f}" for name in ("1", "2-3", "4-10", "11-30"))
    return f"| {name} | " + " | ".join(f"{metrics[key]:.2f}" for key in SHOWN) + f" | {tail} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="folder for the two ensembles")
    parser.add_argument("runs", type=Path, nargs="+", help="finished runs sharing one validation split")
    args = parser.parse_args()
    one = build(args.runs, args.output / "one-weight-per-member", per_bin=False)
    bins = build(args.runs, args.output / "weights-per-bin", per_bin=True)
    print("| | " + " | ".join(SHOWN) + " | P@5 from labels of 1 / 2-3 / 4-10 / 11-30 training docs |")
    print("|---" * (len(SHOWN) + 2) + "|")
    for run in args.runs:
        print(row(json.loads((run / "config.json").read_text())["method"], json.loads((run / "metrics.json").read_text())))
    print(row("hybrid, one weight per member", one))
    print(row("hybrid, weights per bin", bins))


if __name__ == "__main__":
    main()
