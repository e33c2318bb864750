"""Label clustering against PECOS on identical inputs: label features + a balanced binary tree, timed.

Generates a synthetic dataset at a paper shape once (xmcbench.synthetic), saves it, then runs each side in a
process of its own on the same files, one after the other, so that times and peak memory are separable:

  ours   xmcbench.features.label_features + clustering.balanced_clusters, K = the lightxml preset's num_clusters
  PECOS  PIFA (LabelEmbeddingFactory) + HierarchicalKMeans(max_leaf_size = ceil(L/K), nr_splits=2), which
         makes the same K leaves; run by benchmarks/pecos_side.py in PECOS's own environment
         (benchmarks/setup_pecos.sh: libpecos pins numpy < 2)

and prints one table: seconds, peak resident memory, cluster sizes against the (s/2, s] bounds (s = ceil(L/K)),
and cohesion: the mean cosine of a label to its cluster's centroid in xmcbench's normalised label-feature
space, over the labels that have documents. PECOS's PIFA runs with normalized_Y=False so that both sides
build the same label features (a label is the sum of its documents' feature rows); --pecos-normalized-y
gives PECOS's default instead.

    bash benchmarks/setup_pecos.sh                     # once: PECOS in .venv-pecos
    python benchmarks/clustering_vs_pecos.py --shape amazon670k --threads 2
    python benchmarks/clustering_vs_pecos.py --shape wiki500k --docs 600000 --threads 2
    python benchmarks/clustering_vs_pecos.py --features-npz X.npz --labels-npz Y.npz --clusters 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.utils.extmath import row_norms
from tabulate import tabulate

from xmcbench import clustering
from xmcbench.features import label_features
from xmcbench.errors import XmcError

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def _available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# -------------------------------------------------------------------------------------------- the two sides


def run_ours(folder: Path, num_clusters: int, threads: int, seed: int) -> None:
    """Our side, in a process of its own: prints one JSON line, writes folder/ours_clusters.npy."""
    features = sp.load_npz(folder / "features.npz").tocsr()
    labels = sp.load_npz(folder / "labels.npz").tocsr()
    start = time.perf_counter()
    label_feats = label_features(features, labels, threads=threads)
    label_seconds = time.perf_counter() - start
    del features, labels  # as on PECOS's side: only the label features are needed from here on
    start = time.perf_counter()
    assignment = clustering.balanced_clusters(label_feats, num_clusters, seed=seed, threads=threads)
    cluster_seconds = time.perf_counter() - start
    np.save(folder / "ours_clusters.npy", assignment)
    print(json.dumps({
        "label_features_s": label_seconds,
        "clustering_s": cluster_seconds,
        "num_clusters": num_clusters,
        "label_features_nnz": int(label_feats.nnz),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # the largest forked worker; the workers share the label features with this process copy-on-write
        "worker_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }))


def _process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            pending += [int(child) for child in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            pass
    return found


def _proportional_memory(pids: list[int]) -> int:
    """Sum of the processes' proportional set sizes (shared pages counted once overall), in bytes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass  # gone meanwhile, or not Linux
    return total


def _side(command: list[str], name: str) -> dict:
    """Run one side; its JSON line, plus peak_pss_bytes: the largest total PSS of its processes, sampled."""
    print(f"{name}: {' '.join(command)}  (load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _proportional_memory(_process_tree(process.pid)))
        time.sleep(0.2)
    output = process.stdout.read()
    if process.returncode != 0:
        raise XmcError(f"the {name} side failed with exit code {process.returncode}; its messages are above")
    return {**json.loads(output.strip().splitlines()[-1]), "peak_pss_bytes": peak}


# -------------------------------------------------------------------------------------------- quality


def cohesion(label_feats: sp.csr_matrix, assignment: np.ndarray, num_clusters: int) -> float:
    """Mean cosine of a label to its cluster's centroid, over the labels with a nonzero row.

    label_feats: (L, F) with unit (or zero) rows; assignment: (L,) cluster ids. The centroid of a cluster is
    S / |S| with S the sum of its rows, so the cosines of a cluster's labels add up to |S|.
    """
    num_labels = label_feats.shape[0]
    indicator = sp.csr_matrix((np.ones(num_labels, dtype=np.float32), assignment, np.arange(num_labels + 1)),
                              shape=(num_labels, num_clusters))
    sums = (indicator.T @ label_feats).astype(np.float64)
    return float(row_norms(sums).sum() / np.count_nonzero(row_norms(label_feats)))


def size_check(assignment: np.ndarray, num_clusters: int, bound: int) -> dict:
    sizes = np.bincount(assignment, minlength=num_clusters)
    return {"clusters": int(np.count_nonzero(sizes)), "min": int(sizes.min()), "max": int(sizes.max()),
            "in_bounds": bool(np.all((2 * sizes > bound) & (sizes <= bound)))}


# -------------------------------------------------------------------------------------------- inputs


def write_inputs(args, folder: Path) -> tuple[int, int, int]:
    """features.npz and labels.npz in folder; returns (N, F, L)."""
    if args.features_npz:
        features = sp.load_npz(args.features_npz).tocsr().astype(np.float32)
        labels = sp.load_npz(args.labels_npz).tocsr().astype(np.float32)
    else:
        from xmcbench import synthetic  # the synthetic generator is only needed here

        shape = synthetic.get_shape(args.shape)
        if args.labels:
            shape = dataclasses.replace(shape, num_labels=args.labels)
        docs = args.docs or shape.train_docs
        start = time.perf_counter()
        features, labels = synthetic.generate_matrices(shape, docs, seed=args.seed)
        print(f"generated {args.shape} inputs ({docs:,} documents) in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    sp.save_npz(folder / "features.npz", features, compressed=False)
    sp.save_npz(folder / "labels.npz", labels, compressed=False)
    return features.shape[0], features.shape[1], labels.shape[1]


def default_clusters(args) -> int:
    if args.clusters:
        return args.clusters
    from xmcbench_lightxml.methods import PAPER_PRESETS

    preset = PAPER_PRESETS.get(args.shape or "", {})
    if "num_clusters" not in preset:
        raise XmcError(f"the lightxml presets give no num_clusters for '{args.shape}'; pass --clusters K")
    return preset["num_clusters"]


# -------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", help="synthetic shape: amazon670k, wiki500k (or tiny)")
    parser.add_argument("--docs", type=int, help="documents to generate (default: the shape's train set)")
    parser.add_argument("--labels", type=int, help="number of labels L (default: the shape's)")
    parser.add_argument("--clusters", type=int, help="K, a power of two (default: the lightxml preset's)")
    parser.add_argument("--threads", type=int, default=0, help="for both sides; 0: one per available core")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pecos-python", type=Path, default=REPO / ".venv-pecos" / "bin" / "python",
                        help="python of PECOS's environment (benchmarks/setup_pecos.sh)")
    parser.add_argument("--pecos-normalized-y", action="store_true", help="PECOS's default PIFA weighting")
    parser.add_argument("--skip-pecos", action="store_true", help="run our side only")
    parser.add_argument("--features-npz", type=Path, help="use these (N, F) features instead of generating")
    parser.add_argument("--labels-npz", type=Path, help="with --features-npz: the (N, L) labels")
    parser.add_argument("--workdir", type=Path, help="keep inputs and assignments here (default: a temp dir)")
    parser.add_argument("--run-ours", type=Path, help=argparse.SUPPRESS)  # internal: our side's process
    args = parser.parse_args()

    if args.run_ours:
        run_ours(args.run_ours, args.clusters, args.threads, args.seed)
        return
    if bool(args.features_npz) != bool(args.labels_npz) or not (args.shape or args.features_npz):
        raise XmcError("pass --shape (synthetic inputs) or both --features-npz and --labels-npz")
    if not args.skip_pecos and not args.pecos_python.exists():
        raise XmcError(f"no PECOS python at {args.pecos_python}; run `bash benchmarks/setup_pecos.sh` "
                       "or pass --pecos-python (or --skip-pecos)")
    num_clusters = default_clusters(args)
    threads = args.threads or _available_cores()
    folder = Path(tempfile.mkdtemp(prefix="clustering-vs-pecos-")) if args.workdir is None else args.workdir
    folder.mkdir(parents=True, exist_ok=True)
    try:
        num_docs, num_features, num_labels = write_inputs(args, folder)
        bound = math.ceil(num_labels / num_clusters)  # s: PECOS's max_leaf_size giving the same K leaves
        results = {"ours": _side([sys.executable, __file__, "--run-ours", str(folder), "--clusters",
                                  str(num_clusters), "--threads", str(threads), "--seed", str(args.seed)], "ours")}
        if not args.skip_pecos:
            command = [str(args.pecos_python), str(REPO / "benchmarks" / "pecos_side.py"), "--input", str(folder),
                       "--max-leaf-size", str(bound), "--threads", str(threads), "--seed", str(args.seed)]
            results["PECOS"] = _side(command + (["--normalized-y"] if args.pecos_normalized_y else []), "PECOS")

        features = sp.load_npz(folder / "features.npz").tocsr()
        labels = sp.load_npz(folder / "labels.npz").tocsr()
        label_feats = label_features(features, labels)
        del features, labels
        rows = []
        for name, result in results.items():
            assignment = np.load(folder / f"{'ours' if name == 'ours' else 'pecos'}_clusters.npy")
            sizes = size_check(assignment, num_clusters, bound)
            result["cohesion"] = cohesion(label_feats, assignment, num_clusters)
            result["total_s"] = result["label_features_s"] + result["clustering_s"]
            worker = result.get("worker_peak_rss_bytes")
            rows.append([name, f"{result['label_features_s']:.2f}", f"{result['clustering_s']:.2f}",
                         f"{result['total_s']:.2f}", f"{result['peak_pss_bytes'] / GIB:.2f}",
                         f"{result['peak_rss_bytes'] / GIB:.2f}", f"{worker / GIB:.2f}" if worker else "-",
                         sizes["clusters"], sizes["min"], sizes["max"], "yes" if sizes["in_bounds"] else "NO",
                         f"{result['cohesion']:.4f}"])
        if "PECOS" in results:
            ours, pecos = results["ours"], results["PECOS"]
            rows.append(["ours / PECOS"] + [f"{ours[key] / pecos[key]:.2f}" for key in
                                            ("label_features_s", "clustering_s", "total_s", "peak_pss_bytes",
                                             "peak_rss_bytes")]
                        + ["", "", "", "", "", f"{ours['cohesion'] / pecos['cohesion']:.4f}"])

        print(f"\n{num_docs:,} documents, F = {num_features:,} features, L = {num_labels:,} labels, "
              f"K = {num_clusters:,} clusters (s = ceil(L/K) = {bound}), {threads} threads on each side, "
              f"label features: {results['ours']['label_features_nnz']:,} nonzeros")
        print(tabulate(rows, headers=["", "label features s", "clustering s", "total s", "peak memory GiB",
                                      "main RSS GiB", "worker RSS GiB", "clusters", "min size", "max size",
                                      f"all in ({bound / 2:g}, {bound}]", "cohesion"], disable_numparse=True))
        if 2 * (num_labels // num_clusters) <= bound:
            print(f"note: floor(L/K) = {num_labels // num_clusters} <= s/2, so a balanced binary tree of depth "
                  f"log2(K) cannot keep every leaf above s/2")
        print("cohesion: mean cosine of a label to its cluster centroid (xmcbench's label features, labels with "
              "documents).\npeak memory: the largest sum of the proportional set sizes of a side's processes "
              "(sampled every 0.2 s; shared pages counted once); main / worker RSS: peak resident memory of the "
              "side's process and of its largest forked worker, which shares the label features copy-on-write.")
    finally:
        if args.workdir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except XmcError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
