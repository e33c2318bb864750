"""A copy of a finished run whose saved test and validation lists are ranked with tail slots at a fixed alpha, as a
run with `--set tail_alpha=ALPHA` ranks them (xmcbench.fusion.with_tail_slots, the propensities of the run's
model/label_info.json). Tail slots change only the ranking of the saved top-k, never training, so a run made
without them gives, through this copy, what the same run with `--set tail_alpha=ALPHA` would have scored and fused
(BENCHMARKS.md section 11, "LightXML's own tail slots"). Nothing is trained or predicted again.

    python benchmarks/tail_alpha_copy.py RUN_DIR COPY_DIR [--alpha 1]
    xmcbench rescore COPY_DIR                                    # its metrics.json, of the new ranking
    xmcbench ensemble COPY_DIR BONSAI_RUN --fusion weighted --output ENSEMBLE_DIR

The copy links to the run's model/ folder (whose settings still say tail_alpha 0, so `xmcbench predict` on it
ranks as the run did); its config.json says the alpha. It is for scoring and for ensembles, which read the saved
lists.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.numpy import load_file, save_file

from xmcbench.fusion import with_tail_slots
from xmcbench.inference import Predictions
from xmcbench.labels import load_label_info
from xmcbench.rundir import VALIDATION_PREDICTIONS_FILE

RANKED_FILES = ("predictions.safetensors", VALIDATION_PREDICTIONS_FILE)
LEFT_OUT = ("predictions.npz",)     # the old ranking's sparse matrix; metrics.json is copied, then rescored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("copy", type=Path)
    parser.add_argument("--alpha", type=float, default=1.0)
    args = parser.parse_args()
    if args.copy.exists():
        raise SystemExit(f"{args.copy} exists; give a new folder")
    args.copy.mkdir(parents=True)
    for path in args.run.iterdir():
        if path.name in RANKED_FILES or path.name in LEFT_OUT:
            continue
        if path.is_dir():
            (args.copy / path.name).symlink_to(path.resolve())
        else:
            shutil.copy2(path, args.copy / path.name)
    record = json.loads((args.run / "config.json").read_text())
    record["config"]["tail_alpha"] = args.alpha
    (args.copy / "config.json").write_text(json.dumps(record, indent=1))
    names = json.loads((args.run / "model" / "labels.json").read_text())
    inverse = load_label_info(args.run / "model", names, "rerun the run").inverse_propensities
    for name in RANKED_FILES:
        if not (args.run / name).is_file():
            continue
        saved = load_file(str(args.run / name))
        ranked = with_tail_slots(Predictions(saved["labels"], saved["scores"], None), inverse, args.alpha)
        save_file({**saved, "labels": ranked.labels.astype(saved["labels"].dtype)}, str(args.copy / name))
    print(f"{args.copy}: {args.run.name} with tail slots at alpha {args.alpha:g}; now `xmcbench rescore {args.copy}`")


if __name__ == "__main__":
    main()
