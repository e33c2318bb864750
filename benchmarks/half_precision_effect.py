"""Accuracy and size of a finished run's model when its weights are stored in half precision.

Loads RUN_DIR's model and scores its test set once as saved (float32), then once after a round trip
through each half storage dtype (save_model_dir with storage_dtype, then load_model_dir: the weights are
rounded to that dtype and upcast again, so the model still computes in float32). Prints P@1/3/5, nDCG@5,
PSP@5, the size of weights.safetensors and how many documents keep exactly the float32 top 5, each half
row with its change against float32.

    python benchmarks/half_precision_effect.py runs/lightxml-debian-debtags-mini-20261126-002603 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from tabulate import tabulate

from xmcbench.errors import XmcError
from xmcbench.modelio import STORAGE_DTYPES, load_model_dir, model_size, save_model_dir
from xmcbench.device import pick_device, set_threads
from xmcbench.inference import predict
from xmcbench.registry import build_registry
from xmcbench.tokenization import tokenize
from xmcbench.formats import open_dataset
from xmcbench.rundir import FINISHED_MARKER
from xmcbench.scoring import propensities, remap_labels, score

METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@5")
HALF_DTYPES = [name for name in STORAGE_DTYPES if name != "float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished run directory (holds metrics.json and model/)")
    parser.add_argument("--dataset", help="dataset to score (default: the one the run was trained on)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()

    run_dir = args.run_dir
    if not (run_dir / FINISHED_MARKER).is_file():
        raise XmcError(f"{run_dir} is not a finished run ({FINISHED_MARKER} is missing)")
    registry = build_registry()
    model, config, label_names = load_model_dir(run_dir, registry)
    config = dataclasses.replace(config, threads=args.threads)
    set_threads(config)
    device = pick_device(config)
    dataset_name = args.dataset or json.loads((run_dir / "config.json").read_text())["dataset"]
    dataset = open_dataset(registry, dataset_name)
    truth = remap_labels(dataset.test_labels, dataset.label_names, label_names)
    weights = propensities(dataset, config, label_names)
    tokens = tokenize(dataset.test_texts, model.encoder.tokenizer, model.encoder.tokens_to_read(config.max_length),
                      f"{dataset.version}/test",
                      description="tokenizing test")

    def score_model(candidate) -> tuple[dict, np.ndarray]:
        found = predict(candidate, tokens, config, device, description="predicting test")
        return score(found, truth, candidate, weights, config.eval_ks), found.labels[:, :5]

    started = time.perf_counter()
    results = {"float32": (*score_model(model), (run_dir / "model" / "weights.safetensors").stat().st_size)}
    for name in HALF_DTYPES:
        with tempfile.TemporaryDirectory() as temporary:
            saved = Path(temporary) / "model"
            save_model_dir(saved, model, dataclasses.replace(config, storage_dtype=name), label_names)
            loaded, _, _ = load_model_dir(saved, registry)
            results[name] = (*score_model(loaded), (saved / "weights.safetensors").stat().st_size)
    seconds = time.perf_counter() - started

    size = model_size(model)
    flat = model.ranker is None
    print(f"{run_dir}: {dataset.name}, {len(dataset.test_texts)} test documents, {len(label_names)} labels, "
          f"{'flat (no ranker)' if flat else f'{model.clusters.num_clusters} clusters'}; "
          f"{size['parameters']:,} parameters; device {device}, {args.threads} threads")
    recorded = json.loads((run_dir / FINISHED_MARKER).read_text())
    print("float32 as scored now vs the run's metrics.json: "
          + ", ".join(f"{key} {results['float32'][0][key]:.2f} vs {recorded[key]:.2f}" for key in METRICS
                      if key in recorded))

    base_metrics, base_top, base_bytes = results["float32"]
    rows = []
    for name, (metrics, top, file_bytes) in results.items():
        same_top5 = 100 * float(np.mean(np.all(top == base_top, axis=1)))
        if name == "float32":
            cells = [f"{metrics[key]:.2f}" for key in METRICS] + [f"{file_bytes / 1e6:.1f}", f"{same_top5:.1f}"]
        else:
            cells = [f"{metrics[key]:.2f} ({metrics[key] - base_metrics[key]:+.2f})" for key in METRICS]
            cells += [f"{file_bytes / 1e6:.1f} ({100 * (file_bytes / base_bytes - 1):+.1f}%)", f"{same_top5:.1f}"]
        rows.append([name, *cells, f"{size['bytes'][name] / 1e6:.1f}"])
    print(tabulate(rows, headers=["storage", *METRICS, "weights file MB", "same top-5 %", "tensor data MB"],
                   disable_numparse=True))
    print(f"(scoring and round trips took {seconds:.0f} s; MB = 10^6 bytes; half rows: change against float32)")


if __name__ == "__main__":
    try:
        main()
    except XmcError as error:
        raise SystemExit(f"half_precision_effect: error: {error}") from None
