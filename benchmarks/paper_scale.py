"""The paper's large presets at full label count, with synthetic data of the real shapes, against the limits.

For each preset (wiki500k: 501,008 labels, batch 32; amazon670k: 670,091 labels, batch 16; both length 128,
8,192 clusters, BERT-base) this builds the unchanged `lightxml` preset (or, with --method cascade, the
`cascade` preset from CascadeXML's published settings: 65,536 leaf clusters under levels of 1,024 and 8,192
nodes, batch 64, a node-linear classifier per level reading its own layers; the xmcbench-cascade package)
around a BERT-base config with random weights (the bundled MiniLM tokenizer is BERT's uncased WordPiece
vocabulary) and prints, on whatever device is present:
  - tokenization documents/second (synthetic texts, fast tokenizer, no cache);
  - label clustering seconds (label features + balanced 2-means) from --cluster-docs synthetic documents;
  - parameters, bytes on disk in float32 and float16;
  - training: documents/second of full LightXML steps (Trainer.train_step: encoder, recaller, dynamic
    sampler, ranker, losses, AdamW + SparseAdam, AMP on CUDA) and the median ratio of a full step to the
    encoder's forward+backward alone on the same batch (the two interleaved, so noise hits both);
  - the same full step with a dense label-embedding update (AdamW over the whole (L, h) table), to show what
    updating only the touched rows saves;
  - prediction ms/document at batch 1 and at --predict-batch, and the ratio to the encoder's forward alone;
  - peak memory (process RSS, cumulative: run one preset per process to read it per preset; on CUDA also
    torch's peak allocation during the timed steps).
Synthetic data measures speed and memory only, never accuracy.

    python benchmarks/paper_scale.py --threads 2                       # both presets, CPU-sized defaults
    python benchmarks/paper_scale.py --method lightxml --method cascade --preset wiki500k --cluster-docs 0
    python benchmarks/paper_scale.py --preset wiki500k --batches 20 --predict-batch 256 --cluster-docs 1779881
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from xmcbench import clustering, synthetic
from xmcbench.config import JOINT_TRAINING
from xmcbench.features import label_features
from xmcbench.interfaces import LabelClusters
from xmcbench.modelio import build_model
from xmcbench.device import autocast, pick_device, set_threads
from xmcbench.training import LOSS_READ_EVERY, Trainer
from xmcbench.profiling import count_host_syncs
from xmcbench.registry import build_registry
from xmcbench.tokenization import TokenizedTexts, resolve_model_path, tokenize

from step_ratio import timed   # benchmarks/ is on sys.path when this script runs
from xmcbench.runs.plan import plan_run


def bert_base_folder(directory: Path) -> Path:
    """BERT-base's config (BertConfig's defaults: 12 layers, 768 hidden, 12 heads, 3072 intermediate) and the
    bundled uncased WordPiece tokenizer, saved locally: random weights, no download."""
    from transformers import AutoTokenizer, BertConfig

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    BertConfig(vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def random_balanced_clusters(num_labels: int, num_clusters: int, seed: int) -> LabelClusters:
    """Clusters of floor/ceil(L/K) labels drawn at random: the step costs what real clusters cost (same sizes),
    while the clustering itself is timed separately on the synthetic label features."""
    permutation = np.random.default_rng(seed).permutation(num_labels)
    assignment = np.empty(num_labels, dtype=np.int64)
    assignment[permutation] = np.arange(num_labels) % num_clusters
    return LabelClusters.from_assignment(torch.from_numpy(assignment), num_clusters)


def measure_training(trainer: Trainer, tokens: TokenizedTexts, batches: list[np.ndarray], device, config) -> dict:
    """Full steps and encoder-alone forward+backward, interleaved batch by batch; the first batch warms up."""
    model = trainer.model

    def encoder_step(rows):
        input_ids, attention_mask = (t.to(device) for t in tokens.batch(rows))
        model.zero_grad(set_to_none=True)
        with autocast(device, config):
            representation = model.encoder(input_ids, attention_mask)
        representation.float().sum().backward()

    full, alone = [], []
    for index, rows in enumerate(batches):
        full_seconds = timed(lambda: trainer.train_step(rows, JOINT_TRAINING[0]), device)
        alone_seconds = timed(lambda: encoder_step(rows), device)
        if index:
            full.append(full_seconds)
            alone.append(alone_seconds)
    with count_host_syncs() as step_syncs:   # what would make the host wait for a GPU, counted once
        trainer.train_step(batches[-1], JOINT_TRAINING[0])
        trainer.read_losses()
    with count_host_syncs() as encoder_syncs:
        encoder_step(batches[-1])
    model.zero_grad(set_to_none=True)
    documents = sum(len(rows) for rows in batches[1:])
    return {"docs_per_s": documents / sum(full), "step_s": statistics.median(full),
            "encoder_step_s": statistics.median(alone),
            "ratio": statistics.median(f / a for f, a in zip(full, alone)),
            "host_syncs": step_syncs.total, "encoder_host_syncs": encoder_syncs.total}


@torch.no_grad()
def measure_prediction(model, tokens: TokenizedTexts, rows: np.ndarray, batch_size: int, device, config) -> dict:
    model.eval()

    def full(batch):
        input_ids, attention_mask = (t.to(device) for t in tokens.batch(batch))
        with autocast(device, config):
            model.predict_top(input_ids, attention_mask, config.top_clusters, config.top_k)

    def alone(batch):
        input_ids, attention_mask = (t.to(device) for t in tokens.batch(batch))
        with autocast(device, config):
            model.encoder(input_ids, attention_mask)

    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    full(batches[0]), alone(batches[0])   # warm-up
    full_times = [timed(lambda: full(b), device) for b in batches]
    alone_times = [timed(lambda: alone(b), device) for b in batches]
    model.train()
    return {"ms_per_doc": 1000 * sum(full_times) / len(rows),
            "encoder_ms_per_doc": 1000 * sum(alone_times) / len(rows),
            "ratio": sum(full_times) / sum(alone_times)}


def bytes_on_disk(model: torch.nn.Module, bytes_per_float: int) -> int:
    """Weights file payload: floating-point tensors at bytes_per_float, integer buffers at their own size."""
    return sum(t.numel() * (bytes_per_float if t.is_floating_point() else t.element_size())
               for t in model.state_dict().values())


def run_preset(preset: str, method: str, args, model_dir: Path) -> None:
    registry = build_registry()
    options = [f"model_name={model_dir}", "pretrained_weights=false", f"threads={args.threads}",
               f"device={args.device}"]
    config = plan_run(registry, method, preset, set_options=options).config
    threads = set_threads(config)
    device = pick_device(config)
    shape = synthetic.SHAPES[preset]
    tree = f", tree levels {config.tree_levels} keeping {config.level_top or config.top_clusters}" \
        if config.tree_levels else f", h {config.hidden_size}"
    print(f"\n== {method} at {preset}: {shape.num_labels:,} labels, {config.num_clusters:,} clusters, top "
          f"{config.top_clusters}{tree}, batch {config.batch_size}, length {config.max_length}, BERT-base (random); "
          f"device {device}, {threads} threads, amp {config.amp and device.type == 'cuda'}")

    documents = config.batch_size * (args.batches + 1)
    features, labels = synthetic.generate_matrices(shape, documents, seed=args.seed)
    texts = synthetic.feature_texts(features, shape.words_per_doc)
    torch.manual_seed(args.seed)
    clusters = random_balanced_clusters(shape.num_labels, config.num_clusters, args.seed)
    model = build_model(registry, config, clusters)
    started = time.perf_counter()
    tokens = tokenize(texts, model.encoder.tokenizer, model.encoder.tokens_to_read(config.max_length), texts_key=None)
    tokenize_rate = len(texts) / (time.perf_counter() - started)
    print(f"tokenization: {tokenize_rate:,.0f} documents/s ({len(texts)} documents, mean "
          f"{tokens.lengths.mean():.0f} tokens)")
    parameters = sum(p.numel() for p in model.parameters())
    in_rankers = sum(p.numel() for p in model.parts()["ranker"].parameters())
    print(f"model: {parameters / 1e6:.1f}M parameters ({in_rankers / 1e6:.1f}M in the rankers below the "
          f"recaller: label and node tables); weights on disk {bytes_on_disk(model, 4) / 1e9:.2f} GB in float32, "
          f"{bytes_on_disk(model, 2) / 1e9:.2f} GB in float16")

    batches = [np.arange(i, i + config.batch_size) for i in range(0, documents, config.batch_size)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(model, tokens, labels, config, device)
    trainer.prepare()
    training = measure_training(trainer, tokens, batches, device, config)
    gpu = f", peak GPU {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
    print(f"training: {training['docs_per_s']:.2f} documents/s; full step {training['step_s']:.3f} s vs encoder "
          f"forward+backward {training['encoder_step_s']:.3f} s: ratio {training['ratio']:.3f} "
          f"(median of {len(batches) - 1} batches){gpu}; host-device waits per step {training['host_syncs']} "
          f"(encoder alone {training['encoder_host_syncs']}; counted with the read of the losses, which "
          f"happens once every {LOSS_READ_EVERY} steps)")

    prediction_rows = np.arange(min(documents, args.predict_docs))
    for batch_size in (1, args.predict_batch):
        found = measure_prediction(trainer.model, tokens, prediction_rows, batch_size, device, config)
        print(f"prediction, batch {batch_size}: {found['ms_per_doc']:.2f} ms/document vs encoder forward "
              f"{found['encoder_ms_per_doc']:.2f}: ratio {found['ratio']:.3f}")

    print(f"peak memory of model + training + prediction: {peak_rss_gb():.2f} GiB RSS")

    if args.dense_embedding:
        del trainer, model
        config.sparse_label_embeddings = False
        torch.manual_seed(args.seed)
        model = build_model(registry, config, clusters)
        trainer = Trainer(model, tokens, labels, config, device)
        trainer.prepare()
        dense = measure_training(trainer, tokens, batches, device, config)
        print(f"dense label-embedding update: full step {dense['step_s']:.3f} s vs encoder {dense['encoder_step_s']:.3f} s: "
              f"ratio {dense['ratio']:.3f} (sparse update: {training['ratio']:.3f}); peak memory now "
              f"{peak_rss_gb():.2f} GiB RSS")
    del trainer, model

    # last, so that the peak memory above is the model's and the steps'
    if not args.cluster_docs:
        return
    started = time.perf_counter()
    features, labels = synthetic.generate_matrices(shape, args.cluster_docs, seed=args.seed)
    print(f"synthetic data: {args.cluster_docs:,} documents in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    label_feats = label_features(features, labels)
    features_seconds = time.perf_counter() - started
    started = time.perf_counter()
    clustering.balanced_clusters(label_feats, config.num_clusters, seed=args.seed)
    cluster_seconds = time.perf_counter() - started
    print(f"clustering: label features {features_seconds:.1f} s + balanced 2-means {cluster_seconds:.1f} s "
          f"= {features_seconds + cluster_seconds:.1f} s ({label_feats.nnz:,} label-feature nonzeros "
          f"from {args.cluster_docs:,} documents)")
    del features, label_feats

    print(f"peak memory of this process so far: {peak_rss_gb():.2f} GiB RSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=["wiki500k", "amazon670k"],
                        help="repeatable [default: both]")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: one per core)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", type=int, default=3, help="timed training batches (after one warm-up)")
    parser.add_argument("--predict-batch", type=int, default=32, help="the large prediction batch")
    parser.add_argument("--predict-docs", type=int, default=64, help="documents predicted at each batch size")
    parser.add_argument("--cluster-docs", type=int, default=100_000,
                        help="synthetic documents for clustering (0: do not time the clustering)")
    parser.add_argument("--method", action="append", choices=["lightxml", "cascade"],
                        help="repeatable [default: lightxml]; cascade needs the xmcbench-cascade package")
    parser.add_argument("--dense-embedding", action="store_true",
                        help="also time steps with a dense AdamW update of the whole label-embedding table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model_dir = bert_base_folder(Path(directory))
        for preset in args.preset or ["wiki500k", "amazon670k"]:
            for method in args.method or ["lightxml"]:
                run_preset(preset, method, args, model_dir)


if __name__ == "__main__":
    main()
