"""Tail slots of a fitted fusion: the first places keep the fusion's order, the later ones go by score over
propensity, and the alpha is chosen on the validation rows without letting P@5 fall below the members'."""

import json
import math

import numpy as np
import pytest
import scipy.sparse

from xmcbench import fusion as fusion_rules
from xmcbench.errors import DamagedModel, XmcError

AFTER = fusion_rules.TAIL_SLOTS_AFTER


def test_tail_slots_keep_the_first_places_and_rank_the_rest_by_score_over_propensity():
    labels = np.array([[0, 1, 2, 3, 4, 5, 6, -1]])
    scores = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, -np.inf]])
    log_inverse = np.zeros(7)
    log_inverse[[1, 6]] = 3.0     # labels 1 and 6 are rare; 1 is among the first places, 6 is not
    ranked, kept_scores = fusion_rules.tail_slots(labels, scores, log_inverse, AFTER, 1.0, log_scores=False)
    assert ranked[0, :AFTER].tolist() == [0, 1, 2, 3], "the first places keep the fusion's order"
    # 0.3 x e^3 beats 0.5 and 0.4: label 6 takes the first tail place; the empty slot stays last
    assert ranked[0, AFTER:].tolist() == [6, 4, 5, -1]
    assert kept_scores is scores, "the places keep their scores, so a row's scores still descend"

    # a stacked model's log-odds are shifted, not multiplied: -2 + 3 beats -1.5
    logits = np.array([[3.0, 2.0, 1.0, 0.0, -1.5, -1.8, -2.0, -np.inf]])
    ranked, _ = fusion_rules.tail_slots(labels, logits, log_inverse, AFTER, 1.0, log_scores=True)
    assert ranked[0, AFTER:].tolist() == [6, 4, 5, -1]
    ranked, _ = fusion_rules.tail_slots(labels, logits, log_inverse, AFTER, 0.05, log_scores=True)
    assert ranked[0].tolist() == labels[0].tolist(), "a small alpha does not lift -2 + 0.15 over -1.8"
    # alpha 0 is the fusion's own ranking
    assert fusion_rules.tail_slots(labels, scores, log_inverse, AFTER, 0.0, False)[0] is labels


def rare_label_sixth(num_docs, rare_relevant=True):
    """Fused validation lists [0, 1, 2, 3, 4, 20, 5, ...] with descending scores: label 0 always relevant, label 20
    (which the tests make rare) where rare_relevant, else label 4."""
    labels = np.tile(np.array([0, 1, 2, 3, 4, 20, 5, 6, 7, 8]), (num_docs, 1))
    scores = np.tile(np.linspace(1.0, 0.1, 10), (num_docs, 1))
    second = 20 if rare_relevant else 4
    rows = np.repeat(np.arange(num_docs), 2)
    columns = np.tile([0, second], num_docs)
    truth = scipy.sparse.csr_matrix((np.ones(2 * num_docs), (rows, columns)), shape=(num_docs, 30))
    return labels, scores, truth


def test_the_alpha_that_lifts_rare_relevant_labels_is_chosen_and_ties_go_to_the_smaller():
    labels, scores, truth = rare_label_sixth(10)
    inverse = np.ones(30)
    inverse[20] = math.e ** 2
    member = labels.copy()
    member[:, 0] = 9          # a member that misses every first label: the fusion leads it in P@1
    alpha, record = fusion_rules.choose_tail_alpha((labels, scores), [member], truth, inverse, log_scores=False)
    assert alpha == 0.5, "every alpha above 0 brings label 20 into the fifth place; the tie goes to the smallest"
    tried = {found["alpha"]: found for found in record["alphas_tried"]}
    assert tried[0.5]["PSP@5"] > tried[0.0]["PSP@5"] and tried[0.5]["P@1"] == tried[0.0]["P@1"] == 100.0
    assert record["after"] == AFTER and record["alpha"] == alpha and all(f["P@5_floor_kept"] for f in tried.values())


def test_where_p1_decides_the_objective_the_psp5_lead_chooses_the_alpha():
    # the member ranks exactly as the fusion does, so the P@1 lead is 0 whatever the alpha; the relevant rare label
    # 21 sits eighth (score 0.3), an irrelevant one, 20, sixth (0.5): alpha 0.5 lifts only 20 to the fifth place
    # (0.3 e < 0.5 e^0.5), alpha 1 lifts 21 (0.3 e^2 > 0.5 e)
    num_docs = 10
    labels = np.tile(np.array([0, 1, 2, 3, 4, 20, 5, 21, 6, 7]), (num_docs, 1))
    scores = np.tile(np.linspace(1.0, 0.1, 10), (num_docs, 1))
    truth = scipy.sparse.csr_matrix((np.ones(2 * num_docs), (np.repeat(np.arange(num_docs), 2),
                                                             np.tile([0, 21], num_docs))), shape=(num_docs, 30))
    inverse = np.ones(30)
    inverse[20], inverse[21] = math.e, math.e ** 2
    alpha, record = fusion_rules.choose_tail_alpha((labels, scores), [labels], truth, inverse, log_scores=False)
    tried = {found["alpha"]: found for found in record["alphas_tried"]}
    assert all(found["objective"] == 0.0 for found in tried.values()), "P@1's lead, 0, is the smaller every time"
    assert tried[0.5]["PSP@5"] == tried[0.0]["PSP@5"] < tried[1.0]["PSP@5"] == tried[2.0]["PSP@5"]
    assert alpha == 1.0, "the larger PSP@5 lead decides, and of the alphas that tie on it the smaller"


def tail_slots_trade_p5():
    """Fused validation lists where tail slots trade P@5 for PSP@5: one document where the rare label 20 is relevant,
    three where the fifth label it would push out is. Returns (labels, scores), truth, inverse propensities, and a
    member whose top 5 holds the same labels with its first one wrong."""
    lifted = rare_label_sixth(1)
    pushed = rare_label_sixth(3, rare_relevant=False)
    labels = np.concatenate([lifted[0], pushed[0]])
    scores = np.concatenate([lifted[1], pushed[1]])
    truth = scipy.sparse.vstack([lifted[2], pushed[2]]).tocsr()
    inverse = np.ones(30)
    inverse[20] = 50.0        # PSP@5 gains from the one document more than it loses on the three
    member = labels.copy()
    member[:, [0, 3]] = member[:, [3, 0]]
    return (labels, scores), truth, inverse, member


def test_no_alpha_may_bring_p5_below_the_members():
    fused, truth, inverse, member = tail_slots_trade_p5()
    alpha, record = fusion_rules.choose_tail_alpha(fused, [member], truth, inverse, log_scores=False)
    tried = {found["alpha"]: found for found in record["alphas_tried"]}
    assert tried[1.0]["PSP@5"] > tried[0.0]["PSP@5"] and tried[1.0]["P@5"] < tried[0.0]["P@5"]
    assert alpha == 0.0 and not tried[1.0]["P@5_floor_kept"] and record["P@5_floor"] == tried[0.0]["P@5"]


def test_a_fusion_of_members_with_tail_slots_tries_no_smaller_alpha():
    assert fusion_rules.tail_alpha_candidates(0.0) == fusion_rules.TAIL_ALPHAS
    assert fusion_rules.tail_alpha_candidates(1.0) == (1.0, 2.0)
    assert fusion_rules.tail_alpha_candidates(0.7) == (0.7, 1.0, 2.0), "a member's own alpha is tried first"
    assert fusion_rules.tail_alpha_candidates(3.0) == (3.0,)
    # where alpha 0 wins under the P@5 floor (the test above), members ranked with alpha 1 make 1 the first
    # candidate: the floor is counted from it, so it is always allowed
    fused, truth, inverse, member = tail_slots_trade_p5()
    alpha, record = fusion_rules.choose_tail_alpha(fused, [member], truth, inverse, log_scores=False,
                                                   members_tail_alpha=1.0)
    assert alpha == 1.0 and record["members_tail_alpha"] == 1.0
    assert [found["alpha"] for found in record["alphas_tried"]] == [1.0, 2.0]
    member_p5 = fusion_rules.members_alone([member], truth, inverse)[0]["P@5"]
    assert record["P@5_floor"] == min(record["alphas_tried"][0]["P@5"], member_p5) < member_p5


def test_a_stacked_model_chooses_its_alpha_with_its_members_tail_slots_in_place(monkeypatch):
    # member 0 ranks the rare relevant label 20 sixth; member 1 ranked with tail slots and holds it fifth. The
    # stacked model's log-odds are member 0's normalised score x 10 (label 4: 6, label 20: 5, log(1 / p) 2), so
    # alone it needs alpha 0.6 to lift label 20 over label 4, where the members' tail slots (alpha 1) already do
    labels, scores, truth = rare_label_sixth(60)
    slotted = labels.copy()
    slotted[:, [4, 5]] = slotted[:, [5, 4]]
    inverse = np.ones(30)
    inverse[20] = math.e ** 2
    monkeypatch.setattr(fusion_rules, "stacking_logits", lambda features, stacking: 10 * features[..., 0])
    depth = np.zeros(30)

    def fitted(tail_alpha):
        return fusion_rules.fit_stacking([labels, slotted], [scores, scores], truth, inverse, 10, depth, tail_alpha)

    alone, _, _ = fitted(0.0)
    assert alone["alpha"] == 0.6, "without tail slots, the smallest alpha that reaches member 1's PSP@5"
    with_slots, validation, _ = fitted(1.0)
    assert with_slots["alpha"] == 0.0, "the tail slots put label 20 fifth: no propensity term in the first places"
    # at alpha 0 the model ranks as member 0; with the tail slots that ranking scores as member 1 alone
    served = fusion_rules.served_metrics((labels, 10 * scores), truth, inverse, 1.0, log_scores=True)
    member = fusion_rules.members_alone([slotted], truth, inverse)[0]
    assert validation["objective"] == 0.0 and validation["PSP@5"] == served["PSP@5"] == member["PSP@5"]


def test_tail_slots_survive_ensemble_json_and_old_ensembles_have_none(tmp_path):
    quantiles = [np.linspace(0, 1, 5), np.linspace(0, 1, 5)]
    log_inverse = np.zeros(6)
    log_inverse[5] = np.log(40.0)      # label 5 is rare
    fitted = fusion_rules.Fusion("weighted", [0.5, 0.5], quantiles, {}, label_log_inverse_propensity=log_inverse,
                                 tail_alpha=1.0)
    spec = fitted.to_json()
    assert spec["tail_slots"] == {"after": AFTER, "alpha": 1.0}
    read = fusion_rules.Fusion.from_json(spec, 2, tmp_path / "ensemble.json")
    assert read.tail_alpha == 1.0 and read.tail_after == AFTER
    np.testing.assert_allclose(read.label_log_inverse_propensity, log_inverse)
    member_labels = [np.array([[0, 1, 2, 3, 4, 5]])] * 2
    member_scores = [np.array([[0.95, 0.9, 0.8, 0.7, 0.6, 0.5]])] * 2
    without = fusion_rules.Fusion("weighted", [0.5, 0.5], quantiles, {})
    assert fusion_rules.fuse(member_labels, member_scores, 6, without)[0].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert fusion_rules.fuse(member_labels, member_scores, 6, read)[0].tolist() == [[0, 1, 2, 3, 5, 4]]

    older = {key: value for key, value in spec.items() if key not in ("tail_slots", "label_log_inverse_propensity")}
    assert fusion_rules.Fusion.from_json(older, 2, tmp_path / "ensemble.json").tail_alpha == 0.0
    without_propensities = {key: value for key, value in spec.items() if key != "label_log_inverse_propensity"}
    with pytest.raises(DamagedModel, match="damaged"):
        fusion_rules.Fusion.from_json(without_propensities, 2, tmp_path / "ensemble.json")
    with pytest.raises(DamagedModel, match="damaged"):
        fusion_rules.Fusion.from_json({**spec, "tail_slots": {"after": 0, "alpha": 1.0}}, 2, tmp_path / "e.json")


def test_a_runs_tail_slots_move_only_the_places_after_the_fourth_and_read_negative_scores_as_zero():
    from xmcbench.inference import Predictions

    labels = np.array([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6]])
    scores = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], [0.9, 0.8, 0.7, 0.6, 0.5, -0.1, -0.2]], dtype=np.float32)
    inverse = np.ones(7)
    inverse[6] = 10.0       # label 6 is rare: 0.3 x 10 beats 0.5, but -0.2 counts as 0
    predictions = Predictions(labels, scores, None)
    moved = fusion_rules.with_tail_slots(predictions, inverse, 1.0)
    assert moved.labels.tolist() == [[0, 1, 2, 3, 6, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    assert moved.scores is scores, "the places keep their scores"
    assert fusion_rules.with_tail_slots(predictions, inverse, 0.0) is predictions
    assert fusion_rules.with_tail_slots(None, inverse, 1.0) is None, "a run without validation rows has none"


def test_a_run_with_tail_slots_saves_predicts_and_evaluates_one_ranking(tmp_path):
    """A whole method run twice with one seed, without and with tail_alpha: the second run's test and validation
    lists are the first's with tail slots, and `predict` and `evaluate` of its saved model give that ranking."""
    from safetensors.numpy import load_file

    from xmcbench.inference import Predictions
    from xmcbench.labels import load_label_info
    from xmcbench.registry import build_registry
    from xmcbench.runs import launch
    from xmcbench.runs.plan import plan_run
    from xmcbench.saved import evaluate, predict_texts
    from xmcbench.testing import write_tiny_dataset

    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "topics", train=160, test=40)
    rows = (data / "train_labels.txt").read_text().splitlines()
    carrying = [i for i, row in enumerate(rows) if "db:sql" in row.split()]
    for i in carrying[2:]:      # db:sql becomes a rare label: 2 training documents, high inverse propensity
        rows[i] = " ".join(label for label in rows[i].split() if label != "db:sql") or "role:program"
    (data / "train_labels.txt").write_text("\n".join(rows) + "\n")
    runs = {}
    for alpha in (0, 1):    # plt with one thread: the same seed gives the same model (parabel's k-means does not)
        plan = plan_run(registry, "plt", str(data), set_options=["validation_size=40", "threads=1",
                                                                 f"tail_alpha={alpha}"])
        runs[alpha] = launch.run(plan, output=tmp_path / f"alpha{alpha}", registry=registry, log=lambda line: None)
    names = json.loads((runs[1] / "model" / "labels.json").read_text())
    inverse = load_label_info(runs[1] / "model", names, "").inverse_propensities
    for file in ("predictions.safetensors", "validation_predictions.safetensors"):
        plain, slotted = load_file(str(runs[0] / file)), load_file(str(runs[1] / file))
        expected = fusion_rules.with_tail_slots(Predictions(plain["labels"], plain["scores"], None), inverse, 1.0)
        assert np.array_equal(slotted["labels"], expected.labels) and np.array_equal(slotted["scores"], plain["scores"])
        assert not np.array_equal(slotted["labels"], plain["labels"]), "some rare label must take a later place"
    saved = load_file(str(runs[1] / "predictions.safetensors"))
    texts = (data / "test_texts.txt").read_text().splitlines()
    for top_k in (10, 5):
        found = predict_texts(runs[1], texts, top_k=top_k, registry=registry)
        assert [[names.index(name) for name in row["labels"]] for row in found] == \
            [[i for i in row[:top_k] if i >= 0] for row in saved["labels"].tolist()]
    recorded = json.loads((runs[1] / "metrics.json").read_text())
    again = evaluate(runs[1])
    assert again["P@5"] == pytest.approx(recorded["P@5"]) and again["PSP@5"] == pytest.approx(recorded["PSP@5"])
    assert json.loads((runs[1] / "config.json").read_text())["config"]["tail_alpha"] == 1
    # a fitted hybrid of it tries no alpha below its members' largest: at a smaller one it would put the rare labels
    # back where the scores alone rank them
    from xmcbench.ensemble import build_ensemble
    hybrid = build_ensemble([runs[0], runs[1]], tmp_path / "hybrid", fusion="weighted", registry=registry,
                            log=lambda line: None)
    chosen = json.loads((hybrid / "ensemble.json").read_text())["fusion"]["tail_slots_chosen"]
    assert chosen["members_tail_alpha"] == 1 and chosen["alpha"] >= 1
    assert [found["alpha"] for found in chosen["alphas_tried"]] == [1.0, 2.0]
    from xmcbench.models import load_model, predict_documents
    model, config, _ = load_model(runs[1], registry)
    with pytest.raises(XmcError, match="pass model_dir"):    # where the propensities are is not guessed
        predict_documents(model, texts[:2], None, config)
    (runs[1] / "model" / "label_info.json").unlink()
    with pytest.raises(XmcError, match="label_info.json"):   # one line, not a traceback
        predict_texts(runs[1], texts[:2], top_k=5, registry=registry)
