"""Time reading an Extreme Classification Repository bag-of-words file at Amazon-670K's shape: the line-by-line
Python parser (xmcbench.features._parse_lines, what read_sparse_features used before) against scikit-learn's
C parser behind xmcbench.features.read_xc_sparse, in one run on the same file.

The file is synthetic (xmcbench.synthetic's amazon670k shape: 135,909 features, 670,091 labels, ~75 nonzero
features and ~5.45 labels per document), with a share of Amazon-670K's 490,449 training documents:
10 % by default, --share 1 for the full size.

    python benchmarks/read_xc.py [--share 0.1] [--folder /tmp/xc-bench]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from xmcbench import synthetic
from xmcbench.features import _open_text, _parse_lines, parse_xc_header, read_xc_sparse


def write_file(path: Path, num_docs: int) -> None:
    shape = synthetic.get_shape("amazon670k")
    with open(path, "wb") as stream:
        stream.write(f"{num_docs} {shape.num_features} {shape.num_labels}\n".encode())
        for features, labels in synthetic.iter_blocks(shape, num_docs):
            stream.write(synthetic._svmlight_lines(features, labels))


def python_loop(path: Path):
    with _open_text(path) as lines:
        _, num_features, _ = parse_xc_header(lines.readline())
        return _parse_lines(lines, path, first_lineno=2, num_features=num_features, skip_blank=False)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", type=float, default=0.1, help="share of Amazon-670K's 490,449 training documents")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/xmcbench-read-xc"))
    args = parser.parse_args()
    num_docs = round(490_449 * args.share)
    args.folder.mkdir(parents=True, exist_ok=True)
    path = args.folder / f"amazon670k-{num_docs}.txt"
    if not path.exists():
        start = time.perf_counter()
        write_file(path, num_docs)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - start:.1f} s")
    timings, matrices = {}, []
    for name, read in (("python loop (features._parse_lines)", python_loop),
                       ("scikit-learn C parser (features.read_xc_sparse)", lambda p: read_xc_sparse(p).features)):
        start = time.perf_counter()
        features = read(path)
        timings[name] = time.perf_counter() - start
        matrices.append(features)
        print(f"{name}: {timings[name]:.2f} s, {features.shape[0]:,} x {features.shape[1]:,}, {features.nnz:,} nonzeros")
    old, new = matrices
    assert old.shape == new.shape and abs(old - new).max() < 1e-6, "the two readers disagree"
    slow, fast = timings.values()
    print(f"{num_docs:,} documents ({args.share:g} of Amazon-670K's training set): the C parser is "
          f"{slow / fast:.1f}x faster ({slow:.2f} s -> {fast:.2f} s)")

if __name__ == "__main__":
    main()
