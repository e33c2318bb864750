#!/usr/bin/env bash
# Training and prediction speed of two commits of xmcbench, measured alternately on one machine, so that drift
# in the machine's speed (other load, heat) hits both alike. Each round trains the embedded default for one
# epoch on a seeded subset of N training documents (SWA off) with each commit's core and LightXML plugin, and
# prints its training seconds and prediction ms/document.
#
#   bash benchmarks/commits_ab.sh OLD_COMMIT NEW_COMMIT [ROUNDS=3] [DOCUMENTS=800] [--set key=value ...]
#   bash benchmarks/commits_ab.sh 19b05b3 HEAD 3 800 --set threads=2
#
# Run it with nothing else running. Other installed plugins are loaded as usual (an incompatible one is only
# listed as failed by the older core).
set -euo pipefail
cd "$(dirname "$0")/.."
old="$1"; new="$2"; rounds="${3:-3}"; documents="${4:-800}"; shift $(( $# < 4 ? $# : 4 ))
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for commit in "$old" "$new"; do
  mkdir -p "$work/$commit"
  git archive "$commit" xmcbench plugins/xmcbench_lightxml | tar -x -C "$work/$commit"
done
for round in $(seq "$rounds"); do
  for commit in "$old" "$new"; do
    output="$work/run-$commit-$round"
    # run from the scratch folder: from the repository root, whose own folders are importable there, an older
    # commit (eb38ff2) stopped at once with "no dataset named"
    (cd "$work" && PYTHONPATH="$work/$commit:$work/$commit/plugins" python -m xmcbench run lightxml --output "$output" \
      --set epochs=1 --set max_train_docs="$documents" --set swa=false "$@") > "$work/log" 2>&1 \
      || { cat "$work/log"; exit 1; }
    python - "$output/timings.json" "$commit" "$round" <<'PY'
import json, sys
timings = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>12}  round {sys.argv[3]}  train {timings['train_seconds']:7.2f} s  "
      f"predict {timings['predict_ms_per_document']:6.2f} ms/document")
PY
  done
done
