"""How much closer a run's validation rows are to its training rows than its test documents are.

Everything a run chooses on its validation rows (the epoch early stopping keeps, options.calibration's fits, the
weighted fusion's weights) assumes they stand to the training rows as the test set does. The validation rows are
a seeded random draw from the training file, while a dataset's test set may keep related documents together: the
Debian datasets put a source package's binaries (libfoo1, libfoo-dev), which share their long description, all in
train or all in test. A random validation row then often has a near-copy among the rows the model was fitted on,
and a method that memorises text looks better on validation than on test.

For each validation row and test document this prints the share whose TF-IDF cosine to its nearest fitted training
row (xmcbench.features.tfidf_features: sublinear tf, unigrams, vocabulary of all three sets, no labels read) is at
least each threshold. With --members, it also rebuilds the weighted fusion of those runs (the first is RUN) with the
validation rows that have a near-copy (cosine >= --leave-out) left out of the weights' fit, and prints the
ensemble's test metrics beside the members'; the runs are not changed, the rebuilt ensemble goes to --output.
With --grouped-at, it draws for each cosine C the split validation_split=grouped would draw if near-copies were
pairs at cosine >= C (xmcbench.runs.splits.grouped_validation; the option itself uses 0.9) from RUN's seed,
validation_size and max_train_docs, and prints the same shares for it: which C makes validation rows stand to
their training rows as the test documents do. Nothing is trained.

    python benchmarks/validation_leakage.py RUN [--members RUN RUN ...] [--leave-out 0.9] [--output DIR]
    python benchmarks/validation_leakage.py RUN --grouped-at 0.9 0.7 0.5
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from safetensors.numpy import load_file, save_file

from xmcbench.ensemble import build_ensemble
from xmcbench.features import tfidf_features
from xmcbench.formats import open_dataset
from xmcbench.registry import build_registry
from xmcbench.rundir import VALIDATION_PREDICTIONS_FILE, reading_of
from xmcbench.runs.splits import grouped_validation, near_copy_groups, training_pool

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95)
CHUNK = 1000


def nearest_fitted_cosine(features, queries: np.ndarray, fitted: np.ndarray) -> np.ndarray:
    """(Q,) the largest cosine of each query row of `features` (rows L2-normalised) with any fitted row."""
    reference = features[fitted].T.tocsc()
    return np.concatenate([(features[queries[start:start + CHUNK]] @ reference).max(axis=1).toarray().ravel()
                           for start in range(0, len(queries), CHUNK)])


def fusion_without(members: list[Path], keep: np.ndarray, output: Path) -> dict:
    """The weighted fusion of `members`, its weights fitted on the validation rows where `keep` (V,) is true:
    each member is copied as links, its validation predictions cut to those rows."""
    with tempfile.TemporaryDirectory() as scratch:
        copies = []
        for index, member in enumerate(members):
            copy = Path(scratch) / f"{index}-{member.name}"
            copy.mkdir()
            for path in member.iterdir():
                if path.name != VALIDATION_PREDICTIONS_FILE:
                    (copy / path.name).symlink_to(path.resolve())
            saved = load_file(str(member / VALIDATION_PREDICTIONS_FILE))
            save_file({name: np.ascontiguousarray(array[keep]) for name, array in saved.items()},
                      str(copy / VALIDATION_PREDICTIONS_FILE))
            copies.append(copy)
        build_ensemble(copies, output, fusion="weighted", overwrite=True)
    return json.loads((output / "metrics.json").read_text())


def summary(metrics: dict) -> str:
    bins = {entry["bin"]: entry["PSP@5_contribution"] for entry in metrics["frequency_bins"]["bins"]}
    tail = sum(bins.get(name, 0.0) for name in ("0", "1", "2-3"))
    return (f"P@1 {metrics['P@1']:.2f}  P@5 {metrics['P@5']:.2f}  PSP@5 {metrics['PSP@5']:.2f}  "
            f"PSP@5 from labels of <= 3 training documents {tail:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--members", type=Path, nargs="*", default=[],
                        help="other runs to fuse with RUN, on the same validation rows")
    parser.add_argument("--leave-out", type=float, default=0.9,
                        help="with --members: leave out validation rows with a fitted row at this cosine or more")
    parser.add_argument("--output", type=Path, default=Path("ENSEMBLES/without-near-copies"))
    parser.add_argument("--grouped-at", type=float, nargs="*", default=[],
                        help="cosines C: print the shares for the grouped split drawn with near-copies at C or more")
    args = parser.parse_args()

    for run in (args.run_dir, *args.members):
        if not (run / VALIDATION_PREDICTIONS_FILE).is_file():
            raise SystemExit(f"{run} has no {VALIDATION_PREDICTIONS_FILE}: pass finished runs trained with a "
                             "validation split (--set validation_size=N)")
    recorded = json.loads((args.run_dir / "config.json").read_text())
    dataset = open_dataset(build_registry(), recorded["dataset"], None, reading_of(recorded))
    settings = recorded["config"]
    validation = load_file(str(args.run_dir / VALIDATION_PREDICTIONS_FILE))["rows"]               # (V,)
    pool = training_pool(dataset, SimpleNamespace(seed=settings["seed"], max_train_docs=settings["max_train_docs"]))
    fitted = np.sort(np.setdiff1d(pool, validation))                                              # (N - V,)
    train_count = len(dataset.train_texts)
    features = tfidf_features(list(dataset.train_texts) + list(dataset.test_texts))              # (N + T, F)
    validation_cosine = nearest_fitted_cosine(features, validation, fitted)                       # (V,)
    test_cosine = nearest_fitted_cosine(features, train_count + np.arange(len(dataset.test_texts)), fitted)
    print(f"{args.run_dir}: {len(fitted)} fitted training rows, {len(validation)} validation rows, "
          f"{len(test_cosine)} test documents")
    print("| TF-IDF cosine to the nearest fitted training row | validation rows | test documents |")
    print("|---|---|---|")
    for threshold in THRESHOLDS:
        print(f"| >= {threshold:g} | {np.mean(validation_cosine >= threshold):.1%} | "
              f"{np.mean(test_cosine >= threshold):.1%} |")
    test_rows = train_count + np.arange(len(dataset.test_texts))
    for cosine in args.grouped_at:
        grouped = np.sort(grouped_validation(dataset, pool, len(validation), cosine))
        grouped_fitted = np.sort(np.setdiff1d(pool, grouped))
        shares = [nearest_fitted_cosine(features, rows, grouped_fitted) for rows in (grouped, test_rows)]
        group_sizes = np.bincount(near_copy_groups(dataset, pool, cosine))
        print(f"grouped at cosine {cosine:g} ({len(grouped)} validation rows; {len(group_sizes)} groups of the "
              f"{len(pool)} training rows, the largest {group_sizes.max()}), share at "
              + ", ".join(f">= {threshold:g}: {np.mean(shares[0] >= threshold):.1%} / {np.mean(shares[1] >= threshold):.1%}"
                          for threshold in THRESHOLDS) + " (validation rows / test documents)")
    if args.members:
        members = [args.run_dir, *args.members]
        keep = validation_cosine < args.leave_out
        for member in members:
            print(f"{member}: " + summary(json.loads((member / "metrics.json").read_text())))
        metrics = fusion_without(members, keep, args.output)
        print(f"weighted fusion fitted on the {int(keep.sum())} validation rows without a near-copy "
              f"(cosine < {args.leave_out:g}), {args.output}: " + summary(metrics))


if __name__ == "__main__":
    main()
