"""PECOS's side of benchmarks/clustering_vs_pecos.py: PIFA label features + hierarchical k-means, timed.

Runs inside PECOS's own environment (libpecos pins numpy < 2; see benchmarks/setup_pecos.sh), so it imports
nothing from xmcbench:

    .venv-pecos/bin/python benchmarks/pecos_side.py --input DIR --max-leaf-size 82 --threads 2 --seed 0

Reads DIR/features.npz (N, F) and DIR/labels.npz (N, L), writes DIR/pecos_clusters.npy ((L,) int64 label ->
leaf cluster) and prints one JSON line: seconds of each stage and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from pecos.xmc import Indexer, LabelEmbeddingFactory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True, help="folder with features.npz and labels.npz")
    parser.add_argument("--max-leaf-size", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--normalized-y", action="store_true",
                        help="PECOS's default PIFA (each document's label row L2-normalised); without it a label "
                             "is the plain sum of its documents' features, as in xmcbench")
    args = parser.parse_args()

    features = sp.load_npz(args.input / "features.npz").tocsr().astype(np.float32)
    labels = sp.load_npz(args.input / "labels.npz").tocsr().astype(np.float32)

    start = time.perf_counter()
    label_feats = LabelEmbeddingFactory.create(labels, features, method="pifa", threads=args.threads,
                                               normalized_Y=args.normalized_y)
    pifa_seconds = time.perf_counter() - start
    del features, labels  # as on our side: only the label features are needed from here on

    start = time.perf_counter()
    chain = Indexer.gen(label_feats, indexer_type="hierarchicalkmeans", max_leaf_size=args.max_leaf_size,
                        nr_splits=2, threads=args.threads, seed=args.seed)
    cluster_seconds = time.perf_counter() - start

    leaves = chain[-1].tocsr()  # (L, number of leaves): one 1 per label, in its leaf's column
    if not np.all(np.diff(leaves.indptr) == 1):
        raise SystemExit("PECOS's last cluster matrix does not give every label exactly one leaf")
    np.save(args.input / "pecos_clusters.npy", leaves.indices.astype(np.int64))
    print(json.dumps({
        "label_features_s": pifa_seconds,
        "clustering_s": cluster_seconds,
        "num_clusters": int(leaves.shape[1]),
        "label_features_nnz": int(label_feats.nnz),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()
