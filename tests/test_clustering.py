"""Tests for xmcbench.features (document features, label representations), xmcbench.clustering (balanced label
clustering) and the cluster numbering helpers of xmcbench.indexing."""

import bz2
import gzip
import lzma

import numpy as np
import pytest
import scipy.sparse as sp

from xmcbench.clustering import balanced_clusters
from xmcbench.features import label_features, read_sparse_features, tfidf_features
from xmcbench.indexing import cluster_members, num_clusters_for
from xmcbench.errors import XmcError


def random_label_feats(num_labels: int, num_features: int = 30, seed: int = 0) -> sp.csr_matrix:
    """(L, F) random sparse non-negative label features."""
    return sp.random(num_labels, num_features, density=0.3, format="csr", dtype=np.float32, random_state=seed)


# ---------------------------------------------------------------- num_clusters_for / cluster_members


@pytest.mark.parametrize(
    "num_labels, cluster_size, expected",
    [
        (501008, 62, 8192),
        (20, 1, 20),
        (10, 16, 1),
        (16, 16, 1),
        (17, 16, 2),
        (100, 10, 16),  # ceil(100/8) = 13 > 10, ceil(100/16) = 7 <= 10
        (3, 2, 2),
    ],
)
def test_num_clusters_for(num_labels, cluster_size, expected):
    assert num_clusters_for(num_labels, cluster_size) == expected


def test_num_clusters_for_rejects_bad_size():
    with pytest.raises(XmcError, match="cluster_size"):
        num_clusters_for(10, 0)


def test_cluster_members_inverse():
    l2c = np.array([2, 0, 2, 1, 0, 2])
    members = cluster_members(l2c, 4)
    assert len(members) == 4
    assert [m.tolist() for m in members] == [[1, 4], [3], [0, 2, 5], []]


# ---------------------------------------------------------------- balanced_clusters


@pytest.mark.parametrize("num_labels, cluster_size", [(7, 2), (33, 4), (50, 8), (101, 10), (64, 8), (13, 3)])
def test_balance_bounds(num_labels, cluster_size):
    k = num_clusters_for(num_labels, cluster_size)
    l2c = balanced_clusters(random_label_feats(num_labels), k, seed=1)
    assert l2c.shape == (num_labels,) and l2c.dtype == np.int64
    sizes = np.bincount(l2c, minlength=k)
    assert len(sizes) == k
    assert set(sizes.tolist()) <= {num_labels // k, -(-num_labels // k)}
    assert sizes.max() <= cluster_size
    if k > 1:
        assert sizes.min() >= cluster_size // 2


def test_single_cluster_and_zero_rows():
    feats = sp.csr_matrix((9, 5), dtype=np.float32)  # labels with no features at all
    assert balanced_clusters(feats, 1).tolist() == [0] * 9
    sizes = np.bincount(balanced_clusters(feats, 4), minlength=4)
    assert sorted(sizes.tolist()) == [2, 2, 2, 3]


def test_determinism_and_seed_dependence():
    feats = random_label_feats(40, seed=3)
    a = balanced_clusters(feats, 8, seed=5)
    b = balanced_clusters(feats, 8, seed=5)
    np.testing.assert_array_equal(a, b)
    others = [balanced_clusters(feats, 8, seed=s) for s in range(6, 10)]
    assert any(not np.array_equal(a, o) for o in others)


@pytest.mark.parametrize("num_groups", [2, 4])
def test_separated_groups_split_apart(num_groups):
    # 30 labels per group: with very small groups, balanced 2-means (like AttentionXML's) can, for an unlucky
    # seed pair from the same group, settle in a mixed local optimum (~4% of seeds at 10 labels per group).
    per_group, width = 30, 5
    rng = np.random.default_rng(0)
    dense = np.zeros((num_groups * per_group, num_groups * width), dtype=np.float32)
    for g in range(num_groups):  # group g only uses features [g*width, (g+1)*width)
        dense[g * per_group : (g + 1) * per_group, g * width : (g + 1) * width] = rng.random((per_group, width)) + 0.1
    perm = rng.permutation(len(dense))  # shuffled so row order cannot give the answer away
    group = perm // per_group
    for seed in range(3):
        l2c = balanced_clusters(sp.csr_matrix(dense[perm]), num_groups, seed=seed)
        cluster_of_group = [set(l2c[group == g].tolist()) for g in range(num_groups)]
        assert all(len(c) == 1 for c in cluster_of_group)
        assert len(set.union(*cluster_of_group)) == num_groups


def topic_label_feats(num_labels: int = 3000, num_features: int = 4000, num_topics: int = 60,
                      seed: int = 0) -> sp.csr_matrix:
    """(L, F) sparse nonnegative rows, each a few features of its topic's pool plus a few of its own: the
    shape of real label features, large enough for several levels of worker tasks and compaction."""
    rng = np.random.default_rng(seed)
    pools = rng.integers(0, num_features, (num_topics, 40))
    topic = rng.integers(0, num_topics, num_labels)
    rows = np.repeat(np.arange(num_labels), 20)
    columns = np.concatenate([pools[topic][:, :12], rng.integers(0, num_features, (num_labels, 8))], axis=1).ravel()
    values = rng.random(len(rows)).astype(np.float32) + 0.1
    return sp.csr_matrix((values, (rows, columns)), shape=(num_labels, num_features))


def test_result_does_not_depend_on_worker_processes():
    # K = 256: five levels of single-split tasks, then subtree tasks of three levels each
    feats = topic_label_feats()
    alone = balanced_clusters(feats, 256, seed=3, threads=1)
    for threads in (2, 3):
        np.testing.assert_array_equal(balanced_clusters(feats, 256, seed=3, threads=threads), alone)
    sizes = np.bincount(alone, minlength=256)
    assert set(sizes.tolist()) == {3000 // 256, 3000 // 256 + 1}


def test_negative_entries():
    # columns whose entries cancel to a zero sum are still used: compaction must keep them
    feats = topic_label_feats(num_labels=1200, seed=4)
    feats.data[::3] *= -1
    l2c = balanced_clusters(feats, 128, seed=0, threads=1)
    assert set(np.bincount(l2c, minlength=128).tolist()) == {1200 // 128, 1200 // 128 + 1}
    np.testing.assert_array_equal(balanced_clusters(feats, 128, seed=0, threads=2), l2c)


def test_cluster_ids_follow_the_tree():
    # leaves 2i and 2i+1 are the children of node i: the union of a sibling pair is what the
    # clustering one level up (same seed, same tasks) puts in one cluster
    feats = topic_label_feats(num_labels=1000)
    fine = balanced_clusters(feats, 64, seed=1, threads=1)
    coarse = balanced_clusters(feats, 32, seed=1, threads=1)
    np.testing.assert_array_equal(fine // 2, coarse)


def test_topics_end_up_together():
    # 64 topics of 50 labels, 64 clusters: most labels share their cluster with most of their topic
    rng = np.random.default_rng(0)
    topic = np.repeat(np.arange(64), 50)
    pools = rng.permutation(64 * 30).reshape(64, 30)
    rows = np.repeat(np.arange(len(topic)), 10)
    columns = np.stack([rng.choice(pools[t], 10, replace=False) for t in topic]).ravel()
    feats = sp.csr_matrix((rng.random(len(rows)) + 0.5, (rows, columns)), shape=(len(topic), 64 * 30))
    l2c = balanced_clusters(feats, 64, seed=0, threads=1)
    purity = np.mean([np.bincount(l2c[topic == t]).max() / 50 for t in range(64)])
    assert purity > 0.9


def test_input_left_untouched_and_row_scale_ignored():
    feats = topic_label_feats(num_labels=500, seed=2)
    before = feats.copy()
    l2c = balanced_clusters(feats, 16, seed=0, threads=1)
    assert (feats != before).nnz == 0
    # rows scaled by powers of two normalise to the very same unit rows
    scaled = sp.diags(2.0 ** np.arange(-3, 4)[np.arange(500) % 7]).astype(np.float32) @ feats
    np.testing.assert_array_equal(balanced_clusters(scaled.tocsr(), 16, seed=0, threads=1), l2c)


def test_progress_counts_every_split(capsys):
    feats = topic_label_feats(num_labels=400)
    balanced_clusters(feats, 8, threads=1)
    assert "clustering labels: 7/7" in capsys.readouterr().err
    balanced_clusters(feats, 16, threads=2)
    assert "clustering labels: 15/15" in capsys.readouterr().err


def test_failing_worker_raises(monkeypatch):
    from xmcbench import clustering

    run_task = clustering._LabelTree.run_task

    def fail_on_node_5(tree, task, order, advance):
        if task == 5:
            raise ValueError("boom")
        run_task(tree, task, order, advance)

    monkeypatch.setattr(clustering._LabelTree, "run_task", fail_on_node_5)  # inherited by the forked workers
    with pytest.raises(XmcError) as failure:
        balanced_clusters(topic_label_feats(num_labels=400), 32, threads=2)
    message = str(failure.value)
    assert message.startswith("clustering labels: worker process ") and message.endswith("failed: ValueError: boom")
    assert "\n" not in message


def test_failing_label_feature_worker_names_stage_and_cause(monkeypatch, capfd):
    from xmcbench import features

    def fail(*args, **kwargs):
        raise MemoryError("cannot allocate 3 GiB")

    monkeypatch.setattr(features, "normalize", fail)   # inherited by the forked workers
    docs, labels = dominant_label_data()
    with pytest.raises(XmcError, match=r"^label features: worker process \d of \d failed: MemoryError: cannot "
                                       r"allocate 3 GiB$"):
        label_features(docs, labels, threads=4)
    assert "Traceback" not in capfd.readouterr().err   # one line, not a worker's traceback


def dominant_label_data(num_docs: int = 2000, num_labels: int = 300, seed: int = 0):
    """(N, F) documents and (N, L) labels where label 0 is on 90 % of the documents and most others on one
    or two: the skew of real data (debhelper-compat on 76 % of debian-builddeps), which puts most of the
    label-feature work on one label."""
    rng = np.random.default_rng(seed)
    docs = sp.random(num_docs, 400, density=0.05, format="csr", dtype=np.float32, random_state=seed)
    rows = [np.flatnonzero(rng.random(num_docs) < 0.9), rng.integers(0, num_docs, 3 * num_labels)]
    columns = [np.zeros(len(rows[0]), dtype=np.int64), rng.integers(1, num_labels, 3 * num_labels)]
    rows, columns = np.concatenate(rows), np.concatenate(columns)
    labels = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, columns)), shape=(num_docs, num_labels))
    labels.data[:] = 1.0
    return docs, labels


@pytest.mark.parametrize("threads", [2, 3, 4, 16, 64])
def test_skewed_labels_give_the_same_result_with_any_worker_count(threads):
    docs, labels = dominant_label_data()
    alone = label_features(docs, labels, threads=1)
    shared = label_features(docs, labels, threads=threads)
    for name in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(shared, name), getattr(alone, name))
    np.testing.assert_array_equal(balanced_clusters(shared, 64, seed=2, threads=threads),
                                  balanced_clusters(alone, 64, seed=2, threads=1))


def test_bad_num_clusters():
    feats = random_label_feats(20)
    with pytest.raises(XmcError, match="power of two; use 8 or 16"):
        balanced_clusters(feats, 12)
    with pytest.raises(XmcError, match="larger than the number of labels"):
        balanced_clusters(feats, 32)
    with pytest.raises(XmcError, match="max_iter"):
        balanced_clusters(feats, 4, max_iter=0)
    with pytest.raises(XmcError, match="threads"):
        balanced_clusters(feats, 4, threads=-1)


# ---------------------------------------------------------------- label_features / tfidf_features


def test_label_features_hand_computed():
    docs = sp.csr_matrix(np.array([[1.0, 0.0, 0.0], [0.0, 3.0, 4.0], [0.0, 1.0, 0.0]], dtype=np.float32))
    labels = sp.csr_matrix(np.array([[1, 1, 0], [1, 0, 0], [0, 1, 0]], dtype=np.float32))
    out = label_features(docs, labels)
    assert out.shape == (3, 3) and out.dtype == np.float32 and sp.isspmatrix_csr(out)
    # label 0: docs 0+1 = [1,3,4] / sqrt(26); label 1: docs 0+2 = [1,1,0] / sqrt(2); label 2: no document
    expected = np.array(
        [[1, 3, 4] / np.sqrt(26), [1, 1, 0] / np.sqrt(2), [0, 0, 0]],
        dtype=np.float32,
    )
    np.testing.assert_allclose(out.toarray(), expected, rtol=1e-6)


def test_label_features_count_each_label_once_and_leave_inputs_alone():
    docs = sp.csr_matrix(np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]]))  # float64 features
    # int labels with weights other than 1, and a stored zero (doc 2, label 0) that is no label
    labels = sp.csr_matrix((np.array([2, 5, 1, 0, 7]), np.array([0, 0, 1, 0, 1]), np.array([0, 1, 3, 5])),
                           shape=(3, 2))
    labels_before, docs_before = labels.copy(), docs.copy()
    out = label_features(docs, labels)
    assert out.dtype == np.float32 and out.shape == (2, 2)
    # label 0: docs 0 + 1 = [4, 4]; label 1: docs 1 + 2 = [1, 2]
    expected = np.array([[4, 4] / np.sqrt(32), [1, 2] / np.sqrt(5)], dtype=np.float32)
    np.testing.assert_allclose(out.toarray(), expected, rtol=1e-6)
    assert (labels != labels_before).nnz == 0 and (docs != docs_before).nnz == 0


def test_label_features_do_not_depend_on_worker_processes():
    rng = np.random.default_rng(0)
    docs = sp.random(3000, 500, density=0.05, format="csr", dtype=np.float32, random_state=1)
    labels = sp.csr_matrix((np.ones(6000, dtype=np.float32), (rng.integers(0, 3000, 6000), rng.integers(0, 800, 6000))),
                           shape=(3000, 800))
    alone = label_features(docs, labels, threads=1)
    for threads in (2, 3):
        shared = label_features(docs, labels, threads=threads)
        for name in ("indptr", "indices", "data"):
            np.testing.assert_array_equal(getattr(shared, name), getattr(alone, name))
    assert alone.shape == (800, 500) and alone.dtype == np.float32


def test_label_features_shape_mismatch():
    with pytest.raises(ValueError, match="must match"):
        label_features(sp.csr_matrix((3, 2)), sp.csr_matrix((4, 2)))


def test_tfidf_features():
    texts = ["The cat sat", "the dog sat down", "a CAT and a dog", "birds"]
    x = tfidf_features(texts)
    assert sp.isspmatrix_csr(x) and x.dtype == np.float32
    assert x.shape[0] == 4
    np.testing.assert_allclose(np.sqrt(np.asarray(x.multiply(x).sum(axis=1))).ravel(), 1.0, rtol=1e-6)
    assert tfidf_features(texts, max_features=3).shape == (4, 3)


def test_tfidf_empty_vocabulary():
    with pytest.raises(XmcError, match="no terms"):
        tfidf_features(["", "  "])


# ---------------------------------------------------------------- read_sparse_features

XC_TEXT = "3 4 5\n0,2 0:1.0 3:2.0\n 1:3\n4 2:0.5 3:0.5\n"  # second document has no labels
XC_EXPECTED = np.array(
    [[1, 0, 0, 2] / np.sqrt(5), [0, 1, 0, 0], [0, 0, 1, 1] / np.sqrt(2)],
    dtype=np.float32,
)


def test_read_xc_format(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(XC_TEXT)
    x = read_sparse_features(path, num_docs=3)
    assert sp.isspmatrix_csr(x) and x.dtype == np.float32 and x.shape == (3, 4)
    np.testing.assert_allclose(x.toarray(), XC_EXPECTED, rtol=1e-6)


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".xz", lzma.open), (".bz2", bz2.open)])
def test_read_compressed(tmp_path, suffix, opener):
    path = tmp_path / ("train.txt" + suffix)
    with opener(path, "wt") as fh:
        fh.write(XC_TEXT)
    np.testing.assert_allclose(read_sparse_features(path).toarray(), XC_EXPECTED, rtol=1e-6)


def test_read_svmlight_format(tmp_path):
    path = tmp_path / "train_v1.txt"
    path.write_text("1,2 0:1 2:1\n3 1:2\n0 0:3 4:4\n")
    x = read_sparse_features(path, num_docs=3)
    assert x.shape == (3, 5) and x.dtype == np.float32
    expected = np.array([[1, 0, 1, 0, 0] / np.sqrt(2), [0, 1, 0, 0, 0], [0.6, 0, 0, 0, 0.8]], dtype=np.float32)
    np.testing.assert_allclose(x.toarray(), expected, rtol=1e-6)


def test_read_svmlight_gz(tmp_path):
    path = tmp_path / "train_v1.txt.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("1 0:3 1:4\n2 2:1\n")
    np.testing.assert_allclose(read_sparse_features(path).toarray(), [[0.6, 0.8, 0], [0, 0, 1]], rtol=1e-6)


def test_header_row_count_mismatch(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("4 4 5\n0 0:1\n1 1:1\n")
    with pytest.raises(XmcError, match=r"says 4 documents but the file has 2"):
        read_sparse_features(path)


def test_num_docs_mismatch(tmp_path):
    path = tmp_path / "train_v1.txt"
    path.write_text("1 0:1\n2 1:1\n")
    with pytest.raises(XmcError, match=r"train_v1.txt: has 2 feature rows but 5 training documents"):
        read_sparse_features(path, num_docs=5)


@pytest.mark.parametrize(
    "name, text, line, what",
    [
        ("train.txt", "2 4 3\n0 0:1\n1 1:x\n", 3, "malformed feature"),
        ("train.txt", "2 4 3\n0 0:1\n1 7:1\n", 3, "out of range"),
        ("train.txt", "2 4 3\na,b 0:1\n1 1:1\n", 2, "malformed label list"),
        ("train_v1.txt", "1 0:1\n2 1:1\n3 oops\n", 3, "malformed feature"),
        ("train_v1.txt", "1 0:1\n2 1:nan\n", 2, "not a finite number"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, name, text, line, what):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(XmcError, match=what) as info:
        read_sparse_features(path)
    assert f"{path}:{line}:" in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(XmcError, match="not found"):
        read_sparse_features(tmp_path / "nope.txt")
