"""Is one run's lead over others on one test set larger than the test set's own noise? A paired bootstrap.

For a run or ensemble folder and the folders it is compared with (all scored on one dataset's test split), this
reads each folder's saved test predictions (predictions.safetensors with its predictions_labels.json), scores every
test document once, and draws --resamples seeded resamples of the test documents, the same draws for every folder,
so each lead is paired document by document. For P@1 and PSP@5 it prints the lead over each other folder on the
whole test set (which reproduces the folders' metrics.json) and its 95 % percentile interval; the last line gives the
share of resamples in which the first folder leads every other one in both at once, the bar a hybrid is held to.

PSP@5 is a ratio of sums over the documents (pyxclib's form, as xmcbench.metrics computes it), so each resample
sums its numerator and its denominator. The propensities are those of every score (xmcbench.scoring.propensities,
from the first folder's config.json).

    python benchmarks/paired_bootstrap.py FOLDER OTHER [OTHER ...] [--resamples 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from xmcbench.config import TrainConfig
from xmcbench.errors import XmcError
from xmcbench.formats import open_dataset
from xmcbench.metrics import _ideal_sums, relevant
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import build_registry
from xmcbench.rundir import reading_of
from xmcbench.scoring import propensities, remap_labels
from xmcbench.storage import read_json

METRICS = ("P@1", "PSP@5")
K = 5
BLOCK = 200   # resamples drawn at once


def per_document(folder: Path, names: list[str], inv_propensity: np.ndarray, truth) -> dict:
    """(N,) per test document of `folder`: its hit at rank 1, and the inverse propensities of its hits in the top 5
    (PSP@5's numerator), its saved label ids mapped into `names`."""
    own_names = read_json(folder / "predictions_labels.json", "the label names of the saved predictions")
    saved = read_predictions(folder / "predictions.safetensors", len(own_names), "run the folder again",
                             documents=truth.shape[0])
    position = {name: index for index, name in enumerate(names)}
    mapping = np.array([position.get(name, -1) for name in own_names] + [-1], dtype=np.int64)
    predicted = mapping[np.where(saved.labels[:, :K] >= 0, saved.labels[:, :K], len(own_names))]   # (N, 5)
    hits = relevant(predicted, truth)
    gains = np.where(hits, inv_propensity[np.maximum(predicted, 0)], 0.0)
    return {"P@1": hits[:, 0].astype(np.float64), "PSP@5": gains.sum(axis=1)}


def figure(values: np.ndarray, ideal: np.ndarray, metric: str) -> np.ndarray:
    """Sums over documents (the last axis) -> the metric in points."""
    if metric == "P@1":
        return 100.0 * values.mean(axis=-1)
    return 100.0 * values.sum(axis=-1) / ideal.sum(axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the run or ensemble whose lead is measured")
    parser.add_argument("others", type=Path, nargs="+", help="the runs or ensembles it is compared with")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folders = [args.folder, *args.others]
    for folder in folders:
        if not (folder / "predictions.safetensors").is_file() or not (folder / "predictions_labels.json").is_file():
            raise SystemExit(f"{folder} holds no saved test predictions (predictions.safetensors and "
                             "predictions_labels.json); pass finished run or ensemble folders")
    recorded = read_json(args.folder / "config.json", "the first folder's configuration")
    try:
        dataset = open_dataset(build_registry(), recorded["dataset"], None, reading_of(recorded))
        settings = TrainConfig.from_dict(recorded.get("config", {}))
    except XmcError as exc:
        raise SystemExit(str(exc)) from None
    names = list(dataset.label_names)
    truth = remap_labels(dataset.test_labels, dataset.label_names, names)
    weights = propensities(dataset, settings, names).inverse
    ideal = _ideal_sums(truth, weights, [K])[0][:, 0]                                   # (N,)
    scored = [per_document(folder, names, weights, truth) for folder in folders]
    for folder, values in zip(folders, scored):
        saved = read_json(folder / "metrics.json", "the folder's test metrics")
        for metric in METRICS:
            found = figure(values[metric], ideal, metric)
            if abs(found - saved[metric]) > 0.005:
                raise SystemExit(f"{folder}: {metric} from its saved predictions is {found:.2f}, its metrics.json says "
                                 f"{saved[metric]:.2f} (filtered pairs, other propensities or another dataset); this "
                                 "script cannot pair it")
    rng = np.random.default_rng(args.seed)
    resampled = {(index, metric): [] for index in range(len(args.others)) for metric in METRICS}
    for start in range(0, args.resamples, BLOCK):   # a block of resamples at a time: bounded memory on large sets
        draws = rng.integers(0, truth.shape[0], size=(min(BLOCK, args.resamples - start), truth.shape[0]))
        for (index, metric), found in resampled.items():
            mine, theirs = scored[0][metric], scored[index + 1][metric]
            found.append(figure(mine[draws], ideal[draws], metric) - figure(theirs[draws], ideal[draws], metric))
    leads_both = np.ones(args.resamples, dtype=bool)
    print(f"{args.folder} against each other folder, {truth.shape[0]} test documents, {args.resamples} paired "
          f"resamples (seed {args.seed})")
    print("| against | metric | first | other | lead | 95 % interval of the lead | resamples led |")
    print("|---|---|---|---|---|---|---|")
    for index, other_folder in enumerate(args.others):
        for metric in METRICS:
            mine, theirs = figure(scored[0][metric], ideal, metric), figure(scored[index + 1][metric], ideal, metric)
            leads = np.concatenate(resampled[(index, metric)])
            low, high = np.percentile(leads, [2.5, 97.5])
            leads_both &= leads > 0
            print(f"| {other_folder} | {metric} | {mine:.2f} | {theirs:.2f} | {mine - theirs:+.2f} | "
                  f"{low:+.2f} to {high:+.2f} | {np.mean(leads > 0):.1%} |")
    print(f"{args.folder} leads every other folder in both {' and '.join(METRICS)} in {leads_both.mean():.1%} of the "
          "resamples")


if __name__ == "__main__":
    main()
