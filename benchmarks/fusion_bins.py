"""Weighted fusion with one weight per member, with weights per bin of training documents, and stacked fusion, on
saved runs.

Builds the ensemble of the given runs (xmcbench.ensemble.build_ensemble) three ways: weighted with one weight per
member (bins disabled by raising MIN_BIN_POSITIVES out of reach), weighted with weights per bin where the validation
rows allow (what `xmcbench ensemble --fusion weighted` does), and stacked (`--fusion stacked`); it prints the test
metrics of each beside the members'. Everything is chosen on the members' validation rows; the test set only
scores.
--weight-bins builds the per-bin ensemble once for each set of bin boundaries given (fusion.WEIGHT_BINS: "3,30"
puts labels of at most 3, 4-30 and more training documents in three bins), instead of once with the default.

    python benchmarks/fusion_bins.py OUT RUN_DIR RUN_DIR [RUN_DIR ...] [--weight-bins 3,30 3,100 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from xmcbench import ensemble, fusion

SHOWN = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5")


def build(runs: list[Path], output: Path, per_bin: bool, bins: tuple[int, ...] = fusion.WEIGHT_BINS,
          rule: str = "weighted") -> dict:
    """The ensemble's test metrics under `rule`, with weights per bin of `bins` boundaries or one weight per
    member."""
    reachable, boundaries, names = fusion.MIN_BIN_POSITIVES, fusion.WEIGHT_BINS, fusion.WEIGHT_BIN_NAMES
    if not per_bin:
        fusion.MIN_BIN_POSITIVES = float("inf")
    bin_names = (f"0-{bins[0]}", *(f"{low + 1}-{high}" for low, high in zip(bins, bins[1:])), f">{bins[-1]}")
    for module in (fusion, ensemble):   # ensemble imported the names themselves
        module.WEIGHT_BINS, module.WEIGHT_BIN_NAMES = bins, bin_names
    try:
        directory = ensemble.build_ensemble(runs, output, fusion=rule, overwrite=True, log=print)
    finally:
        fusion.MIN_BIN_POSITIVES = reachable
        for module in (fusion, ensemble):
            module.WEIGHT_BINS, module.WEIGHT_BIN_NAMES = boundaries, names
    return json.loads((directory / "metrics.json").read_text())


def row(name: str, metrics: dict) -> str:
    bins = {b["bin"]: b["P@5_contribution"] for b in metrics["frequency_bins"]["bins"]}
    tail = " / ".join(f"{bins.get(name, 0.0):.2f}" for name in ("1", "2-3", "4-10", "11-30"))
    return f"| {name} | " + " | ".join(f"{metrics[key]:.2f}" for key in SHOWN) + f" | {tail} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="folder for the ensembles")
    parser.add_argument("runs", type=Path, nargs="+", help="finished runs sharing one validation split")
    parser.add_argument("--weight-bins", nargs="+", default=[",".join(map(str, fusion.WEIGHT_BINS))],
                        help="sets of bin boundaries, each as comma-separated training-document counts")
    args = parser.parse_args()
    one = build(args.runs, args.output / "one-weight-per-member", per_bin=False)
    per_bin = {boundaries: build(args.runs, args.output / f"weights-per-bin-{boundaries.replace(',', '-')}",
                                 per_bin=True, bins=tuple(int(count) for count in boundaries.split(",")))
               for boundaries in args.weight_bins}
    stacked = build(args.runs, args.output / "stacked", per_bin=True, rule="stacked")
    print("| | " + " | ".join(SHOWN) + " | P@5 from labels of 1 / 2-3 / 4-10 / 11-30 training docs |")
    print("|---" * (len(SHOWN) + 2) + "|")
    for run in args.runs:
        print(row(json.loads((run / "config.json").read_text())["method"], json.loads((run / "metrics.json").read_text())))
    print(row("hybrid, one weight per member", one))
    for boundaries, metrics in per_bin.items():
        print(row(f"hybrid, weights per bin (boundaries {boundaries})", metrics))
    print(row("hybrid, stacked (`--fusion stacked`)", stacked))


if __name__ == "__main__":
    main()
