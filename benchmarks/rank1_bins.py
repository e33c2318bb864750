"""Where each run's P@1 comes from: the test documents whose first label falls in each bin of training frequency,
and how many of those first labels are right, from the runs' saved test predictions (nothing is predicted again).

    python benchmarks/rank1_bins.py RUN_DIR [RUN_DIR ...]

A run whose P@1 is below another's shows here whether it puts the wrong labels first (a bin where its first labels
are right less often) or moves its first labels to another bin (more documents in a bin than the other run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from xmcbench.formats import open_dataset
from xmcbench.labels import load_label_info
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import build_registry
from xmcbench.rundir import reading_of
from xmcbench.scoring import remap_labels

BINS = ((0, 3), (4, 30), (31, 1000), (1001, None))   # training documents of the first label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    registry = build_registry()
    header = " | ".join(f"{low}-{high if high else 'more'}: first / right" for low, high in BINS)
    print(f"| run | P@1 | {header} |")
    for run in args.runs:
        record = json.loads((run / "config.json").read_text())
        dataset = open_dataset(registry, record["dataset"], None, reading_of(record))
        names = json.loads((run / "model" / "labels.json").read_text())
        names = names if isinstance(names, list) else names["names"]
        info = load_label_info(run / "model", names, "rerun the run")
        if info is None:
            raise SystemExit(f"{run}: its model folder keeps no label_info.json (an older xmcbench saved it); rerun it")
        truth = remap_labels(dataset.test_labels, dataset.label_names, names).tocsr()[:, :len(names)]
        first = read_predictions(run / "predictions.safetensors", len(names), "rerun the run",
                                 documents=truth.shape[0]).labels[:, 0]
        right = np.asarray(truth[np.arange(len(first)), np.maximum(first, 0)]).ravel() > 0
        right &= first >= 0
        counts = np.asarray(info.counts)[np.maximum(first, 0)]
        cells = []
        for low, high in BINS:
            inside = (first >= 0) & (counts >= low) & ((counts <= high) if high else True)
            cells.append(f"{int(inside.sum())} / {int(right[inside].sum())}")
        print(f"| {run.name} | {100 * right.mean():.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
