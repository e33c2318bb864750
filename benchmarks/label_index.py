"""Exact search against approximate-nearest-neighbour libraries for a retriever's label index.

For label sets of debian-builddeps' size (20,813 labels) and larger, and D = 384 / 768, measures exact search
(torch matmul + topk over label chunks, float32) and each library's index (faiss HNSW and IVF-Flat, hnswlib,
usearch; inner product on unit vectors): build time, index size, recall@100 against exact search, and query
time per document at batch sizes 1 and 64, under a given thread count. The query-time knob (ef / nprobe) is
swept, so each index gives a recall-against-time curve.

Vectors (real where they can be):
- labels: all-MiniLM-L6-v2 (mean pooled, normalized: sentence-transformers' recipe) embeddings of the 20,813
  debian-builddeps label texts (`package - short description`); a larger set is those real vectors plus a
  mixture around them: each extra vector is a random real label vector plus Gaussian noise of the spread that
  separates a real label from its nearest real neighbour, normalized again.
- D = 768: the 384-d vectors through a fixed random orthonormal map into 768 dimensions, plus noise of half that
  spread in every dimension (no 768-d encoder ships offline).
- queries: the embeddings of debian-builddeps' test documents (their texts, 128 tokens), mapped as the labels.
Embeddings are cached in --cache (computing them took 27 minutes on 2 busy cores). Exact search here is
xmcbench.label_index's algorithm, written out so that the truth the recall is counted against does not depend on
the code measured. Each search of a table is timed in every round, all interleaved, so that others' work on a
shared machine hits every row alike; the 1-minute load average is printed beside them. BENCHMARKS.md section 8
has the commands and the results.

    python benchmarks/label_index.py --sizes 20813 --dims 384 768 --threads 1 2
"""

from __future__ import annotations

import argparse
import lzma
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tabulate import tabulate

REPOSITORY = Path(__file__).resolve().parents[1]
# the label texts as the dataset ships them, else from the shared data folder beside the repository
LABEL_TEXTS = next((path for path in (REPOSITORY / "datasets" / "debian-builddeps" / "label_texts.tsv.xz",
                                      REPOSITORY.parent / "shared" / "data" / "label-texts" /
                                      "debian-builddeps.label_texts.tsv.xz") if path.is_file()),
                   REPOSITORY / "datasets" / "debian-builddeps" / "label_texts.tsv.xz")
TEST_TEXTS = REPOSITORY / "datasets" / "debian-builddeps" / "test_texts.txt.xz"
K = 100
SEED = 0


# -- vectors ---------------------------------------------------------------------------------------------

def embed(texts: list[str], max_length: int, threads: int) -> np.ndarray:
    """(N, 384) float32 unit vectors: all-MiniLM-L6-v2, mean pooled over real tokens."""
    from xmcbench.tokenization import load_transformer

    torch.set_num_threads(threads)
    model, _, tokenizer, _ = load_transformer("all-MiniLM-L6-v2", True)
    model.eval()
    order = np.argsort([len(text) for text in texts])
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(texts), 128):
            rows = order[start:start + 128]
            batch = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=max_length,
                              return_tensors="pt")
            states = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (states * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            out[rows] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
            print(f"\r  embedded {min(start + 128, len(texts))}/{len(texts)} "
                  f"({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr)
    print(file=sys.stderr)
    return out


def cached_embeddings(cache: Path, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """(20813, 384) label vectors and (6788, 384) test-document vectors of debian-builddeps."""
    cache.mkdir(parents=True, exist_ok=True)
    labels_file, documents_file = cache / "builddeps_labels_minilm.npy", cache / "builddeps_test_minilm.npy"
    if not labels_file.is_file():
        with lzma.open(LABEL_TEXTS, "rt", encoding="utf-8") as handle:
            texts = [line.rstrip("\n").split("\t", 1)[1] for line in handle if line.strip()]
        np.save(labels_file, embed(texts, 64, threads), allow_pickle=False)
    if not documents_file.is_file():
        with lzma.open(TEST_TEXTS, "rt", encoding="utf-8") as handle:
            texts = [line.rstrip("\n") for line in handle]
        np.save(documents_file, embed(texts, 128, threads), allow_pickle=False)
    return np.load(labels_file, allow_pickle=False), np.load(documents_file, allow_pickle=False)


def normalized(vectors: np.ndarray) -> np.ndarray:
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def nearest_gap(vectors: np.ndarray) -> float:
    """The median Euclidean distance from a unit vector to its nearest other vector of the set."""
    x = torch.from_numpy(vectors)
    scores = x @ x.T
    scores.fill_diagonal_(-2.0)
    return float(torch.sqrt((2 - 2 * scores.max(dim=1).values).clamp_min(0)).median())


def label_set(real: np.ndarray, size: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """(size, dim) unit vectors: the real ones, then a mixture around them (see the module docstring)."""
    gap = nearest_gap(real)
    extra = size - len(real)
    vectors = real[:size]
    if extra > 0:
        centres = real[rng.integers(0, len(real), extra)]
        noise = rng.standard_normal((extra, real.shape[1]), dtype=np.float32) * (gap / np.sqrt(real.shape[1]))
        vectors = np.concatenate([real, normalized(centres + noise)])
    return widened(vectors, dim, gap, rng) if dim != real.shape[1] else vectors


def widened(vectors: np.ndarray, dim: int, gap: float, rng: np.random.Generator) -> np.ndarray:
    """Unit vectors of `dim` > 384 dimensions: a fixed orthonormal map (seeded by SEED, so labels and queries
    share it), plus noise of spread gap / 2 over the new dimensions."""
    basis = np.linalg.qr(np.random.default_rng(SEED).standard_normal((dim, vectors.shape[1])))[0]
    out = np.empty((len(vectors), dim), dtype=np.float32)
    for start in range(0, len(vectors), 100_000):
        part = vectors[start:start + 100_000] @ basis.T.astype(np.float32)
        part += rng.standard_normal(part.shape, dtype=np.float32) * (gap / 2 / np.sqrt(dim))
        out[start:start + 100_000] = normalized(part)
    return out


# -- exact search ----------------------------------------------------------------------------------------

def exact_search(labels: torch.Tensor, queries: torch.Tensor, k: int, chunk: int = 65536):
    """Top k of queries @ labels.T over label chunks of `chunk` rows, so memory stays (B, chunk + k)."""
    best_scores = best_ids = None
    for start in range(0, labels.shape[0], chunk):
        scores = queries @ labels[start:start + chunk].T
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        ids = top.indices + start
        if best_scores is None:
            best_scores, best_ids = top.values, ids
        else:
            merged = torch.cat([best_scores, top.values], 1).topk(k, dim=1)
            best_scores, best_ids = merged.values, torch.cat([best_ids, ids], 1).gather(1, merged.indices)
    return best_ids, best_scores


# -- the indexes: build(vectors, threads) -> object; search(object, queries, k, knob, threads) -> ids ------

def saved_size(save) -> int:
    """Bytes of the file save(path) writes: an index in its library's own format."""
    with tempfile.TemporaryDirectory() as folder:
        save(f"{folder}/index")
        return os.path.getsize(f"{folder}/index")


def faiss_index(make, parameters):
    """make(faiss, vectors) -> an empty (trained) faiss index; parameters(faiss, knob) -> its SearchParameters."""
    import faiss

    def build(vectors, threads):
        faiss.omp_set_num_threads(threads)
        index = make(faiss, vectors)
        index.add(vectors)
        return index

    def search(index, queries, k, knob, threads):
        faiss.omp_set_num_threads(threads)
        return index.search(queries, k, params=parameters(faiss, knob))[1]

    return build, search, lambda index: saved_size(lambda path: faiss.write_index(index, path))


def faiss_hnsw():
    def make(faiss, vectors):
        index = faiss.IndexHNSWFlat(vectors.shape[1], 16, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 200
        return index

    return faiss_index(make, lambda faiss, ef: faiss.SearchParametersHNSW(efSearch=ef))


def faiss_ivf():
    def make(faiss, vectors):
        lists = int(4 * np.sqrt(len(vectors)))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(vectors.shape[1]), vectors.shape[1], lists,
                                   faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = SEED
        index.train(vectors[np.random.default_rng(SEED).permutation(len(vectors))[:lists * 64]])
        return index

    return faiss_index(make, lambda faiss, nprobe: faiss.SearchParametersIVF(nprobe=nprobe))


def hnswlib_hnsw():
    import hnswlib

    def build(vectors, threads):
        index = hnswlib.Index(space="ip", dim=vectors.shape[1])
        index.init_index(max_elements=len(vectors), M=16, ef_construction=200, random_seed=SEED)
        index.add_items(vectors, num_threads=threads)
        return index

    def search(index, queries, k, ef, threads):
        index.set_ef(ef)
        return index.knn_query(queries, k=k, num_threads=threads)[0]

    return build, search, lambda index: saved_size(index.save_index)


def usearch_hnsw():
    from usearch.index import Index

    def build(vectors, threads):
        index = Index(ndim=vectors.shape[1], metric="ip", dtype="f32", connectivity=16, expansion_add=200)
        index.add(np.arange(len(vectors)), vectors, threads=threads)
        return index

    def search(index, queries, k, ef, threads):
        index.expansion_search = ef
        return index.search(queries, k, threads=threads).keys.reshape(len(queries), -1)

    return build, search, lambda index: saved_size(index.save)


INDEXES = {"faiss-hnsw": (faiss_hnsw, "ef", (100, 150, 250, 400)),
           "faiss-ivf": (faiss_ivf, "nprobe", (4, 8, 16, 32, 64)),
           "hnswlib": (hnswlib_hnsw, "ef", (100, 150, 250, 400)),
           "usearch": (usearch_hnsw, "ef", (100, 150, 250, 400))}


# -- measuring -------------------------------------------------------------------------------------------

def seconds(function, queries: np.ndarray, batch: int, count: int) -> float:
    """Seconds of function(queries[i:i + batch]) over `count` documents (whole batches)."""
    started = time.perf_counter()
    for start in range(0, count, batch):
        function(queries[start:start + batch])
    return time.perf_counter() - started


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found ∩ truth| / k."""
    return float(np.mean([len(np.intersect1d(a[a >= 0], b)) / len(b) for a, b in zip(found, truth)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20813, 100_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[384])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--indexes", nargs="*", default=list(INDEXES), choices=list(INDEXES),
                        help="the libraries to measure besides exact search (none: exact search alone)")
    parser.add_argument("--build-threads", type=int, nargs="+", default=None,
                        help="thread counts to time the builds with (default: --threads)")
    parser.add_argument("--queries", type=int, default=1024, help="test documents queried (recall is over all)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (the median is kept)")
    parser.add_argument("--documents", type=int, nargs=2, default=[16, 256],
                        help="documents timed per round at batch 1 and at batch 64")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "xmcbench-label-index",
                        help="folder for the cached embeddings (outside the repository)")
    args = parser.parse_args()

    real_labels, real_documents = cached_embeddings(args.cache, max(args.threads))
    rng = np.random.default_rng(SEED)
    documents = real_documents[rng.permutation(len(real_documents))[:args.queries]]
    print(f"load average before: {os.getloadavg()[0]:.2f}; {len(real_labels)} real labels, {len(documents)} "
          f"queries, k = {K}; every search of a table row is timed in each of {args.rounds} rounds, all rows of "
          f"a size interleaved, and the median kept", flush=True)
    rows = []
    for dim in args.dims:
        for size in args.sizes:
            vectors = label_set(real_labels, size, dim, np.random.default_rng(SEED + size))
            queries = (documents if dim == documents.shape[1]
                       else widened(documents, dim, nearest_gap(real_labels), np.random.default_rng(SEED + 1)))
            labels_t = torch.from_numpy(vectors)
            truth = exact_search(labels_t, torch.from_numpy(queries), K)[0].numpy()
            # each searcher: (index name, knob text, build s by thread count, MiB, recall, search(q, threads))
            searchers = [("exact (torch)", "", {}, vectors.nbytes / 2**20, 1.0,
                          lambda q, threads: exact_search(labels_t, torch.from_numpy(q), K))]
            for name in args.indexes:
                make, knob, settings = INDEXES[name]
                build, search, size_of = make()
                built = {}
                for threads in args.build_threads or args.threads:
                    load = os.getloadavg()[0]
                    started = time.perf_counter()
                    index = build(vectors, threads)
                    built[threads] = (time.perf_counter() - started, load)
                megabytes = size_of(index) / 2**20
                for setting in settings:
                    found = np.asarray(search(index, queries, K, setting, 1))
                    searchers.append((name, f"{knob}={setting}", built, megabytes, recall(found, truth),
                                      lambda q, threads, index=index, setting=setting, search=search:
                                      search(index, q, K, setting, threads)))
                print(f"  {size} x {dim}: built {name} in " + ", ".join(
                    f"{s:.1f} s on {t} thread(s) (load {l:.1f})" for t, (s, l) in built.items()), flush=True)
            for threads in args.threads:
                torch.set_num_threads(threads)
                loads, times = [], np.zeros((args.rounds, len(searchers), 2))
                for round_ in range(args.rounds):
                    loads.append(os.getloadavg()[0])
                    for row, searcher in enumerate(searchers):
                        search_with = lambda q, searcher=searcher: searcher[5](q, threads)
                        search_with(queries[:64])   # warm-up
                        for column, (batch, count) in enumerate(zip((1, 64), args.documents)):
                            offset = (round_ * count) % (len(queries) - count + 1)
                            times[round_, row, column] = 1000 * seconds(search_with, queries[offset:], batch,
                                                                        count) / count
                median = np.median(times, axis=0)
                for row, (name, knob, built, megabytes, found_recall, _) in enumerate(searchers):
                    build_s = built.get(threads, built.get(min(built), (None,)) if built else (None,))[0]
                    rows.append([size, dim, threads, name, knob, build_s, megabytes, found_recall, *median[row],
                                 f"{min(loads):.1f}-{max(loads):.1f}"])
                print(tabulate(rows[-len(searchers):], floatfmt=".3f"), flush=True)
    print(tabulate(rows, headers=["labels", "D", "threads", "index", "query knob", "build s", "size MiB",
                                  f"recall@{K}", "ms/doc B=1", "ms/doc B=64", "load"],
                   floatfmt=("d", "d", "d", "", "", ".1f", ".1f", ".3f", ".3f", ".3f", ""), tablefmt="github"))


if __name__ == "__main__":
    main()
