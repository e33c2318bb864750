"""Where each run's P@1 comes from: the test documents whose first label falls in each bin of training frequency,
and how many of those first labels are right, from the runs' saved test predictions (nothing is predicted again).

    python benchmarks/rank1_bins.py RUN_DIR [RUN_DIR ...] [--against OTHER_RUN_DIR] [--either LABEL LABEL]
        [--split-tokens N]

A run whose P@1 is below another's shows here whether it puts the wrong labels first (a bin where its first labels
are right less often) or moves its first labels to another bin (more documents in a bin than the other run).
--against pairs each run with another run on the same test set and label order: on the documents only one of the two
gets right at rank 1, which labels each puts first, and where the run ranks the other's right first label.
--either A B takes two labels that nearly exclude each other (debian-builddeps's debhelper-compat and debhelper): on
the test documents that carry exactly one of them, how often each run ranks the right one above the other.
--split-tokens N: each run's P@1 on the test documents that fit in N tokens and on those longer, counted by the
tokenizer of the first run that saved one (special tokens included, no truncation): whether a run that reads N tokens
loses its P@1 on the text it does not read.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
from scipy.sparse import csr_matrix

from xmcbench.formats import open_dataset
from xmcbench.labels import load_label_info
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import build_registry
from xmcbench.rundir import reading_of
from xmcbench.scoring import remap_labels

BINS = ((0, 3), (4, 30), (31, 1000), (1001, None))   # training documents of the first label


class SavedRun(NamedTuple):
    names: list[str]           # the run's label order
    counts: np.ndarray         # (L,) training documents per label
    predicted: np.ndarray      # (N, k) test predictions, label ids, -1 past the labels a document got
    right: np.ndarray          # (N,) whether each first label is right
    truth: csr_matrix          # (N, L) test labels in the run's label order
    texts: list[str]           # (N,) test texts


def read_run(registry, run: Path) -> SavedRun:
    """A run's label names, training counts, saved test predictions and test labels."""
    record = json.loads((run / "config.json").read_text())
    dataset = open_dataset(registry, record["dataset"], None, reading_of(record))
    names = json.loads((run / "model" / "labels.json").read_text())
    names = names if isinstance(names, list) else names["names"]
    info = load_label_info(run / "model", names, "rerun the run")
    if info is None:
        raise SystemExit(f"{run}: its model folder keeps no label_info.json (an older xmcbench saved it); rerun it")
    truth = remap_labels(dataset.test_labels, dataset.label_names, names).tocsr()[:, :len(names)]
    predicted = read_predictions(run / "predictions.safetensors", len(names), "rerun the run",
                                 documents=truth.shape[0]).labels
    first = predicted[:, 0]
    right = (np.asarray(truth[np.arange(len(first)), np.maximum(first, 0)]).ravel() > 0) & (first >= 0)
    return SavedRun(names, np.asarray(info.counts), predicted, right, truth, list(dataset.test_texts or []))


def print_either(run: Path, saved: SavedRun, pair: list[str]) -> None:
    """On the test documents with exactly one of the two labels: how often the run ranks it above the other."""
    missing = [label for label in pair if label not in saved.names]
    if missing:
        raise SystemExit(f"--either: {run} has no label {missing[0]}; name two labels of its training set")
    columns = [saved.names.index(label) for label in pair]
    carried = saved.truth[:, columns].toarray() > 0                                        # (N, 2)
    documents = np.flatnonzero(carried.sum(axis=1) == 1)
    if not len(documents):
        raise SystemExit(f"--either: no test document of {run} carries exactly one of {pair[0]} and {pair[1]}; name "
                         "two labels that nearly exclude each other")
    k = saved.predicted.shape[1]
    ranks = []   # per label of the pair, (M,) its 0-based place in each document's predictions, k where absent
    for column in columns:
        found = saved.predicted[documents] == column                                       # (M, k)
        ranks.append(np.where(found.any(axis=1), found.argmax(axis=1), k))
    higher = (ranks[1] < ranks[0]).astype(int)                                             # (M,) 0 or 1
    neither = (ranks[0] == k) & (ranks[1] == k)
    right = (carried[documents, higher] & ~neither).sum()
    print(f"{run.name}: of the {len(documents)} test documents with exactly one of {pair[0]} and {pair[1]}, the one "
          f"ranked higher is right on {right} ({100 * right / len(documents):.1f} %); neither is in the top {k} on "
          f"{int(neither.sum())}")


def print_split(read: dict[Path, SavedRun], length: int) -> None:
    """Each run's P@1 on the test documents of at most `length` tokens and on the longer ones."""
    from transformers import AutoTokenizer

    folders = [run / "model" / "encoder" for run in read if (run / "model" / "encoder" / "tokenizer.json").is_file()]
    if not folders:
        raise SystemExit("--split-tokens: none of the runs saved a tokenizer (model/encoder); name a transformer run")
    texts = next(iter(read.values())).texts
    if not texts:
        raise SystemExit("--split-tokens: the runs' dataset has no test texts to count tokens in")
    tokenizer = AutoTokenizer.from_pretrained(folders[0])
    lengths = np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=True, truncation=False,
                                                      verbose=False)["input_ids"]])           # (N,)
    longer = lengths > length
    past = np.maximum(lengths - length, 0).sum() / lengths.sum()
    print(f"test documents of at most {length} tokens: {int((~longer).sum())}; longer: {int(longer.sum())} "
          f"({100 * longer.mean():.1f} %), which put {100 * past:.1f} % of the test texts' tokens past the "
          f"{length}th (tokenizer of {folders[0].parent.parent.name})")
    print(f"| run | P@1 | P@1 of the documents of at most {length} tokens | P@1 of the longer ones |")
    for run, saved in read.items():
        print(f"| {run.name} | {100 * saved.right.mean():.2f} | {100 * saved.right[~longer].mean():.2f} | "
              f"{100 * saved.right[longer].mean():.2f} |")


def bin_name(count: int) -> str:
    low, high = next((low, high) for low, high in BINS if count >= low and (high is None or count <= high))
    return f"{low}-{high if high else 'more'}"


def print_pairing(run: Path, other: Path, mine, theirs) -> None:
    """On the documents only one of two runs gets right at rank 1: which bins and labels each puts first."""
    names, counts, predicted, right = mine[:4]
    other_names, _, other_predicted, other_right = theirs[:4]
    if other_names != names:
        raise SystemExit(f"{run} and {other} order their labels differently; pair runs of one dataset and cut")
    order = [bin_name(low) for low, _ in BINS]
    only_other, only_run = np.flatnonzero(other_right & ~right), np.flatnonzero(right & ~other_right)
    for winner, documents in ((other, only_other), (run, only_run)):
        print(f"{len(documents)} documents only {winner.name} gets right at rank 1:")
        for who, firsts in ((run.name, predicted[documents, 0]), (other.name, other_predicted[documents, 0])):
            bins = Counter(bin_name(counts[label]) for label in firsts)
            labels = Counter(names[label] for label in firsts).most_common(4)
            print(f"  {who} puts first labels of " + ", ".join(f"{name}: {bins[name]}" for name in order if bins[name])
                  + " training documents; most often " + ", ".join(f"{label} {n}" for label, n in labels))
        if winner == other:
            found = [np.flatnonzero(predicted[d] == other_predicted[d, 0]) for d in documents]
            ranks = Counter(int(where[0]) + 1 if len(where) else None for where in found)
            print(f"  {run.name} ranks {other.name}'s right first label: "
                  + ", ".join(f"{'beyond its top ' + str(predicted.shape[1]) if rank is None else 'at ' + str(rank)} "
                              f"{n}" for rank, n in sorted(ranks.items(), key=lambda item: item[0] or 10 ** 9)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--against", type=Path, default=None, help="pair each run with this one at rank 1")
    parser.add_argument("--either", nargs=2, metavar="LABEL", default=None,
                        help="two labels that nearly exclude each other: how often each run ranks the right one higher")
    parser.add_argument("--split-tokens", type=int, default=None, metavar="N",
                        help="each run's P@1 on the test documents of at most N tokens and on the longer ones")
    args = parser.parse_args()
    registry = build_registry()
    header = " | ".join(f"{low}-{high if high else 'more'}: first / right" for low, high in BINS)
    print(f"| run | P@1 | {header} |")
    read = {run: read_run(registry, run) for run in args.runs}
    for run, (_, counts, predicted, right, *_) in read.items():
        first = predicted[:, 0]
        first_counts = counts[np.maximum(first, 0)]
        cells = []
        for low, high in BINS:
            inside = (first >= 0) & (first_counts >= low) & ((first_counts <= high) if high else True)
            cells.append(f"{int(inside.sum())} / {int(right[inside].sum())}")
        print(f"| {run.name} | {100 * right.mean():.2f} | " + " | ".join(cells) + " |")
    if args.against is not None:
        theirs = read_run(registry, args.against)
        for run, mine in read.items():
            print()
            print_pairing(run, args.against, mine, theirs)
    if args.either is not None:
        print()
        for run, mine in read.items():
            print_either(run, mine, args.either)
    if args.split_tokens is not None:
        print()
        print_split(read, args.split_tokens)


if __name__ == "__main__":
    main()
