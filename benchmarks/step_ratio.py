"""Training and prediction speed of one configuration, measured against the encoder alone in one run.

Prints training documents/second, prediction ms/document, and two ratios:
  full training step / encoder forward+backward   (everything beyond the transformer: recaller, sampler,
                                                   ranker, losses, optimizer)
  full prediction / encoder forward               (recall, candidate expansion, ranking, top-k)
Both sides run on the same batches, interleaved, so machine noise hits them alike.

A method whose ranker reads the labels' texts through the method's own encoder (a dual encoder's label tower:
the ranker holds the encoder and the tokenized texts as `encoder` and `text_tokens`) does encoder work on
both towers: its baseline is the encoder's forward+backward on the batch's documents and on the texts of the
candidates its sampler draws for that batch, as many as the full step encodes. Its sampler first mines hard
negatives as at an epoch where mining is on (the core's start_epoch, with the document and label embeddings of
the whole training set, at epoch 0: set its schedule to mine there, e.g. --set options.mine_from_epoch=0), so the
candidates are those of a mining epoch.

    python benchmarks/step_ratio.py --dataset debian-debtags-mini --threads 2
    python benchmarks/step_ratio.py --dataset debian-builddeps --set cluster_size=16 --threads 2
    python benchmarks/step_ratio.py --method dual --dataset debian-debtags-mini --set options.mine_from_epoch=0 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from xmcbench.batching import epoch_batches, padded_positives
from xmcbench.device import pick_device, set_threads
from xmcbench.optim import build_optimizers
from xmcbench.registry import build_registry
from xmcbench.interfaces import overrides
from xmcbench.labels import label_info
from xmcbench.tokenization import tokenize
from xmcbench.training import Trainer
from xmcbench.formats import open_dataset
from xmcbench.indexing import label_clusters
from xmcbench.modelio import build_model
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import training_view


def timed(function, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="lightxml")
    parser.add_argument("--dataset", default="debian-debtags-mini")
    parser.add_argument("--set", dest="set_options", action="append", default=[])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per side")
    args = parser.parse_args()

    registry = build_registry()
    plan = plan_run(registry, args.method, args.dataset, set_options=args.set_options + [f"threads={args.threads}"])
    config = plan.config
    threads = set_threads(config)
    device = pick_device(config)
    dataset = open_dataset(registry, plan.dataset)
    dataset, _ = training_view(dataset, config, registry.method(args.method), log=lambda line: None)
    rows = np.arange(len(dataset.train_texts))
    clusters = label_clusters(dataset, config, rows, registry)
    torch.manual_seed(config.seed)
    labels = label_info(dataset, config, rows)
    model = build_model(registry, config, clusters, label_info=labels).to(device).train()
    tokens = tokenize(dataset.train_texts, model.encoder.tokenizer, model.encoder.tokens_to_read(config.max_length),
                      f"{dataset.version}/train")
    optimizers = build_optimizers(model, config)
    batches = epoch_batches(tokens.lengths, config.batch_size, np.random.default_rng(0),
                            config.length_bucketing)[: args.batches + 2]
    label_tower = model.ranker is not None and getattr(model.ranker, "encoder", None) is model.encoder \
        and hasattr(model.ranker, "text_tokens")
    if label_tower and overrides(model.sampler, "start_epoch"):   # the candidates of an epoch that mines
        label_tokens = tokenize(list(labels.texts or labels.names), model.encoder.tokenizer, config.max_length, None,
                                description="tokenizing label texts")
        trainer = Trainer(model, tokens, dataset.train_labels, config, device, label_info=labels,
                          label_tokens=lambda: label_tokens)
        trainer.announce("start_epoch", trainer.stage, 0)   # give the sampler a schedule that mines at epoch 0
    candidate_texts = {}   # batch -> the label ids whose texts the full step encodes
    if label_tower:
        for batch in batches:
            positives = padded_positives(dataset.train_labels, batch).to(device)
            drawn = model.sampler(None, positives, clusters.to(device), torch.from_numpy(batch).to(device))
            candidate_texts[id(batch)] = torch.unique(drawn.labels[drawn.mask])

    def full_step(batch):
        ids, mask = (t.to(device) for t in tokens.batch(batch))
        loss, _ = model.training_loss(ids, mask, padded_positives(dataset.train_labels, batch).to(device),
                                      torch.from_numpy(batch).to(device))
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    def encoder_step(batch):
        ids, mask = (t.to(device) for t in tokens.batch(batch))
        model.zero_grad(set_to_none=True)
        work = model.encoder(ids, mask).sum()
        if label_tower:   # the label tower's share: the candidates' texts through the same encoder
            texts = candidate_texts[id(batch)]
            text_ids, text_mask = (t.to(device) for t in model.ranker.text_tokens.batch(texts.cpu().numpy()))
            work = work + model.encoder(text_ids, text_mask).sum()
        work.backward()

    @torch.no_grad()
    def full_predict(batch):
        ids, mask = (t.to(device) for t in tokens.batch(batch))
        model.predict_top(ids, mask, config.top_clusters, config.top_k)

    @torch.no_grad()
    def encoder_predict(batch):
        ids, mask = (t.to(device) for t in tokens.batch(batch))
        model.encoder(ids, mask)

    for batch in batches[:2]:   # warm-up
        full_step(batch)
        encoder_step(batch)
    timings = {name: [] for name in ("full_step", "encoder_step", "full_predict", "encoder_predict")}
    documents = 0
    for batch in batches[2:]:
        documents += len(batch)
        timings["full_step"].append(timed(lambda: full_step(batch), device))
        timings["encoder_step"].append(timed(lambda: encoder_step(batch), device))
        model.eval()
        timings["full_predict"].append(timed(lambda: full_predict(batch), device))
        timings["encoder_predict"].append(timed(lambda: encoder_predict(batch), device))
        model.train()
    total = {name: sum(values) for name, values in timings.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(timings[a], timings[b]))
    print(f"dataset {dataset.name}, {dataset.num_labels} labels, {clusters.num_clusters} clusters"
          f"{' (flat)' if clusters.is_flat else ''}; encoder {config.model_name}, max length {config.max_length}, "
          f"batch {config.batch_size}; device {device}, {threads} threads; {documents} documents timed"
          + (f"; the label tower encodes {np.mean([len(t) for t in candidate_texts.values()]):.0f} label texts a "
             "batch, counted as encoder work" if label_tower else ""))
    print(f"training:   {documents / total['full_step']:.1f} documents/s, "
          f"{1000 * total['full_step'] / documents:.1f} ms/document "
          f"(encoder forward+backward alone {1000 * total['encoder_step'] / documents:.1f})")
    print(f"prediction: {1000 * total['full_predict'] / documents:.2f} ms/document "
          f"(encoder forward alone {1000 * total['encoder_predict'] / documents:.2f})")
    print(f"ratio full training step / encoder forward+backward: {ratio('full_step', 'encoder_step'):.3f} "
          f"(median over batches)")
    print(f"ratio full prediction / encoder forward:             {ratio('full_predict', 'encoder_predict'):.3f}")


if __name__ == "__main__":
    main()
