"""How well a linear reader of each bag of words makes a choice between two labels that nearly exclude each other
(debian-builddeps's debhelper-compat and debhelper): the ceiling a LightXML head that reads a bag can aim for, beside
the share of documents on which a run ranks the right label higher (`benchmarks/rank1_bins.py --either`).

    python benchmarks/choice_ceiling.py DATASET LABEL LABEL [--window 512] [--buckets 4096 16384] [--threads 2]

A logistic regression (scikit-learn's defaults: L2, C=1, no tuning, so no test number chose anything) learns the
choice from the training documents that carry exactly one of the two labels (a run's validation rows included) and is
scored on the test documents that carry exactly one. Its features, fitted on those training documents, each row
scaled to unit length:
- Bonsai's TF-IDF (the linear methods' default options: word 1-2 grams, min_df 2, 1 + log tf), also with words
  alone and over only the text the first --window word pieces cover, to tell which of its differences from the bag
  (bigrams, the whole text, words instead of pieces) makes the choice;
- the LightXML encoder's own `lexical_bag` of the first --window tokens, in each number of --buckets (4,096: the
  rule's) and in one bucket per word piece of the vocabulary (no collisions), each with and without the training
  documents' IDF.
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import normalize
from tabulate import tabulate

from xmcbench.formats import open_dataset
from xmcbench.registry import build_registry
from xmcbench_lightxml.encoder import TransformerClsEncoder
from xmcbench_lightxml.methods import FLAT_LEXICAL_BUCKETS, LIGHTXML_DEFAULTS
from xmcbench_linear.base import TFIDF_OPTIONS
from xmcbench_linear.features import TfidfFeatures

BATCH = 256


def either_rows(labels: sp.csr_matrix, columns: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(N, L) labels -> the rows carrying exactly one of the two columns, and (M,) 1 where it is the first."""
    carried = labels[:, columns].toarray() > 0                                     # (N, 2)
    rows = np.flatnonzero(carried.sum(axis=1) == 1)
    return rows, carried[rows, 0].astype(int)


def bags(encoder: TransformerClsEncoder, texts: list[str], window: int) -> sp.csr_matrix:
    """(N, F) CSR of the encoder's raw lexical_bag over the first `window` tokens of each text."""
    parts = []
    with torch.no_grad():
        for start in range(0, len(texts), BATCH):
            batch = encoder.tokenizer(texts[start:start + BATCH], truncation=True, max_length=window, padding=True,
                                      return_tensors="pt")
            parts.append(sp.csr_matrix(encoder.lexical_bag(batch["input_ids"], batch["attention_mask"]).numpy()))
    return sp.vstack(parts).tocsr()


def window_texts(tokenizer, texts: list[str], window: int) -> list[str]:
    """Each text cut after the last character of the word pieces a `window`-token bag reads (the same truncation
    as `bags`, special tokens included; theirs cover no characters)."""
    offsets = tokenizer(texts, truncation=True, max_length=window, return_offsets_mapping=True)["offset_mapping"]
    return [text[:max((end for _, end in spans), default=0)] for text, spans in zip(texts, offsets)]


def accuracy(train: sp.csr_matrix, y_train: np.ndarray, test: sp.csr_matrix, y_test: np.ndarray) -> float:
    model = LogisticRegression(solver="liblinear").fit(normalize(train), y_train)
    return 100 * float((model.predict(normalize(test)) == y_test).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("labels", nargs=2, metavar="LABEL")
    parser.add_argument("--window", type=int, default=512, help="tokens the bag of word pieces reads")
    parser.add_argument("--buckets", type=int, nargs="+", default=[FLAT_LEXICAL_BUCKETS, 4 * FLAT_LEXICAL_BUCKETS],
                        help="bucket counts of the bag of word pieces (one bucket per piece is always added)")
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    dataset = open_dataset(build_registry(), arguments.dataset)
    missing = [label for label in arguments.labels if label not in dataset.label_names]
    if missing:
        raise SystemExit(f"{arguments.dataset} has no label {missing[0]}; name two labels of its training set")
    columns = [dataset.label_names.index(label) for label in arguments.labels]
    train_rows, y_train = either_rows(dataset.train_labels.tocsr(), columns)
    test_rows, y_test = either_rows(dataset.test_labels.tocsr(), columns)
    train_texts = [dataset.train_texts[row] for row in train_rows]
    test_texts = [dataset.test_texts[row] for row in test_rows]
    print(f"{arguments.dataset}: {len(train_rows)} training / {len(test_rows)} test documents with exactly one of "
          f"{arguments.labels[0]} and {arguments.labels[1]}; always {arguments.labels[0]} is right on "
          f"{100 * y_test.mean():.2f} % of the test ones")

    def encoder_with(buckets: int) -> TransformerClsEncoder:
        return TransformerClsEncoder(LIGHTXML_DEFAULTS["model_name"], num_layers=LIGHTXML_DEFAULTS["num_layers"],
                                     lexical_buckets=buckets).eval()

    tokenizer = encoder_with(arguments.buckets[0]).tokenizer
    cut = f"the first {arguments.window} pieces' text"
    results = []
    for name, ngram_max, (train_part, test_part) in (
            ("Bonsai's TF-IDF, word 1-2 grams", 2, (train_texts, test_texts)),
            ("Bonsai's TF-IDF, words only", 1, (train_texts, test_texts)),
            (f"Bonsai's TF-IDF, word 1-2 grams, {cut}", 2,
             (window_texts(tokenizer, train_texts, arguments.window),
              window_texts(tokenizer, test_texts, arguments.window)))):
        tfidf, train = TfidfFeatures.fit(train_part, {**TFIDF_OPTIONS, "tfidf_ngram_max": ngram_max})
        results.append((name, train.shape[1], accuracy(train, y_train, tfidf.transform(test_part), y_test)))
    # None: one bucket per word piece of the vocabulary, so no two pieces share one
    for buckets in (*arguments.buckets, None):
        encoder = encoder_with(buckets or tokenizer.vocab_size)
        train, test = bags(encoder, train_texts, arguments.window), bags(encoder, test_texts, arguments.window)
        idf = sp.diags(np.log((1 + train.shape[0]) / (1 + np.bincount(train.indices, minlength=train.shape[1]))) + 1)
        name = f"{buckets:,} buckets" if buckets else "one bucket per piece"
        results.append((f"word pieces, {name}", train.shape[1], accuracy(train, y_train, test, y_test)))
        results.append((f"word pieces, {name}, IDF", train.shape[1],
                        accuracy(train @ idf, y_train, test @ idf, y_test)))
    print(tabulate(results, headers=("features (first --window tokens for the pieces)", "columns",
                                     "test documents ranked right, %"), floatfmt=".2f", tablefmt="github"))


if __name__ == "__main__":
    main()
