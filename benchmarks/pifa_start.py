"""What LightXML's PIFA start scores before any training step, and how its bias and scale move the tail.

A flat LightXML run (`options.head_init=auto`) starts row l of its recaller at the mean of l's training documents'
representations under the pretrained encoder, scaled so that a cosine of 1 adds options.pifa_scale logits (5 by
default), and its bias at the log-odds of l's prior. This script builds that start exactly as a run does (the run's
plan, training rows and `start_epoch`), scores the test set with it, and re-ranks the same logits under other biases
and scales, without training:

    logit_l(h) = scale * cosine-term_l(h) + (1 - tau) * log-odds_l

scale = 1, tau = 0 is the start itself. The cosine term is the row's score of the centred representation (the start's
logit less the log-odds). For the test positives of labels with at most 3 training documents it also prints where
the true label ranks: under the start and under the cosine term alone (the bias left out).

    python benchmarks/pifa_start.py --dataset FOLDER [--seed 0] [--threads 2] [--tau 0 0.5 1] [--scale 1 2]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch

from xmcbench.device import pick_device, set_threads
from xmcbench.formats import open_dataset
from xmcbench.indexing import label_clusters
from xmcbench.labels import label_info
from xmcbench.metrics import evaluate
from xmcbench.modelio import build_model
from xmcbench.registry import build_registry
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import split_train_rows, training_view
from xmcbench.scoring import propensities, remap_labels
from xmcbench.tokenization import tokenize
from xmcbench.training import Trainer

from logit_adjustment import SHOWN, rank_summary, rare_positives, true_label_ranks
TAIL_BINS = ("0", "1", "2-3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tau", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--scale", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    parser.add_argument("--set", dest="set_options", action="append", default=[])
    args = parser.parse_args()

    registry = build_registry()
    plan = plan_run(registry, "lightxml", args.dataset,
                    set_options=args.set_options + [f"threads={args.threads}", f"seed={args.seed}"])
    config = plan.config
    set_threads(config)
    device = pick_device(config)
    whole = open_dataset(registry, plan.dataset)
    dataset, _ = training_view(whole, config, registry.method("lightxml"), log=lambda line: None)
    rows, _ = split_train_rows(dataset, config)
    clusters = label_clusters(dataset, config, rows, registry)
    if not clusters.is_flat:
        raise SystemExit(f"{args.dataset}: the rule clusters its labels; PIFA rows start flat runs only")
    torch.manual_seed(config.seed)
    info = label_info(dataset, config, rows)
    model = build_model(registry, config, clusters, label_info=info).to(device)
    document_length = model.encoder.tokens_to_read(config.max_length)
    tokens = tokenize([dataset.train_texts[i] for i in rows], model.encoder.tokenizer, document_length, None,
                      description="tokenizing the training documents")
    train_labels = dataset.train_labels[rows].tocsr()
    trainer = Trainer(model, tokens, train_labels, config, device, label_info=info)
    trainer.announce("start_epoch", trainer.stage, 0)   # the PIFA start, as a run's first epoch begins

    names = list(info.names)
    counts = np.asarray(info.counts, dtype=np.float64)
    prior = (counts + 1.0) / (len(rows) + 2.0)
    log_odds = np.log(prior / (1.0 - prior))                                              # (L,)
    test_tokens = tokenize(whole.test_texts, model.encoder.tokenizer, document_length, None,
                           description="tokenizing the test documents")
    model.eval()
    logits = []
    with torch.no_grad():
        for start in range(0, len(whole.test_texts), config.eval_batch_size):
            batch = np.arange(start, min(start + config.eval_batch_size, len(whole.test_texts)))
            ids, mask = (t.to(device) for t in test_tokens.batch(batch))
            logits.append(model.recaller(model.encoder(ids, mask)).float().cpu().numpy())
    logits = np.concatenate(logits)                                                       # (N_test, L)
    cosine_term = logits - log_odds                                                       # (N_test, L)

    weights = propensities(whole, config, names)
    truth = remap_labels(whole.test_labels, whole.label_names, names).tocsr()
    print(f"{args.dataset}: {len(rows)} training documents, {len(names)} labels, {len(whole.test_texts)} test "
          f"documents; encoder {config.model_name}, max length {config.max_length}, seed {config.seed}")
    print("| scale | tau | " + " | ".join(SHOWN) + " | PSP@5 from labels of ≤ 3 / 4-10 / 11-30 training docs |")
    print("|---" * (len(SHOWN) + 3) + "|")
    for scale, tau in itertools.product(args.scale, args.tau):
        scores = scale * cosine_term + (1.0 - tau) * log_odds
        top = np.argsort(-scores, axis=1, kind="stable")[:, :10]
        metrics = evaluate(top, truth, ks=(1, 3, 5), inv_propensity=weights.inverse, label_counts=weights.label_counts)
        bins = {entry["bin"]: entry["PSP@5_contribution"] for entry in metrics["frequency_bins"]["bins"]}
        tail = sum(bins.get(name, 0.0) for name in TAIL_BINS)
        print(f"| {scale:g} | {tau:g} | " + " | ".join(f"{metrics[key]:.2f}" for key in SHOWN)
              + f" | {tail:.2f} / {bins.get('4-10', 0.0):.2f} / {bins.get('11-30', 0.0):.2f} |")

    rare_documents, rare_labels = rare_positives(truth, counts)
    for what, scores in (("the start", logits), ("the cosine term alone", cosine_term)):
        print(f"{what}: " + rank_summary(true_label_ranks(scores, rare_documents, rare_labels), counts))


if __name__ == "__main__":
    main()
