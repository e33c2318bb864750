"""A copy of a finished run whose test and validation lists are ranked with tail slots at a fixed alpha, as a run
with `--set tail_alpha=ALPHA` ranks them (xmcbench.fusion.with_tail_slots, the propensities of the run's
model/label_info.json). Tail slots change only the ranking of the top-k, never training, so the copy gives what the
same run with `--set tail_alpha=ALPHA` would have scored and fused (BENCHMARKS.md section 11, "LightXML's own tail
slots"). A run made without tail slots has its saved lists re-ranked; one made with them (their places no longer
say the model's order) is predicted again with its saved model at ALPHA, 0 included. Nothing is trained.

    python benchmarks/tail_alpha_copy.py RUN_DIR COPY_DIR [--alpha 1]
    xmcbench rescore COPY_DIR                                    # its metrics.json, of the new ranking
    xmcbench ensemble COPY_DIR BONSAI_RUN --fusion weighted --output ENSEMBLE_DIR

The copy links to the run's model/ folder (whose settings still say the run's tail_alpha, so `xmcbench predict` on
it ranks as the run did); its config.json says ALPHA. It is for scoring and for ensembles, which read the saved
lists.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

from safetensors.numpy import load_file, save_file

from xmcbench.formats import open_dataset
from xmcbench.fusion import with_tail_slots
from xmcbench.inference import Predictions
from xmcbench.labels import load_label_info
from xmcbench.models import load_model, predict_documents
from xmcbench.registry import build_registry
from xmcbench.rundir import VALIDATION_PREDICTIONS_FILE, reading_of

TEST_FILE = "predictions.safetensors"
LEFT_OUT = ("predictions.npz",)     # the old ranking's sparse matrix; metrics.json is copied, then rescored


def predicted_again(run: Path, record: dict, alpha: float, saved: dict) -> dict:
    """The run's test and validation lists predicted again with its saved model at tail_alpha `alpha`:
    {file name: Predictions}. saved: the run's saved lists {file name: arrays}; the validation rows come from them."""
    registry = build_registry()
    dataset = open_dataset(registry, record["dataset"], None, reading_of(record))
    model, config, _ = load_model(run, registry)
    config = copy.copy(config)
    config.tail_alpha = alpha
    found = {TEST_FILE: predict_documents(model, dataset.test_texts, None, config, model_dir=run)}
    if VALIDATION_PREDICTIONS_FILE in saved:
        texts = [dataset.train_texts[i] for i in saved[VALIDATION_PREDICTIONS_FILE]["rows"]]
        found[VALIDATION_PREDICTIONS_FILE] = predict_documents(model, texts, None, config, model_dir=run)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("copy", type=Path)
    parser.add_argument("--alpha", type=float, default=1.0)
    args = parser.parse_args()
    if args.copy.exists():
        raise SystemExit(f"{args.copy} exists; give a new folder")
    record = json.loads((args.run / "config.json").read_text())
    saved = {name: load_file(str(args.run / name)) for name in (TEST_FILE, VALIDATION_PREDICTIONS_FILE)
             if (args.run / name).is_file()}
    if record["config"].get("tail_alpha", 0.0):
        ranked = predicted_again(args.run, record, args.alpha, saved)
    else:
        names = json.loads((args.run / "model" / "labels.json").read_text())
        inverse = load_label_info(args.run / "model", names, "rerun the run").inverse_propensities
        ranked = {name: with_tail_slots(Predictions(found["labels"], found["scores"], None), inverse, args.alpha)
                  for name, found in saved.items()}
    args.copy.mkdir(parents=True)
    for path in args.run.iterdir():
        if path.name in saved or path.name in LEFT_OUT:
            continue
        if path.is_dir():
            (args.copy / path.name).symlink_to(path.resolve())
        else:
            shutil.copy2(path, args.copy / path.name)
    record["config"]["tail_alpha"] = args.alpha
    (args.copy / "config.json").write_text(json.dumps(record, indent=1))
    for name, arrays in saved.items():
        arrays.update(labels=ranked[name].labels.astype(arrays["labels"].dtype),
                      scores=ranked[name].scores.astype(arrays["scores"].dtype))
        save_file(arrays, str(args.copy / name))
    print(f"{args.copy}: {args.run.name} with tail slots at alpha {args.alpha:g}; now `xmcbench rescore {args.copy}`")


if __name__ == "__main__":
    main()
