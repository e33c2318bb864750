"""Synthetic datasets: shapes, determinism, block consistency, XMC-like structure, files, command line."""

import json
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
from typer.testing import CliRunner

from xmcbench.cli import app
from xmcbench.features import read_sparse_features
from xmcbench.data import load_dataset_from_path
from xmcbench.errors import XmcError
from xmcbench.synthetic import (DOCS_PER_BLOCK, SHAPES, TEST_FIRST_DOC, SyntheticShape, _svmlight_lines,
                                feature_texts, generate_matrices, iter_blocks, label_names, write_dataset)

TINY = SHAPES["tiny"]
# labels as many as documents, ~4 documents per label: Amazon-670K's proportions at 1/100 of its size
MEDIUM = SyntheticShape("medium", train_docs=5000, test_docs=1000, num_labels=5000, num_features=5000,
                        labels_per_doc=4.0, features_per_doc=40, words_per_doc=60)


def same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    return (a.shape == b.shape and np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
            and np.array_equal(a.data, b.data))


def test_the_paper_shapes_are_there():
    amazon, wiki = SHAPES["amazon670k"], SHAPES["wiki500k"]
    assert (amazon.train_docs, amazon.test_docs, amazon.num_labels, amazon.num_features) == (490_449, 153_025,
                                                                                              670_091, 135_909)
    assert (wiki.train_docs, wiki.test_docs, wiki.num_labels, wiki.num_features) == (1_779_881, 769_421,
                                                                                      501_008, 2_381_304)
    assert label_names(3) == ["L0", "L1", "L2"]


def test_matrices_have_the_shape_dtypes_and_unit_rows():
    features, labels = generate_matrices(TINY, 300)
    assert isinstance(features, sp.csr_matrix) and isinstance(labels, sp.csr_matrix)
    assert features.shape == (300, TINY.num_features) and labels.shape == (300, TINY.num_labels)
    assert features.dtype == np.float32 and labels.dtype == np.float32
    assert np.all(labels.data == 1) and np.diff(labels.indptr).min() >= 1
    assert np.all(features.data > 0) and np.diff(features.indptr).min() >= 1
    np.testing.assert_allclose(sp.linalg.norm(features, axis=1), 1, rtol=1e-5)
    assert labels.has_canonical_format and features.has_canonical_format
    assert abs(labels.nnz / 300 - TINY.labels_per_doc) < 0.2 * TINY.labels_per_doc
    assert abs(features.nnz / 300 - TINY.features_per_doc) < 0.2 * TINY.features_per_doc
    frequent = features.indices < TINY.num_features // 100  # background features (id = frequency rank): low idf
    assert features.data[frequent].mean() < 0.5 * features.data[~frequent].mean()
    empty_features, empty_labels = generate_matrices(TINY, 0)
    assert empty_features.shape == (0, TINY.num_features) and empty_labels.shape == (0, TINY.num_labels)


def test_same_seed_same_documents_other_seed_other_documents():
    first, again, other = (generate_matrices(TINY, 200, seed=seed) for seed in (5, 5, 6))
    assert same(first[0], again[0]) and same(first[1], again[1])
    assert not same(first[0], other[0]) and not same(first[1], other[1])


def test_documents_do_not_depend_on_how_the_stream_is_cut():
    whole_features, whole_labels = generate_matrices(TINY, 2 * DOCS_PER_BLOCK + 50, seed=2)
    for start, stop in ((0, 10), (100, 300), (DOCS_PER_BLOCK - 5, DOCS_PER_BLOCK + 7), (3, 2 * DOCS_PER_BLOCK + 50)):
        features, labels = generate_matrices(TINY, stop - start, seed=2, first_doc=start)
        assert same(features, whole_features[start:stop]) and same(labels, whole_labels[start:stop])
    blocks = list(iter_blocks(TINY, 2 * DOCS_PER_BLOCK + 50, seed=2))
    assert [b[1].shape[0] for b in blocks] == [DOCS_PER_BLOCK, DOCS_PER_BLOCK, 50]
    assert same(sp.vstack([b[0] for b in blocks], format="csr"), whole_features)
    test_features, _ = generate_matrices(TINY, 50, seed=2, first_doc=TEST_FIRST_DOC)
    assert not same(test_features, whole_features[:50])


def test_label_frequencies_follow_a_power_law():
    _, labels = generate_matrices(MEDIUM, MEDIUM.train_docs)
    counts = np.bincount(labels.indices, minlength=MEDIUM.num_labels)
    top_1_percent = np.sort(counts)[::-1][:MEDIUM.num_labels // 100]
    assert top_1_percent.sum() / counts.sum() > 0.08  # 8 times a uniform share
    assert np.count_nonzero(counts) > 0.85 * MEDIUM.num_labels  # most labels occur...
    assert np.count_nonzero(counts <= 2) > 0.3 * MEDIUM.num_labels  # ...but many only once or twice
    assert counts[:10].mean() > 5 * counts[-1000:].mean()  # label id = frequency rank


def test_documents_sharing_a_label_share_features():
    features, labels = generate_matrices(TINY, 400)
    similarity = (features @ features.T).toarray()
    shared_labels = (labels @ labels.T).toarray()
    others = ~np.eye(400, dtype=bool)
    assert similarity[(shared_labels > 0) & others].mean() > 2 * similarity[(shared_labels == 0) & others].mean()


def test_labels_co_occur():
    """Each label's most frequent partner in one half of the documents stays its partner in the other half
    (lift = P(partner | label) / P(partner)); without topics the lift would be about 1."""
    shape = SyntheticShape("topics", train_docs=8000, test_docs=10, num_labels=1000, num_features=2000,
                           labels_per_doc=4.0, features_per_doc=40, words_per_doc=60)
    _, labels = generate_matrices(shape, 8000)
    first, second = labels[:4000], labels[4000:]
    together = (first.T @ first).tolil()
    together.setdiag(0)
    together = together.tocsr()
    having = np.flatnonzero(together.getnnz(axis=1))
    partner = np.asarray(together[having].argmax(axis=1)).ravel()
    both = second[:, having].multiply(second[:, partner]).sum()
    expected = (np.asarray(second[:, having].sum(axis=0)).ravel() * second[:, partner].mean(axis=0).A1).sum()
    assert len(having) > 900 and both / expected > 3


def test_texts_spell_the_features_heaviest_first():
    features, _ = generate_matrices(TINY, 50)
    texts = feature_texts(features, TINY.words_per_doc)
    assert len(texts) == 50
    for i, text in enumerate(texts):
        words = text.split()
        row = features[i]
        assert set(words) == {f"w{f}" for f in row.indices}
        assert words[0] == f"w{row.indices[np.argmax(row.data)]}"
    assert abs(np.mean([len(t.split()) for t in texts]) - TINY.words_per_doc) < 0.15 * TINY.words_per_doc


def test_svmlight_lines_read_back(tmp_path):
    features = sp.csr_matrix(np.array([[0, 0.6, 0, 0.8] + [0] * 7 + [0], [1.0] + [0] * 11, [0] * 11 + [1]],
                                      dtype=np.float32))
    labels = sp.csr_matrix(np.array([[1, 0, 0] + [0] * 9 + [1], [0, 1, 0] + [0] * 10, [1, 1, 1] + [0] * 10],
                                    dtype=np.float32))
    text = _svmlight_lines(features, labels).decode()
    assert text == "0,12 1:0.600000 3:0.800000\n1 0:1.000000\n0,1,2 11:1.000000\n"
    path = tmp_path / "train_v1.txt"
    path.write_text(text)
    np.testing.assert_allclose(read_sparse_features(path, 3).toarray(), features.toarray(), atol=1e-6)


def test_written_dataset_loads_and_matches_the_generator(tmp_path):
    folder = write_dataset(tmp_path / "tiny", TINY, train_docs=300, test_docs=80, seed=4)
    dataset = load_dataset_from_path(folder)
    features, labels = generate_matrices(TINY, 300, seed=4)
    _, test_labels = generate_matrices(TINY, 80, seed=4, first_doc=TEST_FIRST_DOC)
    assert len(dataset.train_texts) == 300 and len(dataset.test_texts) == 80 and dataset.report == {}
    assert dataset.train_texts == feature_texts(features, TINY.words_per_doc)

    def generator_ids(matrix):
        return [sorted(int(dataset.label_names[j][1:]) for j in row.indices) for row in matrix]

    assert generator_ids(dataset.train_labels) == [list(row.indices) for row in labels]
    assert generator_ids(dataset.test_labels) == [list(row.indices) for row in test_labels]
    read = dataset.train_features   # train_v1.txt, read when first asked for
    assert (read != read_sparse_features(folder / "train_v1.txt", 300)).nnz == 0
    width = read.shape[1]  # the file says nothing of features no document has
    assert features[:, width:].nnz == 0
    np.testing.assert_allclose(read.toarray(), features[:, :width].toarray(), atol=1e-5)
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["generator"] == "xmcbench.synthetic" and stats["complete"] and stats["synthetic"]["seed"] == 4
    assert stats["n_train"] == 300 and stats["avg_labels_per_doc_train"] == round(labels.nnz / 300, 3)
    assert "not for accuracy claims" in (folder / "README.md").read_text()
    assert (folder / "train_ids.txt").read_text().splitlines()[:2] == ["train-0", "train-1"]
    assert not list(folder.glob("*.partial"))


def test_write_dataset_replaces_only_synthetic_folders(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(XmcError, match="not empty and holds no synthetic dataset"):
        write_dataset(mine, TINY, train_docs=10, test_docs=5)
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1

    folder = write_dataset(tmp_path / "synthetic", TINY, train_docs=10, test_docs=5, seed=0)
    before = (folder / "train_texts.txt").read_text()
    write_dataset(folder, TINY, train_docs=10, test_docs=5, seed=1)
    assert (folder / "train_texts.txt").read_text() != before
    with pytest.raises(XmcError, match="at least 1"):
        write_dataset(tmp_path / "empty", TINY, train_docs=0)
    with pytest.raises(XmcError, match="seed must be >= 0"):
        generate_matrices(TINY, 5, seed=-1)


cli = CliRunner()


def test_cli_writes_a_dataset(tmp_path):
    result = cli.invoke(app, ["synthetic", "tiny", "--output", str(tmp_path / "d"), "--train-docs", "40",
                              "--test-docs", "10", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "40 train / 10 test documents" in result.output and "not for accuracy claims" in result.output
    dataset = load_dataset_from_path(tmp_path / "d")
    assert len(dataset.train_texts) == 40 and len(dataset.test_texts) == 10
    assert "--seed 3" in (tmp_path / "d" / "README.md").read_text()
    assert "accuracy claims" in cli.invoke(app, ["synthetic", "--help"]).output


def test_cli_unknown_shape_lists_the_valid_ones(tmp_path):
    result = cli.invoke(app, ["synthetic", "amazon", "--output", str(tmp_path / "d")])
    assert isinstance(result.exception, XmcError)
    assert "amazon670k, wiki500k, tiny" in str(result.exception)
    process = subprocess.run([sys.executable, "-m", "xmcbench", "synthetic", "amazon", "--output",
                              str(tmp_path / "d")], capture_output=True, text=True)
    assert process.returncode == 2 and process.stderr.count("\n") == 1
    assert "unknown synthetic shape 'amazon'" in process.stderr and not (tmp_path / "d").exists()
