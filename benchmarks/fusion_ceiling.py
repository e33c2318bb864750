"""How far could the weighted fusion of these runs get on the test set? An upper bound, chosen on the test set.

`xmcbench ensemble --fusion weighted` chooses its weights on the validation rows, never on test. This script asks
what the same family of fusions can reach at best: it keeps the ensemble's normalisation (each member's validation
quantiles, from ENSEMBLE's ensemble.json) and searches the weights on the *test* documents themselves, by the fusion's
own objective (xmcbench.fusion.objective: the smallest lead over any member alone in P@1 or PSP@5), over
  - one weight per member: fusion.choose_weights over fusion.weight_grid;
  - weights per bin of training documents (fusion.WEIGHT_BINS, or --weight-bins): fusion.choose_bin_weights, its
    coordinate ascent from the best single weight, each bin on its own (no MIN_BIN_POSITIVES grouping: the test set
    is what is searched);
  - with --free-scale, the same with each bin's weights scaled by one of SCALES as well, so a bin's labels may be
    raised or lowered against the other bins'.
The figures are the test set's and were chosen on it: they bound what a choice on validation rows can reach with that
fusion, they are not a result. A ceiling at or below 0 says no weights of that family beat every member on this test
set.

    python benchmarks/fusion_ceiling.py ENSEMBLE [--weight-bins 3,30] [--free-scale]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from xmcbench import ensemble, fusion
from xmcbench.formats import open_dataset
from xmcbench.metrics import evaluate
from xmcbench.registry import build_registry
from xmcbench.rundir import reading_of
from xmcbench.scoring import propensities, remap_labels

SCALES = (0.5, 0.75, 1.0, 1.5, 2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ensemble", type=Path,
                        help="a weighted or stacked ensemble, as `xmcbench ensemble --fusion weighted` builds it")
    parser.add_argument("--weight-bins", default=",".join(map(str, fusion.WEIGHT_BINS)),
                        help="bin boundaries in training documents, comma-separated")
    parser.add_argument("--free-scale", action="store_true", help="also scale each bin's weights (SCALES)")
    args = parser.parse_args()
    if not (args.ensemble / "ensemble.json").is_file():
        raise SystemExit(f"{args.ensemble} is not an ensemble folder; build one with `xmcbench ensemble RUN RUN "
                         "--fusion weighted`")
    built = ensemble.read_ensemble(args.ensemble)
    if built.fusion.rule not in fusion.FITTED_RULES:
        raise SystemExit(f"{args.ensemble} was built with --fusion {built.fusion.rule}; its members have no validation "
                         "quantiles to normalise with: build it with --fusion weighted (or stacked)")
    members = built.members
    recorded = members[0].config
    dataset = open_dataset(build_registry(), recorded["dataset"], None, reading_of(recorded))
    saved = ensemble._saved_predictions(members, dataset, built.top_k)
    if saved is None:
        raise SystemExit(f"the members of {args.ensemble} keep no saved test predictions of this dataset version")
    names = ensemble.vocabulary(members)
    truth = remap_labels(dataset.test_labels, dataset.label_names, names)
    inv_propensity = propensities(dataset, ensemble.scoring_config(members), names).inverse
    top_lists = [labels[:, :built.top_k] for labels in saved[0]]
    normalised = [fusion.normalise(scores[:, :built.top_k], q) for scores, q in zip(saved[1], built.fusion.quantiles)]
    sizes = built.sizes
    alone = fusion.members_alone(top_lists, truth, inv_propensity)
    bounds = tuple(int(count) for count in args.weight_bins.split(","))
    counts = ensemble.training_counts(members, len(names))
    if counts is None:
        raise SystemExit("a member's model keeps no label_info.json, so the labels' training documents are not known")
    label_bins = np.searchsorted(np.asarray(bounds), counts, side="left")                   # (L,)
    num_bins = len(bounds) + 1

    # the fusion's own searches, with the test documents in the place of the validation rows
    single_point, single_metrics, _ = fusion.choose_weights(top_lists, normalised, truth, inv_propensity, built.top_k,
                                                            sizes)
    scales = SCALES if args.free_scale else (1.0,)
    points = [tuple(scale * w for w in point) for scale in scales for point in fusion.weight_grid(len(members))]
    table, best_metrics, _ = fusion.choose_bin_weights(top_lists, normalised, truth, inv_propensity, built.top_k,
                                                       sizes, label_bins, single_point,
                                                       [[column] for column in range(num_bins)], num_bins, points)
    single_value, best = single_metrics["objective"], best_metrics["objective"]
    print(f"{args.ensemble}: members " + ", ".join(f"{member.method} {found['P@1']:.2f} / {found['PSP@5']:.2f}"
                                                 for member, found in zip(members, alone)) + " (test P@1 / PSP@5)")
    as_built = evaluate(fusion.fuse(saved[0], saved[1], built.top_k, built.fusion, sizes)[0], truth, ks=(1, 5),
                        inv_propensity=inv_propensity)
    print("the ensemble as built (chosen on validation): smallest lead on test "
          f"{fusion.objective(as_built, alone):+.2f}")
    print(f"ceiling, one weight per member {tuple(single_point)}: smallest lead {single_value:+.2f} "
          f"(P@1 {single_metrics['P@1']:.2f}, PSP@5 {single_metrics['PSP@5']:.2f})")
    shown = "; ".join(f"bin {column}: " + ", ".join(f"{w:g}" for w in table[:, column]) for column in range(num_bins))
    scaled = ", free scale" if args.free_scale else ""
    print(f"ceiling, weights per bin (boundaries {args.weight_bins}{scaled}) {shown}: smallest lead {best:+.2f} "
          f"(P@1 {best_metrics['P@1']:.2f}, PSP@5 {best_metrics['PSP@5']:.2f})")


if __name__ == "__main__":
    main()
