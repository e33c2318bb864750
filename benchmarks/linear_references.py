"""The classic reference points a LightXML default must beat, on the same files and scored by the same code.

For each dataset: the most-popular-labels baseline, TF-IDF kNN (cosine, k = 50, votes weighted by
similarity) and TF-IDF + napkinXC PLT, scored with `xmcbench.metrics.evaluate` (P@k, nDCG@k, PSP@k with the
propensities `xmcbench run` uses: the dataset's A, B over the training set), each trained on every training
document. TF-IDF: word unigrams and bigrams, sublinear tf, min_df 2, L2-normalised rows. The PLT is the `plt`
method of the xmcbench-linear plugin package with its defaults (`pip install -e 'plugins/xmcbench-linear[plt]'`),
fitted here without a validation split.

    python benchmarks/linear_references.py debian-debtags-mini debian-debtags debian-builddeps --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer
from tabulate import tabulate

from xmcbench.metrics import evaluate
from xmcbench.registry import build_registry
from xmcbench.formats import open_dataset
from xmcbench.scoring import propensities

METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")


def tfidf(train_texts: list[str], test_texts: list[str]) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, dtype=np.float32)
    return vectorizer.fit_transform(train_texts).tocsr(), vectorizer.transform(test_texts).tocsr()


def most_popular(train_labels: sp.csr_matrix, num_test: int, k: int) -> np.ndarray:
    counts = np.asarray(train_labels.sum(axis=0)).ravel()
    return np.tile(np.argsort(-counts, kind="stable")[:k], (num_test, 1))


def knn(x_train: sp.csr_matrix, y_train: sp.csr_matrix, x_test: sp.csr_matrix, k: int, neighbours: int = 50,
        block: int = 512) -> np.ndarray:
    top = np.full((x_test.shape[0], k), -1, dtype=np.int64)
    for start in range(0, x_test.shape[0], block):
        similarity = (x_test[start:start + block] @ x_train.T).toarray()
        nearest = np.argpartition(-similarity, min(neighbours, similarity.shape[1] - 1), axis=1)[:, :neighbours]
        weights = np.take_along_axis(similarity, nearest, axis=1)
        for row in range(len(nearest)):
            votes = sp.csr_matrix(weights[row]) @ y_train[nearest[row]]
            scores = votes.toarray().ravel()
            order = np.argsort(-scores, kind="stable")[:k]
            top[start + row, :len(order)] = np.where(scores[order] > 0, order, -1)
    return top


def plt_plugin(dataset, train_labels, k: int, threads: int) -> np.ndarray:
    """TF-IDF + napkinXC PLT exactly as `xmcbench run plt` fits it (its TF-IDF included), on every training
    document."""
    from xmcbench.config import resolve_config
    from xmcbench_linear.methods import linear_methods

    spec = next(spec for spec in linear_methods() if spec.name == "plt")
    config = resolve_config(spec, dataset.name, set_options=[f"threads={threads}"])
    model = spec.whole_method.fit(dataset.train_texts, train_labels, dataset.num_labels, config, lambda line: None)
    return model.predict(dataset.test_texts, k)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", nargs="+", help="dataset names or folders")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    registry = build_registry()
    rows, results = [], {}
    for name in args.datasets:
        dataset = open_dataset(registry, name)
        train_labels = dataset.train_labels[:, :dataset.num_labels].tocsr()
        inv_propensity = propensities(dataset).inverse   # the whole training set, as runs score
        started = time.perf_counter()
        x_train, x_test = tfidf(dataset.train_texts, dataset.test_texts)
        features_seconds = time.perf_counter() - started
        methods = {
            "most popular": lambda: most_popular(train_labels, len(dataset.test_texts), 5),
            "TF-IDF kNN (k=50)": lambda: knn(x_train, train_labels, x_test, 5),
            "TF-IDF + napkinXC PLT": lambda: plt_plugin(dataset, train_labels, 5, args.threads),
        }
        for method, fit_predict in methods.items():
            started = time.perf_counter()
            predicted = fit_predict()
            # kNN reads the TF-IDF computed above; the PLT computes its own
            seconds = time.perf_counter() - started + (features_seconds if method == "TF-IDF kNN (k=50)" else 0.0)
            metrics = evaluate(predicted, dataset.test_labels, inv_propensity=inv_propensity)
            results.setdefault(name, {})[method] = {**{m: metrics[m] for m in METRICS}, "seconds": seconds}
            rows.append([name, method, *[f"{metrics[m]:.2f}" for m in METRICS], f"{seconds:.1f}"])
            print(tabulate(rows[-1:], tablefmt="plain"), flush=True)
    print(tabulate(rows, headers=["dataset", "method", *METRICS, "CPU s"], tablefmt="github"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
