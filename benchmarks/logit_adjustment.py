"""Post-hoc logit adjustment (Menon et al., ICLR 2021) of a saved flat run, measured on its test set.

A flat run (one logit per label, e.g. `lightxml` below 30,000 labels) scores label l of a document by its logit
z_l; the adjustment ranks by z_l - tau * log p_l instead, p_l = (training documents of l + 1) / (N + 2), the
counts the model saved in model/label_info.json, so rare labels move up by tau times their rarity. The model
predicts the test set once (in file order, where the run batches it by length); every tau re-ranks the same
logits. tau = 0 is the run's own ranking, and its P@k and PSP@k match metrics.json's to a few documents (on the
128-token cut of BENCHMARKS.md section 10: P@1 85.09 against 85.02). A tau below 0 lifts the frequent labels instead.
For the test positives of labels with 1 to 3 training documents it also prints
where the true label ranks under each tau, and under the rows alone: the logit less the logit of the test
documents' mean representation, and the cosine of the row with the representation less that mean (PIFA's rows
start as that cosine); and the logit of that mean document, the prior the model has learned, for rare and frequent
labels. Nothing is trained, and the run is not changed.

With --alpha, the logits are also calibrated on the run's validation rows, as options.calibration=bins does
(xmcbench.calibration: a Platt fit sigmoid(a z + c) per bin of training documents), which gives eta_l, the
probability that label l is relevant. Ranking by eta_l maximises expected P@k; by eta_l / p_l, with p_l the
label's propensity (Jain et al. 2016), expected PSP@k. Each alpha ranks by eta_l * (1 / p_l) ** alpha. On a run
trained with options.calibration=bins the logits are already calibrated, and alpha 0 refits them. --own-fit N
also ranks with every label of at least N validation positives fitted on its own (the others per bin), once per N.

    python benchmarks/logit_adjustment.py RUN_DIR [--tau 0 0.25 0.5 1] [--alpha 0 0.5 1] [--own-fit 50]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from xmcbench.calibration import fit_bin_calibration, fit_platt
from xmcbench.labels import load_label_info
from xmcbench.metrics import evaluate
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import build_registry
from xmcbench.tokenization import tokenize
from xmcbench.formats import open_dataset
from xmcbench.models import load_model
from xmcbench.rundir import reading_of
from xmcbench.scoring import propensities, remap_labels

SHOWN = ("P@1", "P@3", "P@5", "PSP@1", "PSP@5")


def rare_positives(truth, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The test positives of labels with 1 to 3 training documents: (P,) document rows and (P,) label ids.
    truth: (N, L_total) csr in the model's label order; counts: (L,) training documents per label."""
    positives = truth[:, :len(counts)].tocoo()
    keep = (counts[positives.col] >= 1) & (counts[positives.col] <= 3)
    return positives.row[keep], positives.col[keep]


def true_label_ranks(scores: np.ndarray, documents: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N, L) scores, (P,) rows of scores, (P,) label ids -> (P,) the 1-based rank of each label in its row."""
    return (scores[documents] > scores[documents, labels][:, None]).sum(axis=1) + 1


def rank_summary(ranks: np.ndarray, counts: np.ndarray) -> str:
    rare_labels = int(((counts >= 1) & (counts <= 3)).sum())
    return (f"{len(ranks)} test positives of the {rare_labels} labels with 1-3 training documents, rank of the true "
            f"label: median {np.median(ranks):.0f}, top 5 {np.mean(ranks <= 5):.1%}, top 50 {np.mean(ranks <= 50):.1%}")


def logits_of(model, config, texts: list[str], batch: int) -> tuple[np.ndarray, torch.Tensor]:
    """The flat model's (N, L) logits and (N, D) representations of `texts`."""
    tokens = tokenize(texts, model.encoder.tokenizer, model.encoder.tokens_to_read(config.max_length), None,
                      description=None)
    rows = np.arange(len(texts))
    logits, representations = [], []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            input_ids, attention_mask = tokens.batch(rows[start:start + batch])
            representation = model.encoder(input_ids, attention_mask)                           # (B, D)
            representations.append(representation.float())
            logits.append(model.recaller(representation).float().numpy())                       # (B, L)
    return np.concatenate(logits), torch.cat(representations)


def load_flat_run(run_dir: Path):
    """A saved flat run -> (model, config, label names, its dataset as the run read it, label info, config.json)."""
    registry = build_registry()
    model, config, names = load_model(run_dir, registry)
    if not model.is_flat:
        raise SystemExit(f"{run_dir} is not a flat run: its recaller scores clusters, not labels")
    recorded = json.loads((run_dir / "config.json").read_text())
    dataset = open_dataset(registry, recorded["dataset"], None, reading_of(recorded))
    return model, config, names, dataset, load_label_info(run_dir / "model", names, "re-run training"), recorded


def print_row(name: str, scores: np.ndarray, truth, weights) -> None:
    """One table row: the metrics of ranking (N, L) scores, and PSP@5 from three groups of rare labels."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    metrics = evaluate(top, truth, ks=(1, 3, 5), inv_propensity=weights.inverse, label_counts=weights.label_counts)
    bins = {entry["bin"]: entry["PSP@5_contribution"] for entry in metrics["frequency_bins"]["bins"]}
    tail = sum(bins.get(key, 0.0) for key in ("0", "1", "2-3"))
    print(f"| {name} | " + " | ".join(f"{metrics[key]:.2f}" for key in SHOWN)
          + f" | {(metrics['P@1'] + metrics['PSP@5']) / 2:.2f} | {tail:.2f} / {bins.get('4-10', 0.0):.2f} / "
          f"{bins.get('11-30', 0.0):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tau", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0])
    parser.add_argument("--alpha", type=float, nargs="*", default=[],
                        help="also rank the logits calibrated on the validation rows by eta * (1 / propensity) ** alpha")
    parser.add_argument("--own-fit", type=int, nargs="*", default=[],
                        help="with --alpha, also fit each label of at least N validation positives on its own")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if args.own_fit and not args.alpha:
        parser.error("--own-fit refits the calibration that --alpha ranks by; add --alpha 0 (or other alphas)")
    torch.set_num_threads(args.threads)

    model, config, names, dataset, info, recorded = load_flat_run(args.run_dir)
    documents = recorded["resolved"]["train_docs"]
    log_prior = np.log((info.counts + 1.0) / (documents + 2.0))                        # (L,)
    # every test label, those unseen in training in extra columns, so PSP@k is normalised as metrics.json's
    weights = propensities(dataset, config, names)
    truth = remap_labels(dataset.test_labels, dataset.label_names, names).tocsr()

    model.eval()
    logits, representation = logits_of(model, config, dataset.test_texts, args.batch)          # (N, L), (N, D)
    rare_documents, rare_labels = rare_positives(truth, info.counts)
    print(f"{args.run_dir}: {len(logits)} test documents, {len(names)} labels, {documents} training documents")
    print("| ranking | " + " | ".join(SHOWN) + " | (P@1 + PSP@5) / 2 | PSP@5 from labels of ≤ 3 / 4-10 / 11-30 "
          "training docs |")
    print("|---" * (len(SHOWN) + 3) + "|")
    ranks = {}   # the rank of the true label, per test positive of a 1-3-document label
    for tau in args.tau:
        adjusted = logits - tau * log_prior
        print_row(f"tau {tau:g}", adjusted, truth, weights)
        ranks[f"tau {tau:g}"] = true_label_ranks(adjusted, rare_documents, rare_labels)
    if args.alpha:
        validation = read_predictions(args.run_dir / "validation_predictions.safetensors", len(names),
                                      "rerun the run with a validation split",
                                      training_rows=dataset.train_labels.shape[0]).rows
        validation_logits, _ = logits_of(model, config, [dataset.train_texts[row] for row in validation], args.batch)
        validation_truth = remap_labels(dataset.train_labels[validation], dataset.label_names, names)
        scales, offsets, lines = fit_bin_calibration(torch.from_numpy(validation_logits),
                                                     validation_truth[:, :len(names)], info.counts)
        fits = {"": (scales, offsets)}
        validation_positives = np.asarray(validation_truth[:, :len(names)].sum(axis=0)).ravel()   # (L,)
        for least in args.own_fit:
            own_scales, own_offsets = scales.clone(), offsets.clone()
            for label in np.flatnonzero(validation_positives >= least):
                own_scales[label], own_offsets[label] = fit_platt(torch.from_numpy(validation_logits[:, [label]]),
                                                                  validation_truth[:, [label]])
            fits[f", labels of >= {least} validation positives fitted alone "
                 f"({int((validation_positives >= least).sum())})"] = own_scales, own_offsets
        log_inverse_propensity = np.log(weights.inverse[:len(names)])                          # (L,)
        for fit, (fit_scales, fit_offsets) in fits.items():
            log_eta = -np.logaddexp(0.0, -(logits * fit_scales.numpy() + fit_offsets.numpy()))   # (N, L)
            for alpha in args.alpha:
                ranked = log_eta + alpha * log_inverse_propensity
                print_row(f"calibrated, alpha {alpha:g}{fit}", ranked, truth, weights)
                ranks[f"calibrated, alpha {alpha:g}{fit}"] = true_label_ranks(ranked, rare_documents, rare_labels)
        print(f"calibration on {len(validation)} validation rows, per group of bins: " + "; ".join(lines))
    for name, found in ranks.items():
        print(f"{name}: " + rank_summary(found, info.counts))
    # where the rows alone put these labels: each logit less the logit of the mean test document, and the cosine
    # of the row with the document less that mean (PIFA's rows start as that cosine)
    mean = representation.mean(dim=0, keepdim=True)                                            # (1, D)
    with torch.no_grad():
        at_mean = model.recaller(mean).float()                                                 # (1, L)
        centred_term = (torch.cat([model.recaller(part) for part in representation.split(args.batch)]).float()
                        - at_mean).numpy()                                                     # (N, L)
    weight = model.recaller.rows().detach().float()                                          # (L, D)
    cosine = (nn.functional.normalize(representation - mean, dim=1)
              @ nn.functional.normalize(weight, dim=1).T).numpy()                              # (N, L)
    for name, scores in (("logit less the mean document's", centred_term), ("the rows' cosine", cosine)):
        print(f"{name}: " + rank_summary(true_label_ranks(scores, rare_documents, rare_labels), info.counts))
    rare, frequent = (info.counts >= 1) & (info.counts <= 3), info.counts > 1000
    print(f"logit of the mean test document, median: {np.median(at_mean[0].numpy()[rare]):.2f} for labels with 1-3 "
          f"training documents, {np.median(at_mean[0].numpy()[frequent]):.2f} for those with more than 1,000")


if __name__ == "__main__":
    main()
