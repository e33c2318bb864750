"""Zero-shot figures over the labels a run held out of training, from its saved test predictions.

A run's metrics.json has `zero_shot` figures over every test label no training document of the run carried: on a
cut of a dataset (max_train_docs) that is mostly labels the cut left out, not the ones `--set zero_shot_labels=S`
held out. This prints the same figures (xmcbench.metrics.evaluate's zero_shot: P@k and R@k, every label competing
with every other) over the held-out labels alone, as config.json's resolved.zero_shot_labels lists them. An
ensemble is scored over its first member's held-out labels (the members share one seed and split). Nothing is
trained or predicted again.

    python benchmarks/held_out_recall.py RUN_OR_ENSEMBLE [...] [--except LABEL ...]

`--except LABEL` scores the held-out labels other than LABEL: one held-out label that most test documents carry
(a seed's draw may take debian-builddeps' debhelper-compat, on 76 % of them) otherwise outweighs all the others.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.formats import open_dataset
from xmcbench.metrics import evaluate
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import build_registry
from xmcbench.rundir import reading_of
from xmcbench.scoring import remap_labels

KS = (1, 3, 5, 10)


def trained_run(path: Path) -> Path:
    """The run whose config.json says what was held out: the path itself, or an ensemble's first member."""
    if (path / "ensemble.json").is_file():
        first = json.loads((path / "ensemble.json").read_text())["members"][0]
        return (path / first).resolve()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--except", dest="excepted", nargs="+", default=[], metavar="LABEL",
                        help="held-out labels to leave out of the figures")
    args = parser.parse_args()
    registry = build_registry()
    for path in args.runs:
        recorded = json.loads((trained_run(path) / "config.json").read_text())
        held_out = recorded["resolved"].get("zero_shot_labels") or []
        if not held_out:
            raise SystemExit(f"{path} held no label out of training: train it with --set zero_shot_labels=S")
        dataset = open_dataset(registry, recorded["dataset"], None, reading_of(recorded))
        label_names = json.loads((path / "predictions_labels.json").read_text())   # (L_run,) the ids' names
        saved = read_predictions(path / "predictions.safetensors", len(label_names), "rerun it",
                                 documents=dataset.test_labels.shape[0])
        truth = remap_labels(dataset.test_labels, dataset.label_names, label_names)   # (N, L_total)
        not_held = sorted(set(args.excepted) - set(held_out))
        if not_held:
            raise SystemExit(f"--except {' '.join(not_held)}: not among the labels {path} held out; name held-out "
                             f"labels (config.json's resolved.zero_shot_labels)")
        chosen = set(held_out) - set(args.excepted)
        held = sp.csr_matrix(np.array([[name in chosen for name in dataset.label_names]], dtype=np.float32))
        mask = remap_labels(held, dataset.label_names, label_names).toarray()[0] > 0  # (L_total,) truth's columns
        figures = evaluate(saved.labels, truth, ks=[k for k in KS if k <= saved.labels.shape[1]],
                           zero_shot=mask)["zero_shot"]
        excepted = f" ({len(set(held_out) - chosen)} of them left out here)" if args.excepted else ""
        print(f"{path}: {len(held_out)} labels held out{excepted}, {figures['positives']} test positives on "
              f"{figures['documents']} documents; "
              + ", ".join(f"R@{k} {figures[f'R@{k}']:.2f}" for k in KS if f"R@{k}" in figures)
              + "; " + ", ".join(f"P@{k} {figures[f'P@{k}']:.2f}" for k in KS if f"P@{k}" in figures))


if __name__ == "__main__":
    main()
