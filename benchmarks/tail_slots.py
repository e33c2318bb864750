"""Tail slots (xmcbench.fusion.tail_slots): keep a run's first KEEP labels and fill the places after them by score
over propensity, measured on the run's saved test predictions (nothing is trained or predicted again). A fitted
ensemble (`--fusion weighted`) chooses its own alpha on the validation rows, with KEEP = 4; this script measures any
run, a single method included, at fixed KEEP and alpha. A run made with `--set tail_alpha=A` saved its lists with tail
slots already: the alphas here then act on that ranking.

    python benchmarks/tail_slots.py RUN_DIR [RUN_DIR ...] [--keep 3 4] [--alpha 0 0.5 1 2]

Ranking by a label's probability of being relevant maximises expected P@k; ranking by that probability over the
label's propensity (Jain et al. 2016), expected PSP@k. A run's first labels decide P@1 and P@3, which users read
first; its later slots are where a rare label can enter the top 5 without displacing them. So each (keep, alpha)
ranks the run's saved top-K (K = the run's top_k, 10 by default) as follows: the first `keep` labels by the run's own
score, in its order; the slots after them by score x (1 / p_l) ** alpha over the rest of the top-K. alpha 0 is the
run's own ranking and reproduces its metrics.json. Only labels already in the saved top-K can move up, so a label
the run ranked below K stays out.

Scores: a run's scores (LightXML's sigmoid products, tree probabilities, a weighted ensemble's fused normalised
scores) are multiplied by (1 / p_l) ** alpha; an ensemble that ranks with a stacked model (its ensemble.json holds
"stacking"; it ranks by log-odds + alpha_s x log(1 / p_l)) gets alpha x log(1 / p_l) added, the same change in log
space, as `--fusion weighted` does. p_l is the
propensity every score uses (xmcbench.scoring.propensities: the dataset's A and B, counts from every training
document). RUN_DIR may be a run or an ensemble folder.

Each row prints P@1, P@3, P@5, PSP@1, PSP@5 and what the labels with at most 3 training documents contribute to
PSP@5 (the frequency bins of metrics.json, 0 to 3 documents merged).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from xmcbench.formats import open_dataset
from xmcbench.fusion import tail_slots
from xmcbench.metrics import evaluate
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import build_registry
from xmcbench.rundir import reading_of
from xmcbench.scoring import propensities, remap_labels

RARE_MAX_DOCUMENTS = 3


def rare_contribution(metrics: dict) -> float:
    """What labels with at most RARE_MAX_DOCUMENTS training documents contribute to PSP@5 (metrics.json's bins)."""
    bins = metrics["frequency_bins"]
    key = f"PSP@{bins['k']}_contribution"
    return sum(b[key] for b in bins["bins"] if b["max_count"] is not None and b["max_count"] <= RARE_MAX_DOCUMENTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--keep", nargs="+", type=int, default=[3, 4])
    parser.add_argument("--alpha", nargs="+", type=float, default=[0.0, 0.5, 1.0, 2.0])
    args = parser.parse_args()
    registry = build_registry()
    print("| run | keep | alpha | P@1 | P@3 | P@5 | PSP@1 | PSP@5 | labels with <= 3 documents, PSP@5 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        record = json.loads((run / "config.json").read_text())
        dataset = open_dataset(registry, record["dataset"], None, reading_of(record))
        names = json.loads((run / "predictions_labels.json").read_text())
        weights = propensities(dataset, None, names)
        truth = remap_labels(dataset.test_labels, dataset.label_names, names)
        saved = read_predictions(run / "predictions.safetensors", len(names), "rerun the run",
                                 documents=truth.shape[0])
        spec = run / "ensemble.json"
        log_scores = spec.exists() and "stacking" in json.loads(spec.read_text()).get("fusion", {})
        for keep in args.keep:
            for alpha in args.alpha:
                ranked, _ = tail_slots(saved.labels, saved.scores.astype(np.float64), np.log(weights.inverse), keep,
                                       alpha, log_scores)
                m = evaluate(ranked, truth, ks=(1, 3, 5), inv_propensity=weights.inverse,
                             label_counts=weights.label_counts)
                print(f"| {run.name} | {keep} | {alpha:g} | {m['P@1']:.2f} | {m['P@3']:.2f} | {m['P@5']:.2f} | "
                      f"{m['PSP@1']:.2f} | {m['PSP@5']:.2f} | {rare_contribution(m):.2f} |")


if __name__ == "__main__":
    main()
