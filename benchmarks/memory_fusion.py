"""What a memory of the training documents adds to a saved flat run's ranking, per bin of label frequency.

A flat LightXML head ranks label l of a document x by its logit z_l(x). Its rare labels lose to the frequent ones
through the prior the head learns (BENCHMARKS.md section 10), though the trained encoder still puts a rare label's
documents near each other. This script keeps the trained weights and adds, per group b of frequency bins, beta_b
times a memory score m_l(x) to the logit:

    score_l(x) = z_l(x) + beta_b(l) * m_l(x)

with u(x) the unit-length representation less the training documents' mean, and m one of
- `centroids`: the cosine of u(x) with the mean of u over l's training documents (PECOS's PIFA, with the
  trained encoder);
- `knn`: sum over x's K nearest training documents j (by u) of cos(u(x), u(j)) if j carries l, divided by K.

beta is chosen on the run's validation rows (their rows are the run's own split), never on test: coordinate ascent
over the groups of bins, each group taking the value of BETAS that maximises (P@1 + PSP@5) / 2 (OBJECTIVE; the
flat run is the only member, so the weighted fusion's smallest lead over each member does not apply). Groups are
adjacent frequency bins holding at least fusion.MIN_BIN_POSITIVES validation positives (fusion.weight_bin_groups),
as the calibration and the weighted fusion group them. It prints the test metrics of
the logits alone (metrics.json's ranking), and of each memory with its chosen betas, and PSP@5 from the tail bins.

With --most-documents N only labels with at most N training documents take a memory score (beta 0 for the rest),
so the head's ranking of its frequent labels stays its own. --cache FILE keeps the three sets of representations
(and the logits) in FILE, read instead of encoding again when it exists.

    python benchmarks/memory_fusion.py RUN_DIR [--memory centroids knn] [--neighbours 10] [--most-documents N]
        [--cache FILE] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from xmcbench.fusion import weight_bin_groups
from xmcbench.metrics import FREQUENCY_BINS, evaluate, frequency_bin_of
from xmcbench.runs.splits import split_train_rows
from xmcbench.scoring import propensities, remap_labels

from logit_adjustment import load_flat_run, logits_of, print_row, rank_summary, rare_positives, true_label_ranks

BETAS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
SEARCH_PASSES = 2
OBJECTIVE = "(P@1 + PSP@5) / 2"


def mean_objective(metrics: dict) -> float:
    return (metrics["P@1"] + metrics["PSP@5"]) / 2


def unit_centred(representation: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(N, D) representations -> (N, D) unit-length representations less the training mean (D,)."""
    return nn.functional.normalize(representation - mean, dim=1)


def centroid_scores(queries: torch.Tensor, memory: torch.Tensor, memory_labels: sp.csr_matrix) -> np.ndarray:
    """(N, D) and (M, D) unit representations, (M, L) 0/1 labels of the memory -> (N, L) cosine with each
    label's mean unit representation (0 for a label with no memory document)."""
    sums = torch.from_numpy(np.asarray(memory_labels.T.astype(np.float32) @ memory.numpy()))       # (L, D)
    return (queries @ nn.functional.normalize(sums, dim=1).T).numpy()


def knn_scores(queries: torch.Tensor, memory: torch.Tensor, memory_labels: sp.csr_matrix, neighbours: int,
               chunk: int = 1024) -> np.ndarray:
    """(N, D) and (M, D) unit representations, (M, L) labels -> (N, L): sum over the K nearest memory documents
    of their cosine, for each label they carry, divided by K."""
    rows, columns, values = [], [], []
    for start in range(0, len(queries), chunk):
        similarity = queries[start:start + chunk] @ memory.T                                     # (C, M)
        found, nearest = similarity.topk(neighbours, dim=1)                                      # (C, K)
        rows.append(np.repeat(np.arange(start, start + len(found)), neighbours))
        columns.append(nearest.reshape(-1).numpy())
        values.append(found.reshape(-1).numpy() / neighbours)
    votes = sp.csr_matrix((np.concatenate(values), (np.concatenate(rows), np.concatenate(columns))),
                          shape=(len(queries), memory.shape[0]))
    return np.asarray((votes @ memory_labels).todense(), dtype=np.float32)


def fused_metrics(logits: np.ndarray, memory: np.ndarray, beta_per_label: np.ndarray, truth, weights) -> dict:
    scores = logits + beta_per_label[None, :] * memory
    top = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    return evaluate(top, truth, ks=(1, 5), inv_propensity=weights.inverse)


def choose_betas(logits: np.ndarray, memory: np.ndarray, truth, weights, counts: np.ndarray,
                 most_documents: int | None) -> tuple[np.ndarray, list[str]]:
    """Validation (V, L) logits and memory scores, (V, L) truth -> ((L,) beta of each label, one line per group).
    most_documents: only groups whose labels all have at most this many training documents are searched."""
    bins = frequency_bin_of(counts)
    positives_per_label = np.asarray(truth[:, :len(counts)].sum(axis=0)).ravel()
    positives = [int(positives_per_label[bins == index].sum()) for index in range(len(FREQUENCY_BINS))]
    grouped = [group for group in weight_bin_groups(positives)
               if most_documents is None or (FREQUENCY_BINS[group[-1]][1] or np.inf) <= most_documents]
    groups = [np.flatnonzero(np.isin(bins, group)) for group in grouped]
    chosen = np.zeros(len(groups))

    def value(betas) -> float:
        per_label = np.zeros(len(counts))
        for group, beta in zip(groups, betas):
            per_label[group] = beta
        return mean_objective(fused_metrics(logits, memory, per_label, truth, weights))

    best = alone = value(chosen)
    for _ in range(SEARCH_PASSES):
        changed = False
        for index in range(len(groups)):
            for beta in BETAS:
                trial = chosen.copy()
                trial[index] = beta
                found = value(trial)
                if found > best + 1e-9:
                    chosen, best, changed = trial, found, True
        if not changed:
            break
    per_label = np.zeros(len(counts))
    lines = []
    for group, beta, names in zip(groups, chosen, grouped):
        per_label[group] = beta
        low, high = FREQUENCY_BINS[names[0]][0], FREQUENCY_BINS[names[-1]][1]
        lines.append(f"{low}-{high if high is not None else 'more'} training documents: beta {beta:g}")
    return per_label, lines + [f"validation {OBJECTIVE} {best:.2f} (the logits alone: {alone:.2f})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--memory", nargs="+", choices=("centroids", "knn"), default=["centroids", "knn"])
    parser.add_argument("--neighbours", type=int, default=10)
    parser.add_argument("--most-documents", type=int, default=None)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, config, names, dataset, info, _ = load_flat_run(args.run_dir)
    train_rows, validation_rows = split_train_rows(dataset, config)
    if not len(validation_rows):
        raise SystemExit(f"{args.run_dir} has no validation rows to choose beta on; use a run with validation_size > 0")
    weights = propensities(dataset, config, names)
    test_truth = remap_labels(dataset.test_labels, dataset.label_names, names).tocsr()
    validation_truth = remap_labels(dataset.train_labels[validation_rows], dataset.label_names, names).tocsr()
    train_labels = remap_labels(dataset.train_labels[train_rows], dataset.label_names, names)[:, :len(names)].tocsr()

    if args.cache is not None and args.cache.exists():
        cached = torch.load(args.cache)
        train_representation, validation_representation, test_representation = (
            cached["train"], cached["validation"], cached["test"])
        validation_logits, test_logits = cached["validation_logits"].numpy(), cached["test_logits"].numpy()
    else:
        model.eval()
        began = time.perf_counter()
        _, train_representation = logits_of(model, config, [dataset.train_texts[row] for row in train_rows],
                                            args.batch)
        validation_logits, validation_representation = logits_of(
            model, config, [dataset.train_texts[row] for row in validation_rows], args.batch)
        test_logits, test_representation = logits_of(model, config, dataset.test_texts, args.batch)
        print(f"{args.run_dir}: encoded {len(train_rows)} training, {len(validation_rows)} validation and "
              f"{len(test_logits)} test documents in {time.perf_counter() - began:.0f} s")
        if args.cache is not None:
            torch.save({"train": train_representation, "validation": validation_representation,
                        "test": test_representation, "validation_logits": torch.from_numpy(validation_logits),
                        "test_logits": torch.from_numpy(test_logits)}, args.cache)
    mean = train_representation.mean(dim=0)
    memory = unit_centred(train_representation, mean)
    validation_units = unit_centred(validation_representation, mean)
    test_units = unit_centred(test_representation, mean)

    print("| ranking | P@1 | P@3 | P@5 | PSP@1 | PSP@5 | (P@1 + PSP@5) / 2 | PSP@5 from labels of ≤ 3 / 4-10 / 11-30 "
          "training docs |")
    print("|---" * 9 + "|")
    print_row("logits", test_logits, test_truth, weights)
    rare_documents, rare_labels = rare_positives(test_truth, info.counts)
    notes = ["logits: " + rank_summary(true_label_ranks(test_logits, rare_documents, rare_labels), info.counts)]
    for kind in args.memory:
        if kind == "centroids":
            validation_memory = centroid_scores(validation_units, memory, train_labels)
            test_memory = centroid_scores(test_units, memory, train_labels)
            name = "centroids"
        else:
            validation_memory = knn_scores(validation_units, memory, train_labels, args.neighbours)
            test_memory = knn_scores(test_units, memory, train_labels, args.neighbours)
            name = f"knn, K = {args.neighbours}"
        betas, lines = choose_betas(validation_logits, validation_memory, validation_truth, weights, info.counts,
                                    args.most_documents)
        fused = test_logits + betas[None, :] * test_memory
        print_row(f"logits + beta x {name}", fused, test_truth, weights)
        print_row(f"{name} alone", test_memory, test_truth, weights)
        notes.append(f"{name}: " + "; ".join(lines))
        notes.append(f"{name} fused: " + rank_summary(true_label_ranks(fused, rare_documents, rare_labels),
                                                      info.counts))
        notes.append(f"{name} alone: " + rank_summary(true_label_ranks(test_memory, rare_documents, rare_labels),
                                                      info.counts))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
