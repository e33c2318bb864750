"""usage: identity_compare.py BEFORE AFTER -- two identity_runs.sh folders: metrics, weights, training logs, predictions
and the ensemble's files, tensor by tensor; prints ALL IDENTICAL or DIFFERENT."""
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

before, after = Path(sys.argv[1]), Path(sys.argv[2])
ok = True
for method in ("lightxml", "lightxml-static", "lightxml-static-bs"):
    a, b = before / method, after / method
    ma, mb = json.loads((a / "metrics.json").read_text()), json.loads((b / "metrics.json").read_text())
    keys = [k for k in ma if isinstance(ma[k], (int, float))]
    same_metrics = all(ma[k] == mb.get(k) for k in keys) and ma.get("frequency_bins") == mb.get("frequency_bins")
    wa, wb = load_file(str(a / "model/weights.safetensors")), load_file(str(b / "model/weights.safetensors"))
    same_weights = wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
    pa, pb = load_file(str(a / "predictions.safetensors")), load_file(str(b / "predictions.safetensors"))
    same_predictions = pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)
    la, lb = json.loads((a / "training_log.json").read_text()), json.loads((b / "training_log.json").read_text())
    same_log = la == lb
    print(f"{method}: {len(keys)} metrics identical={same_metrics}, {len(wa)} tensors identical={same_weights}, "
          f"predictions identical={same_predictions}, training log identical={same_log}")
    ok &= same_metrics and same_weights and same_predictions and same_log
for method in ("plt", "ensemble"):
    a, b = before / method, after / method
    ma, mb = json.loads((a / "metrics.json").read_text()), json.loads((b / "metrics.json").read_text())
    drop = ("rescored", "date")
    same_metrics = {k: v for k, v in ma.items() if k not in drop} == {k: v for k, v in mb.items() if k not in drop}
    files = sorted(str(f.relative_to(a)) for f in a.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".npy", ".npz", ".bin"))
    same_files = all((b / f).is_file() and (a / f).read_bytes() == (b / f).read_bytes() for f in files)
    ja = json.loads((a / "ensemble.json").read_text()) if (a / "ensemble.json").is_file() else None
    jb = json.loads((b / "ensemble.json").read_text()) if (b / "ensemble.json").is_file() else None
    same_json = [None if j is None else {k: v for k, v in j.items() if k not in ("members", "created", "fusion_code")}
                 for j in (ja, jb)]
    same_json = same_json[0] == same_json[1]
    print(f"{method}: metrics identical={same_metrics}, {len(files)} array files identical={same_files}, ensemble.json identical={same_json}")
    ok &= same_metrics and same_files and same_json
print("ALL IDENTICAL" if ok else "DIFFERENT")
