import math

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given, settings
from hypothesis import strategies as st

from xmcbench.errors import XmcError
from xmcbench.metrics import evaluate, format_metrics, propensity_scores, top_k


def csr(rows: list[list[int]], num_labels: int, values: list[list[float]] | None = None) -> scipy.sparse.csr_matrix:
    r = [i for i, labels in enumerate(rows) for _ in labels]
    c = [label for labels in rows for label in labels]
    v = [x for vals in values for x in vals] if values else [1.0] * len(c)
    return scipy.sparse.csr_matrix((v, (r, c)), shape=(len(rows), num_labels))


# Shared hand example: 6 label columns, labels 0..4 predictable, label 5 unseen in training.
#   doc0 truth {0, 2}, predicted [2, 1, 0]  -> hits [1, 0, 1]
#   doc1 truth {1, 5}, predicted [1, -1, 3] -> hits [1, 0, 0]  (5 can never be predicted)
#   doc2 truth {},     predicted [0, 1, 2]  -> hits [0, 0, 0]
TRUTH = csr([[0, 2], [1, 5], []], 6)
PREDICTED = np.array([[2, 1, 0], [1, -1, 3], [0, 1, 2]])
INV_PROP = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # label l weighs l + 1
L3 = math.log2(3)  # log2(1 + 2): the rank-2 discount


def test_precision_hand_example():
    m = evaluate(PREDICTED, TRUTH, ks=(1, 3))
    # P@1 = (1 + 1 + 0) / 3 docs; P@3 = (2/3 + 1/3 + 0) / 3
    assert m["P@1"] == pytest.approx(100 * 2 / 3)
    assert m["P@3"] == pytest.approx(100 * 1 / 3)


def test_ndcg_hand_example():
    m = evaluate(PREDICTED, TRUTH, ks=(1, 3))
    # nDCG@1: doc0 1/1, doc1 1/1, doc2 0 (no labels, still in the mean)   -> 2/3
    assert m["nDCG@1"] == pytest.approx(100 * 2 / 3)
    # nDCG@3: doc0 DCG = 1 + 1/log2(4) = 1.5, IDCG = 1 + 1/log2(3)
    #         doc1 DCG = 1, IDCG = 1 + 1/log2(3) (the unseen label 5 is in the denominator)
    idcg2 = 1 + 1 / L3
    assert m["nDCG@3"] == pytest.approx(100 * (1.5 / idcg2 + 1 / idcg2 + 0) / 3)


def test_recall_hand_example_skips_docs_without_labels():
    m = evaluate(PREDICTED, TRUTH, ks=(1, 3))
    # R@1: doc0 1/2, doc1 1/2, doc2 skipped -> 1/2; R@3: doc0 2/2, doc1 1/2 -> 3/4
    assert m["R@1"] == pytest.approx(50.0)
    assert m["R@3"] == pytest.approx(75.0)


def test_psp_hand_example():
    m = evaluate(PREDICTED, TRUTH, ks=(1, 3), inv_propensity=INV_PROP)
    # PSP@1: hits weigh doc0 w2=3, doc1 w1=2 -> 5; ideal: doc0 max(1, 3)=3, doc1 max(2, 6)=6 -> 9
    assert m["PSP@1"] == pytest.approx(100 * 5 / 9)
    # PSP@3: hits (3 + 1) + 2 = 6; ideal (3 + 1) + (6 + 2) = 12
    assert m["PSP@3"] == pytest.approx(50.0)
    # PSnDCG@1: same as PSP@1 (one slot, unit IDCG)
    assert m["PSnDCG@1"] == pytest.approx(100 * 5 / 9)
    # PSnDCG@3: doc0 (3 + 1/log2(4)) / idcg2, doc1 2 / idcg2;
    #           ideal doc0 (3 + 1/log2(3)) / idcg2, doc1 (6 + 2/log2(3)) / idcg2; idcg2 cancels
    assert m["PSnDCG@3"] == pytest.approx(100 * (3.5 + 2) / ((3 + 1 / L3) + (6 + 2 / L3)))


def test_psr_hand_example():
    m = evaluate(PREDICTED, TRUTH, ks=(1, 3), inv_propensity=INV_PROP)
    # PSR@1: hits over |y|: doc0 w2 / 2 = 1.5, doc1 w1 / 2 = 1, doc2 0 -> 2.5;
    #        ideal best 1 over |y|: doc0 max(1, 3) / 2 = 1.5, doc1 max(2, 6) / 2 = 3 -> 4.5
    assert m["PSR@1"] == pytest.approx(100 * 2.5 / 4.5)
    # PSR@3: doc0 (3 + 1) / 2, doc1 2 / 2 -> 3; ideal (k >= |y|: all relevant labels) (3 + 1) / 2 + (6 + 2) / 2 = 6
    assert m["PSR@3"] == pytest.approx(50.0)
    assert "PSR@1" not in evaluate(PREDICTED, TRUTH, ks=(1,))


def pyxclib_reference(predicted, truth, inv, k):
    """pyxclib's xc_metrics (precision, ndcg, psprecision, psndcg, recall, psrecall at k) written out with
    dense numpy, as its code computes them: top-k ids padded with the extra column L (truth 0, weight 0),
    the ideal ranking = the top k of truth * inv per row, recall divided by max(|y|, 1) over all rows."""
    num_docs, num_labels = truth.shape
    truth = np.hstack([truth, np.zeros((num_docs, 1))])
    inv = np.append(inv, 0.0)
    indices = np.where(predicted[:, :k] >= 0, predicted[:, :k], num_labels)
    flags = np.take_along_axis(truth, indices, axis=1)
    weighted = truth * inv
    ps_indices = np.argsort(-weighted, axis=1, kind="stable")[:, :k]
    ps_flags = np.take_along_axis(truth, ps_indices, axis=1) * inv[ps_indices]
    w_flags = flags * inv[indices]
    total = truth.sum(axis=1).astype(int)
    unit = np.cumsum(1 / np.log2(np.arange(1, max(total.max(), k) + 1) + 1))
    n = unit[total - 1]                                     # pyxclib: index -1 for docs without labels

    def prec(f):
        return np.mean(f.sum(axis=1) / k)

    def ndcg(f):
        dcg = (f / np.log2(np.arange(k) + 2)).sum(axis=1)
        return np.mean(dcg / np.minimum(n, unit[k - 1]))

    deno = 1 / np.maximum(total, 1)

    def rec(f):
        return np.mean(f.sum(axis=1) * deno)

    return {f"P@{k}": 100 * prec(flags), f"nDCG@{k}": 100 * ndcg(flags),
            f"PSP@{k}": 100 * prec(w_flags) / prec(ps_flags), f"PSnDCG@{k}": 100 * ndcg(w_flags) / ndcg(ps_flags),
            f"pyxclib-R@{k}": 100 * rec(flags), f"PSR@{k}": 100 * rec(w_flags) / rec(ps_flags)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_pyxclib_formulas_up_to_large_k(seed):
    rng = np.random.default_rng(seed)
    num_docs, num_labels, ks = 60, 300, (1, 3, 5, 10, 100)
    truth_sets = [rng.choice(num_labels, size=rng.integers(0 if seed else 1, 40), replace=False)
                  for _ in range(num_docs)]
    truth = csr([sorted(s.tolist()) for s in truth_sets], num_labels)
    # rankings that hit often: the relevant labels shuffled among random others; some rows end in empty slots
    predicted = np.empty((num_docs, 100), dtype=np.int64)
    for i, labels in enumerate(truth_sets):
        others = rng.permutation(np.setdiff1d(np.arange(num_labels), labels))
        row = rng.permutation(np.concatenate([labels, others[:100]]))[:100]
        predicted[i] = row
    predicted[::7, 80:] = -1
    inv = 1.0 / propensity_scores(rng.integers(0, 50, num_labels), 1000)
    got = evaluate(predicted, truth, ks=ks, inv_propensity=inv)
    dense = truth.toarray()
    for k in ks:
        want = pyxclib_reference(predicted, dense, inv, k)
        for key in ("P", "nDCG", "PSP", "PSnDCG", "PSR"):
            assert got[f"{key}@{k}"] == pytest.approx(want[f"{key}@{k}"], rel=1e-9), (key, k)
        # pyxclib's recall() counts docs without labels as 0; ours, like its fast_recall, leaves them out
        labelled = np.array([len(s) > 0 for s in truth_sets])
        mine = evaluate(predicted[labelled], truth[labelled], ks=(k,))[f"R@{k}"]
        assert mine == pytest.approx(pyxclib_reference(predicted[labelled], dense[labelled], inv, k)[f"pyxclib-R@{k}"])


def test_large_k_builds_no_dense_cumulative_arrays():
    """R@k and PSR@k at k = 1000 on 5,000 documents: sums only at the cut-offs."""
    import time

    rng = np.random.default_rng(0)
    num_docs, num_labels, k = 5_000, 50_000, 1000
    truth = csr([rng.choice(num_labels, size=rng.integers(1, 20), replace=False).tolist() for _ in range(num_docs)],
                num_labels)
    predicted = np.stack([rng.choice(num_labels, size=k, replace=False) for _ in range(num_docs)])
    started = time.perf_counter()
    m = evaluate(predicted, truth, ks=(1, 5, 100, k), inv_propensity=np.ones(num_labels))
    assert time.perf_counter() - started < 20   # generous: a shared 2-core machine
    # weights all 1 and k >= every |y|: the ideal recall is 1 per labelled doc, so PSR@k = R@k
    assert np.diff(truth.indptr).max() <= k and m[f"PSR@{k}"] == pytest.approx(m[f"R@{k}"])


def test_coverage_hand_example():
    recalled = csr([[0, 2], [1], []], 6)
    m = evaluate(PREDICTED, TRUTH, ks=(1,), recalled_truth=recalled)
    # 3 of the 4 test positives ({0, 2} and {1, 5}) were inside the shortlist
    assert m["coverage"] == pytest.approx(75.0)
    assert "coverage" not in evaluate(PREDICTED, TRUTH, ks=(1,))
    assert "PSP@1" not in evaluate(PREDICTED, TRUTH, ks=(1,))


def test_keys_and_order():
    m = evaluate(PREDICTED, TRUTH, ks=(3, 1), inv_propensity=INV_PROP, recalled_truth=TRUTH)
    assert list(m) == [
        "P@1", "P@3", "nDCG@1", "nDCG@3", "PSP@1", "PSP@3", "PSnDCG@1", "PSnDCG@3", "R@1", "R@3", "PSR@1", "PSR@3",
        "coverage",
    ]
    assert all(isinstance(v, float) for v in m.values())


def test_truth_values_are_binarised_and_input_untouched():
    weighted = csr([[0, 2], [1, 5], []], 6, values=[[3.0, 0.5], [7.0, 2.0], []])
    before = weighted.copy()
    assert evaluate(PREDICTED, weighted, ks=(1, 3)) == pytest.approx(evaluate(PREDICTED, TRUTH, ks=(1, 3)))
    assert (weighted != before).nnz == 0


def test_all_empty_slots_score_zero():
    m = evaluate(np.full((3, 3), -1), TRUTH, ks=(1, 3), inv_propensity=INV_PROP)
    assert all(v == 0.0 for v in m.values())


def test_empty_slot_is_a_miss_not_a_hit():
    # key of (row 1, id -1) equals key of (row 0, last column): must not be read as doc0's label 2
    truth = csr([[2], [0]], 3)
    m = evaluate(np.array([[2], [-1]]), truth, ks=(1,))
    assert m["P@1"] == pytest.approx(50.0)


def test_unseen_label_columns_lower_recall_and_ndcg_not_precision():
    seen = csr([[0, 1]], 4)
    with_unseen = csr([[0, 1, 3]], 4)  # column 3: test label never seen in training
    pred = np.array([[0, 1]])
    a, b = evaluate(pred, seen, ks=(2,)), evaluate(pred, with_unseen, ks=(2,))
    assert a["P@2"] == b["P@2"] == 100.0
    # R@2: 2/2 vs 2/3; nDCG@2: the IDCG is the same (min(2, n_rel) = 2) so it stays 100
    assert a["R@2"] == pytest.approx(100.0) and b["R@2"] == pytest.approx(100 * 2 / 3)
    # at k = 3 the third (unpredictable) label enters the IDCG: (1 + 1/log2(3)) / (1 + 1/log2(3) + 1/2)
    pred3 = np.array([[0, 1, 2]])
    assert evaluate(pred3, seen, ks=(3,))["nDCG@3"] == pytest.approx(100.0)
    assert evaluate(pred3, with_unseen, ks=(3,))["nDCG@3"] == pytest.approx(100 * (1 + 1 / L3) / (1 + 1 / L3 + 0.5))


def test_docs_without_labels():
    truth = csr([[], []], 3)
    m = evaluate(np.array([[0, 1], [2, -1]]), truth, ks=(1, 2), inv_propensity=np.ones(3), recalled_truth=truth)
    assert all(v == 0.0 for v in m.values())
    # one labelled doc of two: nDCG averages over both docs, recall over the labelled one
    m = evaluate(np.array([[0], [1]]), csr([[0], []], 3), ks=(1,))
    assert m["nDCG@1"] == pytest.approx(50.0)
    assert m["R@1"] == pytest.approx(100.0)


def test_psp_is_100_for_the_ideal_ranking():
    rng = np.random.default_rng(0)
    num_labels = 12
    inv = rng.uniform(1, 5, num_labels)
    rows = [list(rng.choice(num_labels, size=rng.integers(1, 6), replace=False)) for _ in range(20)]
    predicted = np.full((20, 5), -1)
    for i, labels in enumerate(rows):
        best = sorted(labels, key=lambda l: -inv[l])
        predicted[i, : len(best)] = best
    m = evaluate(predicted, csr(rows, num_labels), ks=(1, 3, 5), inv_propensity=inv)
    for k in (1, 3, 5):
        assert m[f"PSP@{k}"] == pytest.approx(100.0)
        assert m[f"PSnDCG@{k}"] == pytest.approx(100.0)
        assert m[f"nDCG@{k}"] == pytest.approx(100.0)


def test_propensity_formula_hand_value():
    # N = 100, A = 0.55, B = 1.5, N_l = 10:
    #   C = (ln 100 - 1) * 2.5^0.55 = 3.605170 * 1.655263 = 5.967505
    #   exp(-0.55 * ln 11.5) = 11.5^-0.55 = 0.260985
    #   p = 1 / (1 + 5.967505 * 0.260985) = 1 / 2.557432 = 0.391017
    p = propensity_scores(np.array([10, 0, 1000]), 100)
    assert p.dtype == np.float64 and p.shape == (3,)
    assert p[0] == pytest.approx(0.391017, abs=1e-6)
    # frequent labels are more likely to be observed; unseen labels still get a finite weight
    assert 0 < p[1] < p[0] < p[2] < 1


def test_propensity_errors():
    with pytest.raises(XmcError):
        propensity_scores(np.array([1, 2]), 2)
    with pytest.raises(XmcError):
        propensity_scores(np.array([1, -1]), 100)
    with pytest.raises(XmcError):
        propensity_scores(np.array([[1, 2]]), 100)
    with pytest.raises(XmcError):
        propensity_scores(np.array([0, 2]), 100, b=0.0)


def test_top_k_order_and_ties():
    scores = np.array([[0.1, 0.9, 0.5, 0.9, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0], [-np.inf, 3.0, 2.0, 2.0, 2.0]])
    assert top_k(scores, 3).tolist() == [[1, 3, 2], [0, 1, 2], [1, 2, 3]]
    assert top_k(scores, 5).tolist() == [[1, 3, 2, 0, 4], [0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]
    assert top_k(np.array([[3, 1, 3]], dtype=np.uint8), 2).tolist() == [[0, 2]]
    assert top_k(np.zeros((0, 4)), 2).shape == (0, 2)


def test_top_k_matches_stable_argsort():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 4, size=(50, 30)).astype(np.float32)  # many ties
    for k in (1, 5, 30):
        assert np.array_equal(top_k(scores, k), np.argsort(-scores, axis=1, kind="stable")[:, :k])


def test_top_k_errors():
    with pytest.raises(XmcError):
        top_k(np.zeros((2, 3)), 4)
    with pytest.raises(XmcError):
        top_k(np.zeros((2, 3)), 0)
    with pytest.raises(XmcError):
        top_k(np.zeros(3), 1)
    with pytest.raises(XmcError):
        top_k(np.array([[0.0, np.nan]]), 1)


def test_evaluate_errors():
    with pytest.raises(XmcError, match="cannot evaluate an empty test set"):
        evaluate(np.zeros((0, 5), dtype=int), scipy.sparse.csr_matrix((0, 4)))
    with pytest.raises(XmcError, match=r"\(2, 3\).*\(3, 6\)"):
        evaluate(np.zeros((2, 3), dtype=int), TRUTH, ks=(1,))
    with pytest.raises(XmcError, match="top 5"):
        evaluate(PREDICTED, TRUTH)  # K = 3 < max(ks) = 5
    with pytest.raises(XmcError):
        evaluate(np.array([[6], [0], [0]]), TRUTH, ks=(1,))  # id beyond the truth columns
    with pytest.raises(XmcError):
        evaluate(np.array([[-2], [0], [0]]), TRUTH, ks=(1,))
    with pytest.raises(XmcError):
        evaluate(PREDICTED.astype(float), TRUTH, ks=(1,))
    with pytest.raises(XmcError):
        evaluate(PREDICTED, TRUTH.toarray(), ks=(1,))
    with pytest.raises(XmcError):
        evaluate(PREDICTED, TRUTH, ks=())
    with pytest.raises(XmcError):
        evaluate(PREDICTED, TRUTH, ks=(0, 1))
    with pytest.raises(XmcError):
        evaluate(PREDICTED, TRUTH, ks=(1,), inv_propensity=np.ones(5))
    with pytest.raises(XmcError):
        evaluate(PREDICTED, TRUTH, ks=(1,), recalled_truth=csr([[0]], 6))


# Training documents per label of the hand example: label 0 seen once, 1 five times, 2 twice, 3 400 times,
# 4 2,000 times, 5 never (the unseen test label).
LABEL_COUNTS = np.array([1, 5, 2, 400, 2000, 0])


def test_frequency_bins_hand_example():
    bins = evaluate(PREDICTED, TRUTH, ks=(1, 3), inv_propensity=INV_PROP, label_counts=LABEL_COUNTS)["frequency_bins"]
    assert bins["k"] == 3
    by_name = {b["bin"]: b for b in bins["bins"]}
    assert list(by_name) == ["0", "1", "2-3", "4-10", "11-30", "31-100", "101-300", "301-1000", ">1000"]
    assert (by_name["2-3"]["min_count"], by_name["2-3"]["max_count"]) == (2, 3)
    assert (by_name[">1000"]["min_count"], by_name[">1000"]["max_count"]) == (1001, None)
    # P@3 contributions: 3 hits in all (doc0: label 2 in "2-3", label 0 in "1"; doc1: label 1 in "4-10"),
    # each 1 / (k N) = 1 / 9 of P@3
    assert by_name["1"]["P@3_contribution"] == pytest.approx(100 / 9)
    assert by_name["2-3"]["P@3_contribution"] == pytest.approx(100 / 9)
    assert by_name["4-10"]["P@3_contribution"] == pytest.approx(100 / 9)
    # PSP@3 contributions: hits weigh w2 = 3, w0 = 1, w1 = 2 over the ideal 12 (see test_psp_hand_example)
    assert by_name["2-3"]["PSP@3_contribution"] == pytest.approx(100 * 3 / 12)
    assert by_name["1"]["PSP@3_contribution"] == pytest.approx(100 * 1 / 12)
    assert by_name["4-10"]["PSP@3_contribution"] == pytest.approx(100 * 2 / 12)
    for name in ("0", "11-30", "31-100", "101-300", "301-1000", ">1000"):
        assert by_name[name]["P@3_contribution"] == 0.0 and by_name[name]["PSP@3_contribution"] == 0.0
    # one label of six in each of "0", "1", "2-3", "4-10", "301-1000", ">1000"
    assert [b["labels"] for b in bins["bins"]] == [1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert by_name["301-1000"]["label_share"] == pytest.approx(100 / 6) and by_name["31-100"]["label_share"] == 0.0
    # the 4 test positives (labels 0, 2, 1, 5): one each in "1", "2-3", "4-10" and "0" (never seen in training)
    assert [b["test_positive_share"] for b in bins["bins"]] == pytest.approx([25, 25, 25, 25, 0, 0, 0, 0, 0])
    # no propensities: no PSP contributions
    plain = evaluate(PREDICTED, TRUTH, ks=(1, 3), label_counts=LABEL_COUNTS)["frequency_bins"]["bins"]
    assert "PSP@3_contribution" not in plain[0] and plain[1]["P@3_contribution"] == pytest.approx(100 / 9)
    assert "frequency_bins" not in evaluate(PREDICTED, TRUTH, ks=(1, 3))
    with pytest.raises(XmcError, match=r"label_counts has shape \(5,\)"):
        evaluate(PREDICTED, TRUTH, ks=(1,), label_counts=LABEL_COUNTS[:5])
    with pytest.raises(XmcError, match="non-negative"):
        evaluate(PREDICTED, TRUTH, ks=(1,), label_counts=LABEL_COUNTS - 1)


def test_format_metrics():
    m = {"R@1": 1.0, "coverage": 99.5, "P@3": 55.1, "nDCG@3": 60.0, "P@1": 82.314, "P@10": 20.0, "PSP@1": 7.0}
    assert format_metrics(m) == "P@1 82.31  P@3 55.10  P@10 20.00  nDCG@3 60.00  PSP@1 7.00  R@1 1.00  coverage 99.50"
    assert format_metrics({}) == ""
    # what is not a number (the frequency bins, names) stays out of the line
    assert format_metrics({"P@1": 50.0, "frequency_bins": {"k": 5, "bins": []}, "dataset": "x"}) == "P@1 50.00"


# ---------------------------------------------------------------- property tests against brute force


def brute_force(predicted, truth_sets, ks, inv):
    """Pure-Python reference straight from the definitions."""
    n = len(truth_sets)
    out = {}
    for k in ks:
        p = ndcg = psp_num = psp_den = psn_num = psn_den = psr_num = psr_den = 0.0
        recalls = []
        for row, rel in zip(predicted, truth_sets):
            top = list(row[:k])
            hit = [1 if (l >= 0 and l in rel) else 0 for l in top]
            p += sum(hit) / k
            idcg = sum(1 / math.log2(r + 2) for r in range(min(k, len(rel))))
            dcg = sum(h / math.log2(r + 2) for r, h in enumerate(hit))
            ndcg += dcg / idcg if idcg else 0.0
            if rel:
                recalls.append(sum(hit) / len(rel))
            gains = [inv[l] if h else 0.0 for l, h in zip(top, hit)]
            ideal = sorted((inv[l] for l in rel), reverse=True)[:k]
            psp_num += sum(gains) / k
            psp_den += sum(ideal) / k
            psr_num += sum(gains) / max(len(rel), 1)
            psr_den += sum(ideal) / max(len(rel), 1)
            if idcg:
                psn_num += sum(g / math.log2(r + 2) for r, g in enumerate(gains)) / idcg
                psn_den += sum(g / math.log2(r + 2) for r, g in enumerate(ideal)) / idcg
        out[f"P@{k}"] = 100 * p / n
        out[f"nDCG@{k}"] = 100 * ndcg / n
        out[f"PSP@{k}"] = 100 * psp_num / psp_den if psp_den else 0.0
        out[f"PSnDCG@{k}"] = 100 * psn_num / psn_den if psn_den else 0.0
        out[f"R@{k}"] = 100 * sum(recalls) / len(recalls) if recalls else 0.0
        out[f"PSR@{k}"] = 100 * psr_num / psr_den if psr_den else 0.0
    return out


@st.composite
def problems(draw):
    num_labels = draw(st.integers(1, 8))
    num_predictable = draw(st.integers(1, num_labels))  # columns >= this are unseen-in-training labels
    num_docs = draw(st.integers(1, 6))
    ks = sorted(draw(st.sets(st.integers(1, 4), min_size=1, max_size=3)))
    width = draw(st.integers(max(ks), max(ks) + 2))
    truth_sets = [draw(st.sets(st.integers(0, num_labels - 1), max_size=num_labels)) for _ in range(num_docs)]
    predicted = []
    for _ in range(num_docs):
        row = draw(st.lists(st.integers(-1, num_predictable - 1), min_size=width, max_size=width))
        seen = set()
        # a ranking names each label once; repeats become empty slots
        predicted.append([-1 if (l in seen or seen.add(l)) else l for l in row])
    inv = draw(st.lists(st.floats(1.0, 10.0), min_size=num_labels, max_size=num_labels))
    values = [[draw(st.sampled_from([1.0, 0.5, 3.0])) for _ in s] for s in truth_sets]
    return num_labels, ks, truth_sets, np.array(predicted, dtype=np.int64), np.array(inv), values


@settings(max_examples=50, deadline=None)
@given(problems())
def test_evaluate_matches_brute_force(problem):
    num_labels, ks, truth_sets, predicted, inv, values = problem
    truth = csr([sorted(s) for s in truth_sets], num_labels, values=values)
    got = evaluate(predicted, truth, ks=ks, inv_propensity=inv)
    want = brute_force(predicted.tolist(), truth_sets, ks, inv.tolist())
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-9), key
        assert 0.0 <= got[key] <= 100.0 + 1e-9, key


@settings(max_examples=50, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_evaluate_invariant_to_label_renaming(problem, rnd):
    num_labels, ks, truth_sets, predicted, inv, _ = problem
    perm = list(range(num_labels))
    rnd.shuffle(perm)
    perm = np.array(perm)
    renamed_pred = np.where(predicted >= 0, perm[np.maximum(predicted, 0)], -1)
    renamed_truth = csr([[int(perm[l]) for l in s] for s in truth_sets], num_labels)
    renamed_inv = np.empty_like(inv)
    renamed_inv[perm] = inv
    a = evaluate(predicted, csr([sorted(s) for s in truth_sets], num_labels), ks=ks, inv_propensity=inv)
    b = evaluate(renamed_pred, renamed_truth, ks=ks, inv_propensity=renamed_inv)
    assert a == pytest.approx(b, abs=1e-9)


@settings(max_examples=50, deadline=None)
@given(problems(), st.lists(st.integers(0, 3000), min_size=8, max_size=8))
def test_frequency_bin_contributions_sum_to_p_and_psp(problem, counts):
    num_labels, ks, truth_sets, predicted, inv, _ = problem
    truth = csr([sorted(s) for s in truth_sets], num_labels)
    m = evaluate(predicted, truth, ks=ks, inv_propensity=inv, label_counts=np.array(counts[:num_labels]))
    k, bins = m["frequency_bins"]["k"], m["frequency_bins"]["bins"]
    assert k == max(ks)
    assert sum(b[f"P@{k}_contribution"] for b in bins) == pytest.approx(m[f"P@{k}"], abs=1e-9)
    assert sum(b[f"PSP@{k}_contribution"] for b in bins) == pytest.approx(m[f"PSP@{k}"], abs=1e-9)
    assert sum(b["labels"] for b in bins) == num_labels
    assert sum(b["label_share"] for b in bins) == pytest.approx(100.0)
    if truth.nnz:
        assert sum(b["test_positive_share"] for b in bins) == pytest.approx(100.0)
