"""TF-IDF features of raw texts, saved without pickle.

The features of benchmarks/linear_references.py: scikit-learn's TfidfVectorizer over word 1..n-grams
(its default tokenisation: lower case, words of two or more word characters), sublinear tf, terms in at
least min_df training documents, at most max_features terms (the most frequent), L2-normalised rows,
float32. Saved as two files that hold data only:

    tfidf.json      the settings and the vocabulary (the terms, in column order)
    tfidf_idf.npy   the idf weights (F,) float32, read back with allow_pickle=False
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xmcbench.errors import XmcError

SETTINGS_FILE = "tfidf.json"
IDF_FILE = "tfidf_idf.npy"


def _vectorizer(settings: dict, vocabulary: dict[str, int] | None = None):
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(ngram_range=(1, settings["tfidf_ngram_max"]), min_df=settings["tfidf_min_df"],
                           max_features=settings["tfidf_max_features"] or None,
                           sublinear_tf=settings["tfidf_sublinear_tf"], dtype=np.float32, vocabulary=vocabulary)


class TfidfFeatures:
    """Raw texts -> (N, F) float32 CSR TF-IDF rows, F = the vocabulary size."""

    def __init__(self, vectorizer, settings: dict) -> None:
        self.vectorizer = vectorizer
        self.settings = settings   # the tfidf_* options it was fitted with

    @property
    def num_features(self) -> int:
        return len(self.vectorizer.vocabulary_)

    @classmethod
    def fit(cls, texts: list[str], settings: dict) -> tuple["TfidfFeatures", sp.csr_matrix]:
        """Fit on the training texts; returns the features and their (N, F) matrix."""
        vectorizer = _vectorizer(settings)
        try:
            matrix = vectorizer.fit_transform(texts)
        except ValueError as error:   # no term left: too few or too short documents for min_df
            raise XmcError(f"TF-IDF found no term in {len(texts)} training texts with "
                           f"options.tfidf_min_df={settings['tfidf_min_df']} ({error}); lower it, e.g. --set "
                           "options.tfidf_min_df=1") from None
        return cls(vectorizer, settings), matrix.tocsr()

    def transform(self, texts: list[str]) -> sp.csr_matrix:
        """(N, F) float32 CSR, sorted indices; a text without a known term gives an empty row."""
        matrix = self.vectorizer.transform(texts).tocsr().astype(np.float32, copy=False)
        matrix.sort_indices()
        return matrix

    def save(self, folder: Path) -> None:
        terms = [""] * self.num_features
        for term, column in self.vectorizer.vocabulary_.items():
            terms[column] = term
        (folder / SETTINGS_FILE).write_text(json.dumps({"settings": self.settings, "terms": terms},
                                                       ensure_ascii=False) + "\n", encoding="utf-8")
        np.save(folder / IDF_FILE, np.asarray(self.vectorizer.idf_, dtype=np.float32), allow_pickle=False)

    @classmethod
    def load(cls, folder: Path) -> "TfidfFeatures":
        saved = json.loads((folder / SETTINGS_FILE).read_text(encoding="utf-8"))
        terms = saved["terms"]
        idf = np.load(folder / IDF_FILE, allow_pickle=False)
        if idf.shape != (len(terms),):
            raise XmcError(f"{folder / IDF_FILE} holds {idf.shape} idf weights for {len(terms)} terms: the TF-IDF "
                           "files do not match; re-run training")
        vectorizer = _vectorizer(saved["settings"], vocabulary={term: column for column, term in enumerate(terms)})
        vectorizer.idf_ = idf   # with the vocabulary, this is all a fitted TfidfVectorizer transforms with
        return cls(vectorizer, saved["settings"])
