"""Ensembles of saved runs: the combination rule, the ensemble directory, predict and evaluate on it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse
from safetensors.numpy import load_file
from typer.testing import CliRunner

from xmcbench import ensemble
from xmcbench import fusion as fusion_rules
from xmcbench import saved as saved_models
from xmcbench.cli import app
from xmcbench.config import TrainConfig
from xmcbench.data import load_dataset_from_path
from xmcbench.errors import XmcError
from xmcbench.metrics import evaluate, format_metrics
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset
from xmcbench.runs import launch
from xmcbench.rundir import save_validation_predictions, VALIDATION_PREDICTIONS_FILE
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import split_train_rows
from xmcbench.scoring import remap_labels

cli = CliRunner()
slow = pytest.mark.slow


# -- the rule, on a hand-made example ---------------------------------------------------------------

def test_combine_sums_scores_over_the_union_of_the_members_top_k():
    a_labels = np.array([[3, 1, 0], [7, -1, -1], [-1, -1, -1]])
    a_scores = np.array([[0.9, 0.5, 0.45], [0.5, -1, -1], [-1, -1, -1]], dtype=np.float32)
    b_labels = np.array([[1, 4, 0], [6, -1, -1], [-1, -1, -1]])
    b_scores = np.array([[0.6, 0.55, 0.4], [0.5, -1, -1], [-1, -1, -1]], dtype=np.float32)

    labels, scores = fusion_rules.combine([a_labels, b_labels], [a_scores, b_scores], top_k=3)
    # row 0: 1 -> .5 + .6, 3 -> .9, 0 -> .45 + .4, 4 -> .55 (fourth: cut); row 1: a tie, lower id first;
    # row 2: nothing predicted, nothing returned
    np.testing.assert_array_equal(labels, [[1, 3, 0], [6, 7, -1], [-1, -1, -1]])
    np.testing.assert_allclose(scores, [[1.1, 0.9, 0.85], [0.5, 0.5, -1], [-1, -1, -1]], rtol=1e-6)
    assert labels.dtype == np.int64 and scores.dtype == np.float32

    # with k = 2 label 0 is outside both members' top-2: it counts 0 for each and drops out; 4 comes in
    labels, scores = fusion_rules.combine([a_labels, b_labels], [a_scores, b_scores], top_k=2)
    np.testing.assert_array_equal(labels[0], [1, 3])
    labels, scores = fusion_rules.combine([a_labels[:, :2], b_labels[:, :2]], [a_scores[:, :2], b_scores[:, :2]], top_k=3)
    np.testing.assert_array_equal(labels, [[1, 3, 4], [6, 7, -1], [-1, -1, -1]])
    np.testing.assert_allclose(scores[0], [1.1, 0.9, 0.55], rtol=1e-6)


# -- weighted fusion, on constructed validation predictions ----------------------------------------

def constructed_members(seed=0, num_docs=80, num_labels=40, k=5):
    """Truth of num_docs validation documents and two members' top-k lists on them: "good" ranks each
    document's true labels first (sigmoid-like scores in (0, 1)), "noise" ranks random labels (SVM-like
    margins in about [-10, 10])."""
    rng = np.random.default_rng(seed)
    truth_sets = [rng.choice(num_labels, size=rng.integers(1, 4), replace=False) for _ in range(num_docs)]
    truth = scipy.sparse.csr_matrix((np.ones(sum(len(t) for t in truth_sets)),
                                     (np.repeat(np.arange(num_docs), [len(t) for t in truth_sets]),
                                      np.concatenate(truth_sets))), shape=(num_docs, num_labels))
    good = np.array([list(t) + [l for l in rng.permutation(num_labels) if l not in t][:k - len(t)]
                     for t in truth_sets])
    good_scores = -np.sort(-rng.uniform(0.05, 0.95, size=(num_docs, k)), axis=1)
    noise = np.array([rng.permutation(num_labels)[:k] for _ in range(num_docs)])
    noise_scores = -np.sort(-rng.normal(0, 4, size=(num_docs, k)), axis=1)
    return truth, [good, noise], [good_scores, noise_scores]


def test_weighted_fusion_gives_the_weight_to_the_member_that_is_right_on_validation():
    truth, labels, scores = constructed_members()
    inv_propensity = np.ones(truth.shape[1])
    quantiles = [fusion_rules.score_quantiles(l, s, 5) for l, s in zip(labels, scores)]
    normalised = [fusion_rules.normalise(s, q) for s, q in zip(scores, quantiles)]
    weights, chosen, tried = fusion_rules.choose_weights(labels, normalised, truth, inv_propensity, top_k=5)
    # the noise can only displace the good member's filler labels at a small weight: ties go to the weights
    # closest to equal, so the noise keeps a little weight, never more than the good member's objective allows
    assert tried == 19 and weights[0] >= 0.8 and weights[1] <= 0.2 and sum(weights) == pytest.approx(1.0)
    assert chosen["P@1"] == pytest.approx(100.0)
    # the noise adds nothing, so the best the fusion can do is to tie the good member: a lead of 0
    assert chosen["objective"] == pytest.approx(0.0)
    # the members swapped: the weights follow the member, not the position
    swapped, _, _ = fusion_rules.choose_weights(labels[::-1], normalised[::-1], truth, inv_propensity, top_k=5)
    assert swapped == weights[::-1]


def test_the_objective_is_the_smallest_lead_over_any_member_in_p1_or_psp5():
    alone = [{"P@1": 90.0, "PSP@5": 60.0}, {"P@1": 85.0, "PSP@5": 62.0}]
    assert fusion_rules.objective({"P@1": 91.0, "PSP@5": 62.5}, alone) == pytest.approx(0.5)
    assert fusion_rules.objective({"P@1": 92.0, "PSP@5": 61.0}, alone) == pytest.approx(-1.0), "behind in PSP@5"

    # two true labels per document, a (frequent) and b (rare). Member "precise" ranks a first on 4 documents in 5 and
    # second on the fifth, and never finds b; member "broad" ranks a first on 3 in 5 (the fifth among them) and
    # always finds b, third. Where w, precise's weight, lies in (0.5, 0.8), a fifth-document a is first as well:
    # every a is first, so the fusion beats precise in P@1 and PSP@5 (b) and broad in both (the a it misses)
    num_docs = 100
    # (fillers take the lower ids, so a tie of scores, which goes to the lower id, never favours a)
    a, b, filler = 300 + np.arange(num_docs), 400 + np.arange(num_docs), 3 * np.arange(num_docs)
    truth = scipy.sparse.csr_matrix((np.ones(2 * num_docs), (np.repeat(np.arange(num_docs), 2),
                                                             np.stack([a, b], 1).ravel())), shape=(num_docs, 500))
    empty = np.full(num_docs, -1)
    precise_first = np.arange(num_docs) % 5 != 0
    broad_first = np.arange(num_docs) % 5 <= 2
    precise = np.stack([np.where(precise_first, a, filler), np.where(precise_first, filler, a), empty, empty, empty], 1)
    broad = np.stack([np.where(broad_first, a, filler + 1), filler + 2, b, empty, empty], 1)
    normalised = [np.tile([1.0, 0.75, 0.0, 0.0, 0.0], (num_docs, 1)),
                  np.tile([1.0, 0.75, 0.5, 0.0, 0.0], (num_docs, 1))]
    inv_propensity = np.where(np.arange(500) >= 400, 3.0, 1.0)
    weights, chosen, _ = fusion_rules.choose_weights([precise, broad], normalised, truth, inv_propensity, top_k=5)
    alone = fusion_rules.members_alone([precise, broad], truth, inv_propensity)
    assert alone[0]["P@1"] == pytest.approx(80.0) and alone[1]["P@1"] == pytest.approx(60.0)
    assert chosen["P@1"] == pytest.approx(100.0) and chosen["PSP@5"] > max(member["PSP@5"] for member in alone)
    assert chosen["objective"] == pytest.approx(fusion_rules.objective(chosen, alone)) and chosen["objective"] > 0
    assert 0.5 < weights[0] < 0.8


def members_right_in_different_bins(num_docs=120, num_labels=40, k=5):
    """Labels 0-19 are the tail (bin 0), 20-39 the head (bin 2); every document has one true label of each. Member
    "tail" is right in the tail only: it ranks a wrong head label first and the true tail label second; member
    "head" the other way round. Under one weight per member a wrong label is always first; weights per bin can
    silence each member where it is wrong."""
    rng = np.random.default_rng(0)
    tail_truth, head_truth = rng.integers(0, 20, num_docs), rng.integers(20, 40, num_docs)
    truth = scipy.sparse.csr_matrix((np.ones(2 * num_docs), (np.repeat(np.arange(num_docs), 2),
                                                             np.stack([tail_truth, head_truth], 1).ravel())),
                                    shape=(num_docs, num_labels))

    def member(right, wrong_pool, avoid):
        wrong = [[label for label in rng.permutation(wrong_pool) if label != bad][:k - 1] for bad in avoid]
        labels = np.array([[w[0], r, *w[1:]] for r, w in zip(right, wrong)])
        return labels, np.tile(np.linspace(0.9, 0.5, k), (num_docs, 1))

    tail = member(tail_truth, np.arange(20, 40), head_truth)
    head = member(head_truth, np.arange(0, 20), tail_truth)
    label_bins = np.repeat([0, 2], 20)
    return truth, [tail[0], head[0]], [tail[1], head[1]], label_bins


def test_weights_per_bin_take_each_member_where_it_is_right():
    truth, labels, scores, label_bins = members_right_in_different_bins()
    inv_propensity = np.ones(truth.shape[1])
    normalised = [fusion_rules.normalise(s, fusion_rules.score_quantiles(l, s, 5)) for l, s in zip(labels, scores)]
    weights, chosen, _ = fusion_rules.choose_weights(labels, normalised, truth, inv_propensity, top_k=5)
    table, per_bin, evaluations = fusion_rules.choose_bin_weights(labels, normalised, truth, inv_propensity, 5, None,
                                                              label_bins, weights, searched=[[0], [2]])
    assert chosen["P@1"] == 0.0 and per_bin["P@1"] == 100.0 and per_bin["objective"] > chosen["objective"] + 10
    # the first change that makes every first label right is kept (a later one must score better still)
    assert table[0, 0] > table[1, 0] or table[1, 2] > table[0, 2], "a member leads the bin where it is right"
    assert np.allclose(table[:, 1], weights), "a bin that is not searched keeps the one weight per member"
    assert evaluations > 1

    # the fused scores: a label's terms take its bin's weights
    rule = fusion_rules.Fusion("weighted", weights, [fusion_rules.score_quantiles(l, s, 5) for l, s in zip(labels, scores)],
                           bin_weights=table.T.tolist(), label_bins=label_bins)
    fused_labels, _ = fusion_rules.fuse(labels, scores, 5, rule)
    metrics = evaluate(fused_labels, truth, ks=(1, 5), inv_propensity=inv_propensity)
    alone = fusion_rules.members_alone(labels, truth, inv_propensity)
    assert fusion_rules.objective(metrics, alone) == pytest.approx(per_bin["objective"])
    terms = fusion_rules.weighted_scores(labels, normalised, table, None, label_bins)
    first = labels[0][0, 0]
    assert terms[0][0, 0] == pytest.approx(table[0, label_bins[first]] * normalised[0][0, 0])

    # ensemble.json keeps them; a damaged table is refused in one line
    spec = json.loads(json.dumps(rule.to_json()))
    again = fusion_rules.Fusion.from_json(spec, 2, Path("ensemble.json"))
    assert again.bin_weights == rule.bin_weights and again.label_bins.tolist() == label_bins.tolist()
    for damaged in ({**spec, "bin_weights": [[1.0]]}, {**spec, "label_bins": [7] * 40},
                    {key: value for key, value in spec.items() if key != "label_bins"}):
        with pytest.raises(XmcError, match="damaged"):
            fusion_rules.Fusion.from_json(damaged, 2, Path("ensemble.json"))


def test_a_bin_short_of_validation_positives_shares_its_neighbours_weights():
    minimum = fusion_rules.MIN_BIN_POSITIVES
    # debian-debtags: 18 validation positives of labels with at most 3 training documents, 427 of 4-100, 8,489 more
    assert fusion_rules.weight_bin_groups([18, 427, 8489]) == [[0, 1], [2]]
    assert fusion_rules.weight_bin_groups([minimum, minimum, minimum]) == [[0], [1], [2]]
    assert fusion_rules.weight_bin_groups([minimum, 10, 10]) == [[0, 1, 2]], "a short head joins toward the tail"
    assert fusion_rules.weight_bin_groups([10, 10, 10]) == []
    assert [fusion_rules.weight_group_name(group) for group in ([0], [1], [2], [0, 1], [1, 2], [0, 1, 2])] == \
        ["0-3", "4-100", ">100", "0-100", ">3", "all"]

    # the tail member is right on labels 0-19: labels 0-1 (bin 0) take the weights the group with bin 1 earns
    truth, labels, scores, label_bins = members_right_in_different_bins()
    label_bins = np.where(np.arange(40) < 2, 0, np.where(np.arange(40) < 20, 1, 2))
    inv_propensity = np.ones(truth.shape[1])
    normalised = [fusion_rules.normalise(s, fusion_rules.score_quantiles(l, s, 5)) for l, s in zip(labels, scores)]
    weights, _, _ = fusion_rules.choose_weights(labels, normalised, truth, inv_propensity, top_k=5)
    table, _, _ = fusion_rules.choose_bin_weights(labels, normalised, truth, inv_propensity, 5, None, label_bins,
                                                  weights, searched=[[0, 1], [2]])
    assert np.allclose(table[:, 0], table[:, 1]) and table[0, 0] > table[1, 0]

    # the log and the report name a group once
    bins = [{"training_documents": name, "weights_shared_by": group}
            for name, group in zip(fusion_rules.WEIGHT_BIN_NAMES, ("0-100", "0-100", ">100"))]
    rule = fusion_rules.Fusion("weighted", weights, [np.zeros(1)] * 2, {"member_methods": ["tail", "head"], "bins": bins},
                               bin_weights=table.T.tolist(), label_bins=label_bins)
    described = fusion_rules.describe_weights(rule)
    assert described.startswith("0-100 training documents: tail ") and described.count("training documents") == 2
    older = [{"training_documents": name} for name in fusion_rules.WEIGHT_BIN_NAMES]   # recorded before groups
    assert [name for name, _ in fusion_rules.shared_bin_weights(older, table.T.tolist())] == ["0-3", "4-100", ">100"]


def test_candidate_features_list_each_label_once_with_what_each_member_says_of_it():
    labels = [np.array([[1, 2, -1]]), np.array([[2, 3, 1]])]
    normalised = [np.array([[0.9, 0.5, 0.0]]), np.array([[0.8, 0.4, 0.1]])]
    depth = fusion_rules.label_depth(np.array([0, 9, 99, 999]))                     # 0, 1, 2, 3
    ids, features = fusion_rules.candidate_features(labels, normalised, depth)
    np.testing.assert_array_equal(ids, [[1, 2, -1, -1, 3, -1]])                     # repeats and empties: -1
    assert features.shape == (1, 6, len(fusion_rules.stacking_feature_names(2))) == (1, 6, 10)
    # label 2 (depth 2): member 1 scores it 0.5, member 2 0.8; label 3 (depth 3) only member 2, at 0.4
    np.testing.assert_allclose(features[0, 1], [0.5, 1, 1.0, 2, 0.8, 1, 1.6, 2, 2, 4])
    np.testing.assert_allclose(features[0, 4], [0, 0, 0, 0, 0.4, 1, 1.2, 3, 3, 9])
    assert not features[0, [2, 3, 5]].any()


def test_stacked_ranking_in_blocks_of_rows_ranks_as_in_one(monkeypatch):
    # many documents at a deep --top-k are ranked a block of rows at a time; the blocks must not change the ranking
    rng = np.random.default_rng(0)
    labels = [rng.integers(-1, 40, (50, 8)) for _ in range(3)]
    normalised = [rng.random((50, 8)) for _ in range(3)]
    depth = fusion_rules.label_depth(rng.integers(0, 500, 40))
    stacking = {"coefficients": list(rng.normal(size=14)), "intercept": 0.2, "alpha": 0.5}
    log_inverse = np.log(1 + rng.random(40))
    whole = fusion_rules.stacked_ranking(labels, normalised, stacking, depth, log_inverse, 10)
    whole_features = fusion_rules.candidate_features(labels, normalised, depth)
    monkeypatch.setattr(fusion_rules, "STACKING_BLOCK_ELEMENTS", 100)
    blocks = fusion_rules.stacked_ranking(labels, normalised, stacking, depth, log_inverse, 10)
    for expected, found in zip((*whole, *whole_features),
                               (*blocks, *fusion_rules.candidate_features(labels, normalised, depth))):
        np.testing.assert_array_equal(found, expected)
    assert whole[0].shape == (50, 10) and (whole[0][:, 0] >= 0).all()


def test_stacking_learns_which_member_to_trust_at_which_label_frequency():
    # each member is right on its own labels only (at rank 2) and wrong at rank 1: one weight per member, or a
    # weighted sum, always puts a wrong label first; the stacked model reads the labels' training documents
    truth, labels, scores, label_bins = members_right_in_different_bins()
    inv_propensity = np.ones(truth.shape[1])
    quantiles = [fusion_rules.score_quantiles(l, s, 5) for l, s in zip(labels, scores)]
    normalised = [fusion_rules.normalise(s, q) for s, q in zip(scores, quantiles)]
    depth = fusion_rules.label_depth(np.where(label_bins == 0, 2, 500))
    _, chosen, _ = fusion_rules.choose_weights(labels, normalised, truth, inv_propensity, top_k=5)
    stacking, validation, tried = fusion_rules.fit_stacking(labels, normalised, truth, inv_propensity, 5, depth)
    assert chosen["P@1"] == 0.0 and validation["P@1"] == 100.0 and validation["objective"] > chosen["objective"] + 10
    assert tried == len(fusion_rules.STACKING_ALPHAS) and stacking["alpha"] in fusion_rules.STACKING_ALPHAS
    assert len(stacking["coefficients"]) == len(stacking["features"]) == 10

    # fuse() ranks with it, from the members' raw scores, as fit_stacking scored it
    rule = fusion_rules.Fusion("stacked", [0.5, 0.5], quantiles, {"member_methods": ["tail", "head"]},
                               stacking=stacking, label_depth=depth,
                               label_log_inverse_propensity=np.log(inv_propensity))
    fused, values = fusion_rules.fuse(labels, scores, 5, rule)
    metrics = evaluate(fused, truth, ks=(1, 5), inv_propensity=inv_propensity)
    assert metrics["P@1"] == validation["P@1"] and metrics["PSP@5"] == pytest.approx(validation["PSP@5"])
    assert np.all(np.diff(values, axis=1) <= 0) and values.dtype == np.float32
    assert fusion_rules.describe_weights(rule).startswith("a stacked model")

    # ensemble.json keeps it; a damaged one is refused in one line
    spec = json.loads(json.dumps(rule.to_json()))
    again = fusion_rules.Fusion.from_json(spec, 2, Path("ensemble.json"))
    assert again.rule == "stacked" and again.stacking == rule.stacking and np.allclose(again.label_depth, depth)
    np.testing.assert_array_equal(fusion_rules.fuse(labels, scores, 5, again)[0], fused)
    for damaged in ({**spec, "stacking": {**spec["stacking"], "coefficients": [1.0]}},
                    {**spec, "stacking": {**spec["stacking"], "alpha": "much"}},
                    {key: value for key, value in spec.items() if key != "label_depth"},
                    {**spec, "label_log_inverse_propensity": [0.0]},
                    {**spec, "rule": "weighted"},
                    {key: value for key, value in spec.items()
                     if key not in ("stacking", "label_depth", "label_log_inverse_propensity")}):
        with pytest.raises(XmcError, match="damaged"):
            fusion_rules.Fusion.from_json(damaged, 2, Path("ensemble.json"))


def test_stacking_needs_enough_relevant_candidates_to_fit():
    truth, labels, scores, label_bins = members_right_in_different_bins(num_docs=20)   # 40 positives
    normalised = [fusion_rules.normalise(s, fusion_rules.score_quantiles(l, s, 5)) for l, s in zip(labels, scores)]
    assert fusion_rules.fit_stacking(labels, normalised, truth, np.ones(truth.shape[1]), 5,
                                     fusion_rules.label_depth(np.ones(40))) is None


def fit_constructed_fusion(monkeypatch, rule, counts, num_docs=120, extra_label=False):
    """fit_fusion on members_right_in_different_bins' validation rows, its labels given `counts` training
    documents; extra_label: the second member's vocabulary holds one more label (a zero-shot one)."""
    truth, labels, scores, _ = members_right_in_different_bins(num_docs=num_docs)
    names = [f"label{i}" for i in range(truth.shape[1])]
    members = [ensemble.Member(Path("tail"), {"method": "tail"}, names, ""),
               ensemble.Member(Path("head"), {"method": "head"}, names + ["unseen"] * extra_label, "")]
    dataset = SimpleNamespace(train_labels=truth, label_names=names)
    monkeypatch.setattr(ensemble, "_validation_predictions",
                        lambda *_: (labels, scores, np.arange(truth.shape[0])))
    monkeypatch.setattr(ensemble, "training_counts",
                        lambda _, num_labels: np.concatenate([counts, np.zeros(num_labels - len(counts), int)]))
    monkeypatch.setattr(ensemble, "scoring_config", lambda _: None)
    monkeypatch.setattr(ensemble, "propensities", lambda _, __, found: SimpleNamespace(inverse=np.ones(len(found))))
    return ensemble.fit_fusion(members, dataset, 5, rule)


def test_weighted_fusion_keeps_the_stacked_model_where_it_scores_better_on_validation(monkeypatch):
    # each member is right on its own labels, 5 and 90 training documents: one weight bin (4-100), so no weights
    # separate them, and the stacked model reads the labels' depth
    counts = np.repeat([5, 90], 20)
    fusion = fit_constructed_fusion(monkeypatch, "weighted", counts)
    assert fusion.rule == "stacked" and fusion.record["stacked_model_chosen"].startswith("yes")
    assert fusion.record["validation"]["P@1"] == 100.0 and fusion.record["validation_weights"]["P@1"] == 0.0
    assert fusion.weights is not None, "the weights the rule chose first are kept beside the stacked model"
    # with the stacked model asked for, the same model, without the choice
    asked = fit_constructed_fusion(monkeypatch, "stacked", counts)
    assert asked.rule == "stacked" and "stacked_model_chosen" not in asked.record
    assert asked.stacking == fusion.stacking


def test_weighted_fusion_keeps_its_weights_where_the_stacked_model_cannot_be_fitted_or_read(monkeypatch):
    counts = np.repeat([5, 90], 20)
    few = fit_constructed_fusion(monkeypatch, "weighted", counts, num_docs=20)        # 40 validation positives
    assert few.rule == "weighted" and few.record["stacked_model_chosen"].startswith("no: the validation rows hold")
    nested = fit_constructed_fusion(monkeypatch, "weighted", counts, extra_label=True)
    assert nested.rule == "weighted" and "vocabularies differ" in nested.record["stacked_model_chosen"]
    # weights per bin that already make every first label right leave the stacked model nothing to add
    separable = fit_constructed_fusion(monkeypatch, "weighted", np.repeat([2, 500], 20))
    assert separable.rule == "weighted" and separable.bin_weights is not None
    assert separable.record["stacked_model_chosen"].startswith("no: the stacked model did not score better")
    assert separable.record["validation_stacked_model"]["objective"] <= separable.record["validation"]["objective"]


def test_weights_per_bin_keep_a_zero_shot_label_its_score():
    # member 1 knows 4 labels, member 2 also a fifth (a zero-shot label, in bin 0); bin 0 weighs member 1 at 0.9
    labels = [np.array([[0, 1]]), np.array([[4, 0]])]
    normalised = [np.array([[0.8, 0.6]]), np.array([[0.7, 0.5]])]
    table = np.array([[0.9, 0.5], [0.1, 0.5]])                          # (members, bins)
    label_bins = np.array([1, 0, 0, 0, 0])
    terms = fusion_rules.weighted_scores(labels, normalised, table, [4, 5], label_bins)
    assert terms[1][0, 0] == pytest.approx(0.7), "label 4: member 2 alone scores it, its score is kept whole"
    assert terms[0][0, 0] == pytest.approx(0.5 * 0.8) and terms[1][0, 1] == pytest.approx(0.5 * 0.5)


def test_normalisation_makes_the_scale_of_a_member_irrelevant():
    truth, labels, scores = constructed_members(seed=1)
    test_truth, test_labels, test_scores = constructed_members(seed=2)

    def fused(factor):
        member_scores = [scores[0], scores[1] * factor]         # validation, member 2 rescaled
        member_test_scores = [test_scores[0], test_scores[1] * factor]   # and its test scores alike
        quantiles = [fusion_rules.score_quantiles(l, s, 5) for l, s in zip(labels, member_scores)]
        rule = fusion_rules.Fusion("weighted", [0.5, 0.5], quantiles)
        return fusion_rules.fuse(test_labels, member_test_scores, 5, rule)

    plain_labels, plain_scores = fused(1.0)
    scaled_labels, scaled_scores = fused(1000.0)
    np.testing.assert_array_equal(plain_labels, scaled_labels)
    np.testing.assert_allclose(plain_scores, scaled_scores, rtol=1e-6)
    assert np.all((plain_scores >= 0) & (plain_scores <= 1))
    # the paper's sum, by contrast, is taken over by the member with the larger scale
    summed, _ = fusion_rules.fuse(test_labels, [test_scores[0], test_scores[1] * 1000], 5, fusion_rules.Fusion())
    assert (summed[:, 0] == test_labels[1][:, 0]).mean() > 0.9


def test_normalise_is_the_validation_distribution_function():
    quantiles = np.array([0.0, 1.0, 1.0, 1.0, 2.0])   # a run of ties counts at its middle
    np.testing.assert_allclose(fusion_rules.normalise(np.array([-5.0, 0.0, 0.5, 1.0, 2.0, 9.0]), quantiles),
                               [0.0, 0.0, 0.25, 0.5, 1.0, 1.0])
    assert fusion_rules.normalise(np.array([3.0, -3.0]), np.array([7.0])).tolist() == [0.5, 0.5]
    # steps of 1/20, each member at least one: 19 splits for two members; 171 for three, plus equal thirds, which
    # twentieths miss; four members in tenths (84 and equal quarters)
    assert len(fusion_rules.weight_grid(2)) == 19 and len(fusion_rules.weight_grid(3)) == 172
    assert len(fusion_rules.weight_grid(4)) == 85
    assert all(sum(w) == pytest.approx(1.0) and min(w) > 0 for w in fusion_rules.weight_grid(7))
    assert len(fusion_rules.weight_grid(7)) <= fusion_rules.MAX_GRID_POINTS and (1 / 7,) * 7 in fusion_rules.weight_grid(7)


# -- tiny runs --------------------------------------------------------------------------------------

def tiny_options(model_dir):
    options = {"model_name": str(model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
               "batch_size": 8, "max_length": 32, "threads": 1, "cluster_size": 2, "top_clusters": 2,
               "hidden_size": 8, "lr": 1e-3}
    return [f"{k}={v}" for k, v in options.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Two runs (seeds 1, 2) on one tiny dataset and one on a dataset with another label vocabulary."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        registry = build_registry()
        root = tmp_path_factory.mktemp("ensemble-runs")
        dataset = write_tiny_dataset(root / "tiny-topics")
        other = write_tiny_dataset(root / "other-topics", seed=1)
        for split in ("train", "test"):
            path = other / f"{split}_labels.txt"
            path.write_text(path.read_text().replace("db:sql", "db:sqlite"))

        def train(data, seed, name):
            plan = plan_run(registry, "lightxml", str(data), set_options=tiny_options(tiny_model_dir),
                                   seed=seed)
            return launch.run(plan, root / name, registry=registry, log=lambda line: None)

        yield {"dataset": dataset, "registry": registry, "root": root,
               "members": [train(dataset, 1, "seed1"), train(dataset, 2, "seed2")],
               "other": train(other, 1, "other")}


@slow
def test_ensemble_metrics_from_saved_predictions_equal_evaluate_rescoring(runs, tmp_path):
    members, registry = runs["members"], runs["registry"]
    result = cli.invoke(app, ["ensemble", *map(str, members), "--output", str(tmp_path / "ens")])
    assert result.exit_code == 0, result.output
    directory = tmp_path / "ens"
    saved = json.loads((directory / "metrics.json").read_text())
    floats = {k: v for k, v in saved.items() if isinstance(v, float)}
    assert saved["metrics_from"] == "saved predictions" and saved["members"] == 2 and saved["top_k"] == 10
    assert format_metrics(floats) in result.stdout

    spec = json.loads((directory / "ensemble.json").read_text())
    assert spec["schema"] == 1 and spec["top_k"] == 10 and len(spec["members"]) == 2
    assert spec["fusion"]["rule"] == "sum" and saved["fusion"] == "sum" and "sum fusion" in result.stdout
    assert all(not m.startswith("/") for m in spec["members"])   # relative: the tree can move as a whole
    config = json.loads((directory / "config.json").read_text())
    assert config["method"] == "ensemble(lightxml+lightxml)"
    assert config["config"]["seed"] == 1 and config["resolved"]["member_seeds"] == [1, 2]
    timings = json.loads((directory / "timings.json").read_text())
    member_timings = [json.loads((m / "timings.json").read_text()) for m in members]
    assert timings["train_seconds"] == pytest.approx(sum(t["train_seconds"] for t in member_timings))
    assert timings["predict_ms_per_document"] == pytest.approx(sum(t["predict_ms_per_document"]
                                                                   for t in member_timings))

    # the saved ranking is the rule applied to the members' saved top-k
    member_predictions = [load_file(str(m / "predictions.safetensors")) for m in members]
    expected, _ = fusion_rules.combine([p["labels"] for p in member_predictions],
                                   [p["scores"] for p in member_predictions], 10)
    np.testing.assert_array_equal(load_file(str(directory / "predictions.safetensors"))["labels"], expected)

    # re-scoring by predicting with every member model gives the same metrics
    rescored = saved_models.evaluate(directory, registry=registry)
    assert {k: v for k, v in rescored.items() if isinstance(v, float)} == pytest.approx(floats)
    assert rescored["frequency_bins"] == saved["frequency_bins"] and rescored["propensity"] == saved["propensity"]
    result = cli.invoke(app, ["evaluate", str(directory)])
    assert result.exit_code == 0 and result.stdout.strip() == format_metrics(rescored)

    # building without usable saved predictions (top-k wider than saved) predicts; each member recalls
    # 2 clusters of 2 labels, so lists wider than 4 add nothing and the metrics are the same
    wider = ensemble.build_ensemble(members, tmp_path / "wider", top_k=12, registry=registry, log=lambda line: None)
    wider_metrics = json.loads((wider / "metrics.json").read_text())
    assert wider_metrics["metrics_from"] == "predicted"
    assert {k: v for k, v in wider_metrics.items() if isinstance(v, float)} == pytest.approx(floats)

    # an existing ensemble is replaced only when asked
    with pytest.raises(XmcError, match="already holds an ensemble"):
        ensemble.build_ensemble(members, directory, registry=registry, log=lambda line: None)
    ensemble.build_ensemble(members, directory, overwrite=True, registry=registry, log=lambda line: None)


@slow
def test_predict_with_an_ensemble_returns_k_labels_by_descending_score(runs, tmp_path):
    members, registry = runs["members"], runs["registry"]
    directory = ensemble.build_ensemble(members, tmp_path / "ens", registry=registry, log=lambda line: None)
    texts = (runs["dataset"] / "test_texts.txt").read_text().splitlines()
    results = saved_models.predict_texts(directory, texts, top_k=3, registry=registry)
    names = json.loads((members[0] / "model" / "labels.json").read_text())
    saved = load_file(str(directory / "predictions.safetensors"))
    assert len(results) == len(texts)
    for row, result in enumerate(results):
        assert len(result["labels"]) == 3 and len(set(result["labels"])) == 3
        assert result["scores"] == sorted(result["scores"], reverse=True)
        assert result["labels"] == [names[i] for i in saved["labels"][row][:3]]

    result = cli.invoke(app, ["predict", str(directory), "--top-k", "4"], input=texts[0] + "\n" + texts[1] + "\n")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 2 and all(len(line["labels"]) == 4 for line in lines)
    assert lines[0]["labels"][:3] == results[0]["labels"]


@slow
def test_members_with_another_label_vocabulary_fail_in_one_line(runs, tmp_path):
    members, other = runs["members"], runs["other"]
    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble([members[0], other], tmp_path / "ens", registry=runs["registry"])
    message = str(error.value)
    assert "\n" not in message and str(other) in message and "label vocabulary" in message
    assert not (tmp_path / "ens").exists()

    found = subprocess.run([sys.executable, "-m", "xmcbench", "ensemble", str(members[0]), str(other),
                            "--output", str(tmp_path / "ens")], capture_output=True, text=True)
    assert found.returncode == 2
    assert found.stderr.count("\n") == 1 and "label vocabulary" in found.stderr and str(other) in found.stderr


@slow
def test_an_unfinished_member_fails_in_one_line(runs, tmp_path):
    members = runs["members"]
    unfinished = tmp_path / "unfinished"
    shutil.copytree(members[1], unfinished)
    (unfinished / "metrics.json").unlink()
    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble([members[0], unfinished], tmp_path / "ens", registry=runs["registry"])
    message = str(error.value)
    assert "\n" not in message and str(unfinished) in message and "unfinished" in message


@slow
def test_a_member_that_changed_after_building_is_caught(runs, tmp_path):
    members, registry = runs["members"], runs["registry"]
    moved = [tmp_path / "a", tmp_path / "b"]
    for source, target in zip(members, moved):
        shutil.copytree(source, target)
    directory = ensemble.build_ensemble(moved, tmp_path / "ens", registry=registry, log=lambda line: None)
    shutil.rmtree(moved[1])
    shutil.copytree(runs["other"], moved[1])
    with pytest.raises(XmcError, match="label vocabulary"):
        saved_models.predict_texts(directory, ["python module"], registry=registry)
    with pytest.raises(XmcError, match="at least two runs"):
        ensemble.build_ensemble(moved[:1], tmp_path / "one", registry=registry)


# -- weighted fusion of tiny runs -------------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tiny_model_dir):
    """Two methods trained with one seed and validation split (a hybrid), and one with another seed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        registry = build_registry()
        root = tmp_path_factory.mktemp("hybrid-runs")
        dataset = write_tiny_dataset(root / "tiny-topics")

        def train(method, seed, name):
            plan = plan_run(registry, method, str(dataset), seed=seed,
                                   set_options=tiny_options(tiny_model_dir) + ["validation_size=8"])
            return launch.run(plan, root / name, registry=registry, log=lambda line: None)

        yield {"dataset": dataset, "registry": registry, "root": root,
               "members": [train("lightxml", 3, "lightxml-seed3"), train("lightxml-random-neg", 3, "random-seed3")],
               "other_seed": train("lightxml", 4, "lightxml-seed4")}


def validation_truth(member, dataset_folder, rows):
    """The validation rows' training labels in the member's label vocabulary."""
    dataset = load_dataset_from_path(dataset_folder)
    names = json.loads((member / "model" / "labels.json").read_text())
    return remap_labels(dataset.train_labels[rows], dataset.label_names, names)


@slow
def test_runs_save_validation_predictions_and_frequency_bins(hybrid):
    member = hybrid["members"][0]
    saved = load_file(str(member / VALIDATION_PREDICTIONS_FILE))
    config = TrainConfig.from_dict(json.loads((member / "config.json").read_text())["config"])
    _, validation_rows = split_train_rows(load_dataset_from_path(hybrid["dataset"]), config)
    assert saved["rows"].dtype == np.int64 and saved["rows"].tolist() == validation_rows.tolist()
    assert saved["labels"].shape == saved["scores"].shape == (8, 10)
    assert saved["labels"].dtype == np.int64 and saved["scores"].dtype == np.float32
    metrics = json.loads((member / "metrics.json").read_text())
    bins = metrics["frequency_bins"]
    assert bins["k"] == 5 and len(bins["bins"]) == 9
    assert sum(b["P@5_contribution"] for b in bins["bins"]) == pytest.approx(metrics["P@5"])
    assert sum(b["PSP@5_contribution"] for b in bins["bins"]) == pytest.approx(metrics["PSP@5"])
    assert sum(b["labels"] for b in bins["bins"]) == len(json.loads((member / "model" / "labels.json").read_text()))

    # an ensemble scores with the propensities every run uses, as its members scored themselves: the member's
    # own test predictions, scored as an ensemble's, give the member's metrics, PSP@5 and bins included
    dataset = load_dataset_from_path(hybrid["dataset"])
    members = [ensemble.read_member(path) for path in hybrid["members"]]
    scored = ensemble._score(load_file(str(member / "predictions.safetensors"))["labels"], dataset, members)
    assert {key: scored[key] for key in ("P@5", "PSP@5", "nDCG@5")} == \
        pytest.approx({key: metrics[key] for key in ("P@5", "PSP@5", "nDCG@5")})
    assert [b["PSP@5_contribution"] for b in scored["frequency_bins"]["bins"]] == \
        pytest.approx([b["PSP@5_contribution"] for b in bins["bins"]])


@slow
def test_weighted_ensemble_round_trip(hybrid, tmp_path):
    members = hybrid["members"]
    result = cli.invoke(app, ["ensemble", *map(str, members), "--fusion", "weighted",
                              "--output", str(tmp_path / "ens")])
    assert result.exit_code == 0, result.output
    directory = tmp_path / "ens"
    assert "weighted fusion: weights lightxml" in result.output and "weighted fusion, metrics from" in result.stdout
    spec = json.loads((directory / "ensemble.json").read_text())
    fusion = spec["fusion"]
    assert spec["schema"] == (5 if fusion["tail_slots"]["alpha"] > 0 else 2) and fusion["rule"] == "weighted"
    assert fusion["normalisation"] == "validation-quantiles" and fusion["tail_slots_chosen"]["alpha"] == \
        fusion["tail_slots"]["alpha"] in fusion_rules.TAIL_ALPHAS
    assert len(fusion["weights"]) == 2 and sum(fusion["weights"]) == pytest.approx(1.0)
    assert fusion["member_methods"] == ["lightxml", "lightxml-random-neg"] and fusion["validation_documents"] == 8
    assert fusion["objective"] == fusion_rules.FUSION_OBJECTIVE and len(fusion["quantiles"]) == 2
    # 8 validation documents hold too few relevant labels to fit the stacked model, and the record says so
    assert fusion["stacked_model_chosen"].startswith("no: the validation rows hold fewer than")
    config = json.loads((directory / "config.json").read_text())
    assert config["method"] == "weighted-ensemble(lightxml+lightxml-random-neg)"
    assert config["fusion"]["weights"] == fusion["weights"] and "quantiles" not in config["fusion"]

    assert ensemble.read_ensemble(directory).fusion.weights == fusion["weights"]
    metrics = json.loads((directory / "metrics.json").read_text())
    assert metrics["fusion"] == "weighted" and metrics["metrics_from"] == "saved predictions"
    assert_saved_ranking_is_served(directory, hybrid)


def assert_saved_ranking_is_served(directory, hybrid):
    """The saved ranking is the fusion, read back from ensemble.json, of the members' saved test top-k; evaluate
    (every member predicts again) and predict agree with it."""
    members, registry = hybrid["members"], hybrid["registry"]
    rule = ensemble.read_ensemble(directory).fusion
    member_predictions = [load_file(str(m / "predictions.safetensors")) for m in members]
    expected, _ = fusion_rules.fuse([p["labels"] for p in member_predictions], [p["scores"] for p in member_predictions],
                                    10, rule)
    saved = load_file(str(directory / "predictions.safetensors"))
    np.testing.assert_array_equal(saved["labels"], expected)
    metrics = json.loads((directory / "metrics.json").read_text())
    rescored = saved_models.evaluate(directory, registry=registry)
    assert {k: v for k, v in rescored.items() if isinstance(v, float)} == \
        pytest.approx({k: v for k, v in metrics.items() if isinstance(v, float)})
    assert rescored["propensity"] == metrics["propensity"]
    texts = (hybrid["dataset"] / "test_texts.txt").read_text().splitlines()
    names = json.loads((members[0] / "model" / "labels.json").read_text())
    found = saved_models.predict_texts(directory, texts, top_k=3, registry=registry)
    assert [r["labels"] for r in found] == [[names[i] for i in row[:3] if i >= 0] for row in saved["labels"]]


@slow
def test_a_stacked_ensemble_round_trip(hybrid, tmp_path, monkeypatch):
    members, registry = hybrid["members"], hybrid["registry"]
    # the tiny runs' 8 validation documents hold too few relevant labels to fit a stacked model: one line says so
    # and names the fix, and nothing is written
    result = cli.invoke(app, ["ensemble", *map(str, members), "--fusion", "stacked", "--output", str(tmp_path / "no")])
    message = str(result.exception)
    assert result.exit_code != 0 and isinstance(result.exception, XmcError) and "\n" not in message
    assert "--fusion stacked needs 100 relevant labels" in message and "validation_size" in message
    assert not (tmp_path / "no").exists()

    # allowed to fit on them, it goes through ensemble.json, evaluate, predict and the report
    monkeypatch.setattr(fusion_rules, "STACKING_MIN_POSITIVES", 1)
    directory = ensemble.build_ensemble(members, tmp_path / "ens", fusion="stacked", registry=registry,
                                        log=lambda line: None)
    spec = json.loads((directory / "ensemble.json").read_text())
    fusion = spec["fusion"]
    # schema 5 where the tail slots were chosen (alpha > 0), else 4
    assert spec["schema"] == (5 if fusion["tail_slots"]["alpha"] > 0 else 4) and fusion["rule"] == "stacked"
    assert fusion["stacking"]["alpha"] in fusion_rules.STACKING_ALPHAS
    assert json.loads((directory / "config.json").read_text())["method"] == \
        "stacked-ensemble(lightxml+lightxml-random-neg)"
    assert set(fusion["validation"]) == set(fusion["validation_weights"]) == {"P@1", "PSP@5", "objective"}
    assert len(fusion["label_depth"]) == len(fusion["label_log_inverse_propensity"]) == \
        len(json.loads((members[0] / "model" / "labels.json").read_text()))
    assert_saved_ranking_is_served(directory, hybrid)
    report = tmp_path / "report"
    result = cli.invoke(app, ["report", str(directory), *map(str, members), "--output", str(report)])
    assert result.exit_code == 0, result.output
    assert "a stacked model (a logistic regression" in (report / "report.md").read_text()

    # --fusion weighted keeps the same model where it scores better on validation (here made to: on 8 documents it
    # does not), under its own name, so the seeds of one hybrid stay one row whichever each keeps
    fit = ensemble.fit_stacking

    def scoring_better(*args):
        model, validation, tried = fit(*args)
        return model, {**validation, "objective": validation["objective"] + 100}, tried

    monkeypatch.setattr(ensemble, "fit_stacking", scoring_better)
    weighted = ensemble.build_ensemble(members, tmp_path / "weighted", fusion="weighted", registry=registry,
                                       log=lambda line: None)
    chosen = json.loads((weighted / "ensemble.json").read_text())
    assert chosen["fusion"]["stacked_model_chosen"].startswith("yes") and chosen["schema"] in (4, 5)
    assert chosen["fusion"]["stacking"] == fusion["stacking"]
    config = json.loads((weighted / "config.json").read_text())
    assert config["method"] == "weighted-ensemble(lightxml+lightxml-random-neg)"
    assert config["resolved"]["fusion"] == "stacked"
    report = tmp_path / "report-weighted"
    result = cli.invoke(app, ["report", str(weighted), "--output", str(report)])
    assert result.exit_code == 0, result.output
    assert "a stacked model fitted on" in (report / "report.md").read_text()

    # an xmcbench that predates stacking refuses it in one line instead of fusing with the weights alone
    monkeypatch.setattr(ensemble, "SCHEMA_VERSION", 3)
    with pytest.raises(XmcError, match=f"schema {spec['schema']} but this xmcbench reads 3"):
        ensemble.read_ensemble(directory)


@slow
def test_an_ensemble_with_tail_slots_round_trip(hybrid, tmp_path, monkeypatch):
    # the tiny runs' validation rows need not favour tail slots: offer alpha 1 alone, so the fit takes it
    members, registry = hybrid["members"], hybrid["registry"]
    monkeypatch.setattr(fusion_rules, "TAIL_ALPHAS", (1.0,))
    directory = ensemble.build_ensemble(members, tmp_path / "ens", fusion="weighted", registry=registry,
                                        log=lambda line: None)
    spec = json.loads((directory / "ensemble.json").read_text())
    fusion = spec["fusion"]
    assert spec["schema"] == 5 and fusion["tail_slots"] == {"after": fusion_rules.TAIL_SLOTS_AFTER, "alpha": 1.0}
    assert len(fusion["label_log_inverse_propensity"]) == \
        len(json.loads((members[0] / "model" / "labels.json").read_text()))
    assert fusion["validation_before_tail_slots"].keys() == fusion["validation"].keys()
    read = ensemble.read_ensemble(directory).fusion
    assert read.tail_alpha == 1.0 and read.tail_after == fusion_rules.TAIL_SLOTS_AFTER
    assert_saved_ranking_is_served(directory, hybrid)
    saved = load_file(str(directory / "predictions.safetensors"))
    scores = np.where(saved["labels"] >= 0, saved["scores"], np.finfo(np.float32).min)
    assert np.all(np.diff(scores, axis=1) <= 0), "the places keep descending scores"
    # an xmcbench that predates tail slots refuses the ensemble instead of ranking it without them
    monkeypatch.setattr(ensemble, "SCHEMA_VERSION", 4)
    with pytest.raises(XmcError, match="schema 5 but this xmcbench reads 4"):
        ensemble.read_ensemble(directory)


@slow
def test_weighted_fusion_chooses_weights_on_validation_and_ignores_scale(hybrid, tmp_path):
    from safetensors.numpy import save_file

    good, noisy = tmp_path / "good", tmp_path / "noisy"
    shutil.copytree(hybrid["members"][0], good)
    shutil.copytree(hybrid["members"][1], noisy)
    saved = load_file(str(good / VALIDATION_PREDICTIONS_FILE))
    rows = saved["rows"]
    truth = validation_truth(good, hybrid["dataset"], rows)
    labels = np.full((len(rows), 10), -1, dtype=np.int64)
    scores = np.full((len(rows), 10), -1.0, dtype=np.float32)
    for row in range(len(rows)):   # "good" knows each validation document's labels
        true = truth[row].indices
        labels[row, :len(true)] = true
        scores[row, :len(true)] = np.linspace(0.9, 0.6, len(true))
    save_validation_predictions(good / VALIDATION_PREDICTIONS_FILE, labels, scores, rows)
    rng = np.random.default_rng(0)   # "noisy" ranks every label (8 of them) at random, with SVM-like margins
    num_labels = len(json.loads((noisy / "model" / "labels.json").read_text()))
    noise = np.full((len(rows), 10), -1, dtype=np.int64)
    noise[:, :num_labels] = [rng.permutation(num_labels) for _ in rows]
    noise_scores = np.full((len(rows), 10), -1.0, dtype=np.float32)
    noise_scores[:, :num_labels] = -np.sort(-rng.normal(0, 3, size=(len(rows), num_labels)), axis=1)
    save_validation_predictions(noisy / VALIDATION_PREDICTIONS_FILE, noise, noise_scores, rows)

    directory = ensemble.build_ensemble([good, noisy], tmp_path / "ens", fusion="weighted",
                                        registry=hybrid["registry"], log=lambda line: None)
    fusion = json.loads((directory / "ensemble.json").read_text())["fusion"]
    assert fusion["weights"][0] >= 0.8 and fusion["weights"][1] <= 0.2
    assert fusion["validation"]["P@1"] == pytest.approx(100.0)
    assert fusion["validation_members_alone"][0]["P@1"] == pytest.approx(100.0)

    # every score of "noisy", on validation and test alike, times 1000: the same weights and ranking
    for name in (VALIDATION_PREDICTIONS_FILE, "predictions.safetensors"):
        arrays = load_file(str(noisy / name))
        arrays["scores"] = arrays["scores"] * 1000
        save_file(arrays, str(noisy / name))
    scaled = ensemble.build_ensemble([good, noisy], tmp_path / "scaled", fusion="weighted",
                                     registry=hybrid["registry"], log=lambda line: None)
    assert json.loads((scaled / "ensemble.json").read_text())["fusion"]["weights"] == fusion["weights"]
    np.testing.assert_array_equal(load_file(str(scaled / "predictions.safetensors"))["labels"],
                                  load_file(str(directory / "predictions.safetensors"))["labels"])


@slow
def test_weighted_fusion_refuses_members_without_one_validation_split(hybrid, runs, tmp_path):
    members, registry = hybrid["members"], hybrid["registry"]
    without = tmp_path / "without"   # a member trained without a validation split, on the same data
    shutil.copytree(members[1], without)
    (without / VALIDATION_PREDICTIONS_FILE).unlink()
    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble([members[0], without], tmp_path / "ens", fusion="weighted", registry=registry)
    message = str(error.value)
    assert "\n" not in message and str(without) in message and "no validation predictions" in message
    assert "--set validation_size=8 --set seed=3" in message and "--fusion sum" in message
    assert not (tmp_path / "ens").exists()

    with pytest.raises(XmcError) as error:
        ensemble.build_ensemble([members[0], hybrid["other_seed"]], tmp_path / "ens", fusion="weighted",
                                registry=registry)
    message = str(error.value)
    assert "\n" not in message and "different training rows" in message and "seed=3" in message
    assert "seed=4" in message and str(hybrid["other_seed"]) in message

    # members trained without any validation split: the hint names the settings to pick
    with pytest.raises(XmcError, match=r"`--set validation_size=N --set seed=S` \(one N and S for every member\)"):
        ensemble.build_ensemble(runs["members"], tmp_path / "ens", fusion="weighted", registry=runs["registry"])

    found = subprocess.run([sys.executable, "-m", "xmcbench", "ensemble", str(members[0]), str(members[1]),
                            "--fusion", "max", "--output", str(tmp_path / "ens")], capture_output=True, text=True)
    assert found.returncode == 2 and found.stderr.count("\n") == 1 and "unknown --fusion 'max'" in found.stderr


@slow
def test_report_of_tiny_runs_shows_head_and_tail_and_the_fusion(hybrid, tmp_path):
    from xmcbench import report

    members, registry = hybrid["members"], hybrid["registry"]
    weighted = ensemble.build_ensemble(members, tmp_path / "weighted", fusion="weighted", registry=registry,
                                       log=lambda line: None)
    summed = ensemble.build_ensemble(members, tmp_path / "summed", registry=registry, log=lambda line: None)
    runs = report.load_runs([*members, weighted, summed])
    path = report.write_report(runs, tmp_path / "report")
    assert (path.parent / "frequency_bins.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = path.read_text()
    assert "## Head and tail" in text and "| training documents per label " in text and "all (= P@5)" in text
    assert "](frequency_bins.png)" in text
    assert "## Ensembles" in text and "- ensemble(lightxml+lightxml-random-neg): raw scores summed" in text
    weights = json.loads((weighted / "ensemble.json").read_text())["fusion"]["weights"]
    assert ("- weighted-ensemble(lightxml+lightxml-random-neg): each member's scores normalised" in text
            and f"seed 3: lightxml {weights[0]:g}, lightxml-random-neg {weights[1]:g}" in text)
    chosen = json.loads((weighted / "ensemble.json").read_text())["fusion"]["validation"]
    assert f"(validation P@1 / PSP@5 {chosen['P@1']:.2f} / {chosen['PSP@5']:.2f}; members alone " in text
    tables = report.summarize_frequency_bins(runs)
    assert len(tables) == 1 and len(tables[0]["rows"]) == 4
    for row in tables[0]["rows"]:   # a row's bins add up to its P@5
        run = next(r for r in runs if r.method == row["method"])
        assert sum(row["mean"]) == pytest.approx(run.metrics["P@5"])
