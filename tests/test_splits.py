"""The validation split: validation_split=grouped keeps near-copies on one side, as a grouped test split does."""

import numpy as np
import pytest

from xmcbench.config import RefusedSetting, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.features import tfidf_features
from xmcbench.formats import dataset_from_rows
from xmcbench.runs.splits import NEAR_COPY_COSINE, near_copy_groups, split_train_rows

WORDS = [f"w{i}" for i in range(400)]


def families_dataset(num_families: int = 40, copies: int = 4, seed: int = 0, features_only: bool = False):
    """num_families groups of `copies` near-identical texts (one word differs), like a source package's
    binaries that share their long description; two families share at most the one word drawn for each text."""
    rng = np.random.default_rng(seed)
    texts, rows = [], []
    for family in range(num_families):
        base = [f"f{family}t{j}" for j in range(30)]
        for _ in range(copies):
            texts.append(" ".join(base + [str(rng.choice(WORDS))]))
            rows.append([f"label{family % 7}"])
    if features_only:
        features = tfidf_features(texts + ["f0t0 f0t1"], min_df=1)
        return dataset_from_rows("families", "v", [], rows, [], [["label0"]], "families",
                                 train_features=features[:-1], test_features=features[-1:])
    return dataset_from_rows("families", "v", texts, rows, ["f0t0 f0t1"], [["label0"]], "families")


def near_copies_across(dataset, training: np.ndarray, validation: np.ndarray) -> int:
    """Validation rows with a training row at TF-IDF cosine >= NEAR_COPY_COSINE."""
    features = tfidf_features(list(dataset.train_texts), min_df=1)
    cosines = (features[validation] @ features[training].T).toarray()
    return int((cosines.max(axis=1) >= NEAR_COPY_COSINE).sum())


def test_a_grouped_split_keeps_every_near_copy_on_one_side():
    dataset = families_dataset()
    random = split_train_rows(dataset, TrainConfig(validation_size=30, seed=3))
    grouped = split_train_rows(dataset, TrainConfig(validation_size=30, seed=3, validation_split="grouped"))
    assert near_copies_across(dataset, *random) > 20, "a random draw splits most families"
    assert near_copies_across(dataset, *grouped) == 0
    training, validation = grouped
    assert len(validation) == 28, "whole families of 4 that fit in 30 rows"
    assert len(np.intersect1d(training, validation)) == 0 and len(training) + len(validation) == 160
    assert np.array_equal(np.sort(validation), validation) and np.array_equal(np.sort(training), training)


def test_a_grouped_split_is_seeded():
    dataset = families_dataset()
    draws = [split_train_rows(dataset, TrainConfig(validation_size=20, seed=seed, validation_split="grouped"))[1]
             for seed in (0, 0, 1)]
    assert np.array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])


def test_without_near_copies_a_grouped_split_is_the_random_one():
    texts = [" ".join(f"d{doc}t{j}" for j in range(6)) for doc in range(60)]   # no two documents share a word
    dataset = dataset_from_rows("distinct", "v", texts, [["a"]] * 60, ["d0t0"], [["a"]], "distinct")
    for seed in (0, 5):
        random = split_train_rows(dataset, TrainConfig(validation_size=10, seed=seed))
        grouped = split_train_rows(dataset, TrainConfig(validation_size=10, seed=seed, validation_split="grouped"))
        assert all(np.array_equal(a, b) for a, b in zip(random, grouped))


def test_the_near_copy_cosine_decides_what_joins():
    dataset = families_dataset()
    assert len(np.unique(near_copy_groups(dataset, np.arange(160)))) == 40
    assert len(np.unique(near_copy_groups(dataset, np.arange(160), cosine=1.01))) == 160, "nothing is that close"
    assert len(np.unique(near_copy_groups(dataset, np.arange(160), cosine=1e-6))) < 40, "families share a random word"


def test_a_dataset_of_features_only_is_grouped_by_its_features():
    dataset = families_dataset(features_only=True)
    groups = near_copy_groups(dataset, np.arange(160))
    assert len(np.unique(groups)) == 40
    assert all(len(np.unique(groups[family * 4:family * 4 + 4])) == 1 for family in range(40))
    _, validation = split_train_rows(dataset, TrainConfig(validation_size=30, validation_split="grouped"))
    assert len(validation) == 28


def test_a_grouped_split_without_texts_or_features_says_what_to_use():
    dataset = dataset_from_rows("bare", "v", [], [["a"]] * 30, [], [["a"]], "bare")
    with pytest.raises(XmcError, match="use validation_split=random"):
        split_train_rows(dataset, TrainConfig(validation_size=5, validation_split="grouped"))


def test_an_unknown_validation_split_is_refused_in_one_line():
    config = TrainConfig(validation_split="by-package")
    with pytest.raises(RefusedSetting, match="validation_split='by-package' is not one of random, grouped"):
        config.validate()


def test_the_near_copy_blocks_bound_memory_without_changing_the_groups(monkeypatch):
    import xmcbench.runs.splits as splits

    dataset = families_dataset()
    whole = near_copy_groups(dataset, np.arange(160))
    monkeypatch.setattr(splits, "_NEAR_COPY_BLOCK", 160 * 3)   # three rows a block
    assert np.array_equal(near_copy_groups(dataset, np.arange(160)), whole)


def test_compare_refuses_an_ensemble_of_methods_validated_on_different_splits():
    from types import SimpleNamespace

    from xmcbench.compare import check_shared_validation

    def plans(second_split):
        return {("a", 0): SimpleNamespace(config=TrainConfig(validation_size=8)),
                ("b", 0): SimpleNamespace(config=TrainConfig(validation_size=8, validation_split=second_split))}

    check_shared_validation(plans("random"))
    with pytest.raises(XmcError, match="differ in validation_size, validation_split or max_train_docs"):
        check_shared_validation(plans("grouped"))
