"""How an ensemble fuses its members' top lists: how weighted fusion chooses its weights, and stacked fusion its model.

The fusion rules (`--fusion`) work on the union of the members' top-k label ids per document (a label
outside a member's top-k gets nothing from that member); the ensemble's ranking is the top-k of the fused
scores (ties: lower id first).

- `sum` (the default; the paper's rule): the fused score of a label is the sum of the members' raw scores.
  Right for members of one family (seeds, encoders, label-cluster trees of one method), whose scores share
  one scale.
- `weighted` (for members of different families, whose scores live on different scales: LightXML's sigmoid
  products in [0, 1], tree probabilities, SVM margins). First each member's scores are normalised by that
  member's own scores on the validation rows: a score becomes the fraction of the member's validation top-k
  scores that lie below it (the member's empirical distribution function, kept as QUANTILES quantiles, linear
  in between; a score beyond the validation range maps to 0 or 1). This is a rank transform against the
  member's validation scores, so any strictly increasing change of a member's scores (a factor, a shift, a
  sigmoid) leaves the ensemble unchanged and a few extreme scores cannot dominate; unlike ranks within one
  document it keeps confidence: a member's top label on a document it is sure of outranks its top label on
  one it is unsure of. Then the fused score is sum over members of w_m * normalised score, with weights w_m > 0
  summing to 1 chosen on the validation rows, never on the test set: a grid over the weights (steps of 1/20 for up to
  3 members, coarser beyond, so at most MAX_GRID_POINTS combinations; equal weights always tried; every member weighs
  at least one step, see weight_grid) maximising FUSION_OBJECTIVE on the validation rows: the fusion's smallest lead
  over any member alone, in P@1 or in PSP@5 (objective). A hybrid earns its cost by beating every member on the
  frequent labels (P@1) and on the tail (PSP@5) at once; the mean of P@1 and PSP@5, the objective before, let a gain
  in one pay for a loss in the other against the strongest member, and its optimum sat on a flat ridge where the
  validation rows' noise decided (debian-debtags, seed 2: weights 0.8 / 0.2 led LightXML by 0.53 in P@1 but 0.42 in
  PSP@5 on validation, and fell 0.18 short of it in PSP@5 on test). The smallest lead peaks where the two leads cross.
  Ties go to the weights closest to equal. A member at weight 0 (an ensemble.json written before every member took a
  step) is left out.
  Weights per bin: then the labels are put in weight bins by their training documents (WEIGHT_BINS: at most 3,
  4 to 100, more; the counts the members' models saved in model/label_info.json). Adjacent bins are grouped until
  each group holds at least MIN_BIN_POSITIVES validation positives (weight_bin_groups: a bin short of them shares
  the weights of its neighbour toward the head), and each group gets weights of its own, by coordinate ascent
  from the weights above (choose_bin_weights): one member may lead the head and another the tail. They are kept
  only when they score better on the validation rows than one weight per member; the record says which, and why.
  The stacked model: last, `weighted` fits the stacked model below on the same rows and ranks with it instead of
  the weights when it scores better there on FUSION_OBJECTIVE: a combiner of the members' scores and the labels'
  training documents, which one weight per bin cannot express; the record's "stacked_model_chosen" says whether,
  and why not. Not for members whose vocabularies differ (the weights keep a zero-shot label its score; the
  stacked model cannot learn such labels on validation rows), nor where it cannot be fitted (too few relevant
  validation labels).
  Tail slots: last, for either fitted rule, the fused ranking's first TAIL_SLOTS_AFTER places keep its order and
  the later ones hold the rest of its top-k by score x (1 / propensity) ** alpha (tail_slots), alpha in TAIL_ALPHAS
  chosen on the same rows by FUSION_OBJECTIVE, then by the other of its two leads (ties: the smaller; 0 is no tail
  slots), among the alphas that keep the fusion's validation P@5 at least at the lower of its own without tail
  slots and its best member's (choose_tail_alpha). P@1 and P@3 stay the fusion's; a rare label that the fusion
  holds just below the top 5 can take the fifth place, which is where a label seen once or twice scores in PSP@5.
  The record's "tail_slots_chosen" lists every alpha's validation figures. A single run can rank its own places
  the same way (the setting tail_alpha, with_tail_slots; a flat LightXML run's default): the fusion of such runs then
  tries only alphas from its members' largest tail_alpha up (tail_alpha_candidates), the P@5 floor counted from
  the first of them, since the fused scores would otherwise put the members' rare labels back where their scores
  alone rank them.
- `stacked`: the same normalisation, then a logistic regression (STACKING_C) fitted on the same validation rows,
  over every label in some member's top-k of each row: whether it is relevant, from each member's normalised score
  of it (0 outside that member's top-k) and whether it is in that member's top-k, both also times the label's depth
  (log10(1 + its training documents)), and the depth and its square (candidate_features). So one member may be
  trusted on the rare labels and another on the frequent ones without bin boundaries, and a label only the weaker
  member proposes keeps a chance. Labels are ranked by the model's log-odds + alpha x log(1 / propensity), alpha in
  STACKING_ALPHAS chosen by FUSION_OBJECTIVE (alpha 0 orders by the estimated probability, what maximises expected
  P@k; alpha 1 by probability times inverse propensity, what maximises expected PSP@k), judged on the ranking with
  the tail slots its members ranked with (served_metrics): those add log(1 / propensity) again after the 4th place,
  and an alpha chosen without them counts it twice and moves the first places for a PSP@5 the slots already give.
  It needs STACKING_MIN_POSITIVES relevant labels among the validation rows' candidates. The weights `weighted`
  would choose are chosen and recorded too, beside the stacked model's validation figures. `stacked` ranks with the
  model whatever the weights score; `weighted` only where it scores better (the weights' figures as chosen, before
  tail slots: judged with them too, the weights won by a few validation documents on two debian-debtags-mini pairs
  and lost there on test; BENCHMARKS.md section 11, "Rule version 10"). A label outside a member's
  vocabulary (zero-shot) reads as not proposed by that member; the validation rows hold none to learn otherwise.
  The validation rows: every member must have `validation_predictions.safetensors` (written by
  `xmcbench run` when validation_size > 0; see xmcbench.rundir.save_validation_predictions) over the same
  training rows, i.e. trained with the same seed, validation_size and max_train_docs. Their truth is the
  dataset's training labels at those rows; PSP@5's propensities are the ones every score uses
  (scoring.propensities).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from xmcbench.errors import DamagedModel
from xmcbench.metrics import evaluate, relevant

FUSION_RULES = ("sum", "weighted", "stacked")
FITTED_RULES = ("weighted", "stacked")   # fitted on the members' validation rows
FUSION_OBJECTIVE = "the smallest lead over a member alone in P@1 or PSP@5"
QUANTILES = 201          # validation-score quantiles kept per member: every half percent
MAX_GRID_POINTS = 500    # weight combinations tried at most
# The weight bins: labels by their training documents, at most 3 (the tail, 0 included), 4 to 100, more (the head).
# A group of adjacent bins gets weights of its own where the validation rows hold MIN_BIN_POSITIVES of its labels'
# positives. 100 rather than 30: a comparison fixed before its six pairs were trained (BENCHMARKS.md section 11).
WEIGHT_BINS = (3, 100)
WEIGHT_BIN_NAMES = ("0-3", "4-100", ">100")
MIN_BIN_POSITIVES = 50
BIN_SEARCH_PASSES = 2
# The stacked model: a logistic regression over every label in some member's top-k, fitted on the validation rows
STACKING_FEATURES = ("normalised score", "in the top-k", "normalised score x depth", "in the top-k x depth")
STACKING_LABEL_FEATURES = ("depth", "depth^2")   # depth: log10(1 + the label's training documents)
STACKING_C = 1.0                                 # scikit-learn's C: the inverse strength of the L2 penalty
STACKING_ALPHAS = tuple(step / 10 for step in range(11))
STACKING_MIN_POSITIVES = 2 * MIN_BIN_POSITIVES   # validation positives among the candidates a fit needs
STACKING_BLOCK_ELEMENTS = 1 << 24                # bounds the memory of ranking many documents at --top-k 100
# Tail slots: a fitted fusion's first TAIL_SLOTS_AFTER places keep its order, the later ones go by score over
# propensity ** alpha, alpha in TAIL_ALPHAS chosen on the validation rows (0: no tail slots). 4 of 5 places: P@1 and
# P@3 stay the fusion's, and a rare label can take the fifth place (a rule fixed before the full debian-debtags'
# seed 2 pair was built; BENCHMARKS.md section 11).
TAIL_SLOTS_AFTER = 4
TAIL_ALPHAS = (0.0, 0.5, 1.0, 2.0)


def combine(labels: Sequence[np.ndarray], scores: Sequence[np.ndarray], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Members' top lists -> the ensemble's top-k.

    labels[m]: (N, k_m) int label ids of member m, best first, -1 for empty slots; scores[m]: (N, k_m).
    Each member contributes its first top_k columns. Returns labels (N, top_k) int64 (-1 padded) and
    scores (N, top_k) float32 (-1.0 padded): per document, the top_k labels of the union of the members'
    lists by the sum of their members' scores (descending, ties by ascending id)."""
    if not labels or len(labels) != len(scores):
        raise ValueError("combine needs one scores array per labels array, and at least one member")
    num_docs = np.asarray(labels[0]).shape[0]
    for member_labels, member_scores in zip(labels, scores):
        if np.shape(member_labels) != np.shape(member_scores) or np.shape(member_labels)[0] != num_docs:
            raise ValueError("every member needs labels and scores of one shape (N, k) with the same N")
    ids = np.concatenate([np.asarray(a)[:, :top_k] for a in labels], axis=1).astype(np.int64)      # (N, M*k)
    values = np.concatenate([np.asarray(a)[:, :top_k] for a in scores], axis=1).astype(np.float64)
    rows = np.broadcast_to(np.arange(num_docs)[:, None], ids.shape)
    valid = ids >= 0
    rows, ids, values = rows[valid], ids[valid], values[valid]
    # group equal (row, id): a stable sort keeps member order inside a group, so sums are reproducible
    order = np.lexsort((ids, rows))
    rows, ids, values = rows[order], ids[order], values[order]
    if len(ids):
        starts = np.flatnonzero(np.r_[True, (rows[1:] != rows[:-1]) | (ids[1:] != ids[:-1])])
        sums = np.add.reduceat(values, starts)
        rows, ids = rows[starts], ids[starts]
    else:
        sums = values
    # rank inside each row: descending sum, then ascending id
    order = np.lexsort((ids, -sums, rows))
    rows, ids, sums = rows[order], ids[order], sums[order]
    rank = np.arange(len(rows)) - np.searchsorted(rows, rows, side="left")
    keep = rank < top_k
    out_labels = np.full((num_docs, top_k), -1, dtype=np.int64)
    out_scores = np.full((num_docs, top_k), -1.0, dtype=np.float32)
    out_labels[rows[keep], rank[keep]] = ids[keep]
    out_scores[rows[keep], rank[keep]] = sums[keep]
    return out_labels, out_scores


@dataclass
class Fusion:
    """How the members' scores are fused (see the module docstring). rule "sum": raw scores summed.
    rule "weighted": weights (one per member, >= 0, summing to 1) and quantiles (per member, its (Q,) sorted
    validation-score quantiles); record: what the weights were chosen on and how well they did. With
    bin_weights (one list of member weights per weight bin, WEIGHT_BINS) a label's scores are weighted by its
    bin's weights; label_bins: (L,) the bin of each label of the ensemble's vocabulary. rule "stacked": the
    same, plus stacking ({"coefficients": (4M + 2,) floats in the order of stacking_feature_names, "intercept",
    "alpha"}), which ranks the labels instead of the weights (stacked_ranking; the weights are kept as what
    "weighted" would have chosen); label_depth: (L,) log10(1 + each label's training documents),
    label_log_inverse_propensity: (L,) log(1 / propensity), kept for a stacked model and for tail slots.
    tail_alpha > 0 (the fitted rules): the places after the first tail_after go by score over propensity **
    tail_alpha (tail_slots)."""

    rule: str = "sum"
    weights: list[float] | None = None
    quantiles: list[np.ndarray] | None = None
    record: dict = field(default_factory=dict)
    bin_weights: list[list[float]] | None = None
    label_bins: np.ndarray | None = None
    stacking: dict | None = None
    label_depth: np.ndarray | None = None
    label_log_inverse_propensity: np.ndarray | None = None
    tail_alpha: float = 0.0
    tail_after: int = TAIL_SLOTS_AFTER

    def weight_table(self) -> np.ndarray:
        """(M, B) the weight of each member in each bin; B = 1 without bin weights."""
        if self.bin_weights is None:
            return np.asarray(self.weights, dtype=np.float64)[:, None]
        return np.asarray(self.bin_weights, dtype=np.float64).T

    def summary(self) -> dict:
        """The fusion as config.json and the report show it (no quantiles, no label bins)."""
        if self.rule == "sum":
            return {"rule": "sum", "normalisation": "none (raw scores)"}
        bins = {} if self.bin_weights is None else {"bin_weights": self.bin_weights}
        stacking = {} if self.stacking is None else {"stacking": self.stacking}
        return {"rule": self.rule, "normalisation": "validation-quantiles", "weights": self.weights, **bins,
                **stacking, "tail_slots": {"after": self.tail_after, "alpha": self.tail_alpha}, **self.record}

    def to_json(self) -> dict:
        """The fusion as ensemble.json keeps it: the summary, plus the quantiles (and the label bins, or the
        stacked model's label arrays) for the fitted rules."""
        if self.rule == "sum":
            return self.summary()
        bins = {} if self.label_bins is None else {"label_bins": [int(b) for b in self.label_bins]}
        depth = {} if self.stacking is None else {"label_depth": [float(value) for value in self.label_depth]}
        propensity = {} if self.label_log_inverse_propensity is None else {
            "label_log_inverse_propensity": [float(value) for value in self.label_log_inverse_propensity]}
        labels = {**depth, **propensity}
        return {**self.summary(), "quantiles": [[float(value) for value in q] for q in self.quantiles], **bins,
                **labels}

    @staticmethod
    def from_json(spec, num_members: int, path: Path) -> "Fusion":
        damaged = (f"{path} has a damaged \"fusion\" entry (a rule, and for weighted and stacked one weight and one "
                   "list of quantiles per member, for stacked a stacked model); rebuild the ensemble with "
                   "`xmcbench ensemble`")
        if spec is None:   # an ensemble written before fusion rules existed: the paper's sum
            return Fusion()
        if not isinstance(spec, dict) or spec.get("rule") not in FUSION_RULES:
            raise DamagedModel(damaged)
        if spec["rule"] == "sum":
            return Fusion()
        weights, quantiles = spec.get("weights"), spec.get("quantiles")
        if not isinstance(weights, list) or not isinstance(quantiles, list) \
                or len(weights) != num_members or len(quantiles) != num_members:
            raise DamagedModel(damaged)
        try:
            weights = [float(w) for w in weights]
            quantiles = [np.asarray(q, dtype=np.float64) for q in quantiles]
        except (TypeError, ValueError):
            raise DamagedModel(damaged) from None
        if not _valid_weights(weights) or any(
                q.ndim != 1 or q.size == 0 or not np.all(np.isfinite(q)) or np.any(np.diff(q) < 0) for q in quantiles):
            raise DamagedModel(damaged)
        bin_weights, label_bins = spec.get("bin_weights"), spec.get("label_bins")
        if (bin_weights is None) != (label_bins is None):
            raise DamagedModel(damaged)
        if bin_weights is not None:
            try:
                bin_weights = [[float(w) for w in row] for row in bin_weights]
                label_bins = np.asarray(label_bins, dtype=np.int64)
            except (TypeError, ValueError):
                raise DamagedModel(damaged) from None
            if not bin_weights or any(len(row) != num_members or not _valid_weights(row) for row in bin_weights) \
                    or label_bins.ndim != 1 or label_bins.size == 0 or label_bins.min() < 0 \
                    or label_bins.max() >= len(bin_weights):
                raise DamagedModel(damaged)
        stacking, depth, log_inverse = (spec.get(key) for key in
                                        ("stacking", "label_depth", "label_log_inverse_propensity"))
        tail = spec.get("tail_slots", {"after": TAIL_SLOTS_AFTER, "alpha": 0.0})   # absent: built before them
        try:
            tail_after, tail_alpha = int(tail["after"]), float(tail["alpha"])
        except (TypeError, ValueError, KeyError):
            raise DamagedModel(damaged) from None
        if tail_after < 1 or not math.isfinite(tail_alpha) or tail_alpha < 0 \
                or (stacking is None) != (depth is None) \
                or (log_inverse is None) != (stacking is None and tail_alpha == 0) \
                or (stacking is None) != (spec["rule"] == "weighted"):
            raise DamagedModel(damaged)
        if log_inverse is not None:
            try:
                log_inverse = np.asarray(log_inverse, dtype=np.float64)
            except (TypeError, ValueError):
                raise DamagedModel(damaged) from None
            if log_inverse.ndim != 1 or log_inverse.size == 0 or not np.all(np.isfinite(log_inverse)):
                raise DamagedModel(damaged)
        if stacking is not None:
            try:
                coefficients = [float(value) for value in stacking["coefficients"]]
                stacking = {**stacking, "coefficients": coefficients, "intercept": float(stacking["intercept"]),
                            "alpha": float(stacking["alpha"])}
                depth = np.asarray(depth, dtype=np.float64)
            except (TypeError, ValueError, KeyError):
                raise DamagedModel(damaged) from None
            if len(coefficients) != len(stacking_feature_names(num_members)) or depth.ndim != 1 or depth.size == 0 \
                    or log_inverse.shape != depth.shape \
                    or not all(math.isfinite(value) for value in (*coefficients, stacking["intercept"],
                                                                   stacking["alpha"])) \
                    or not np.all(np.isfinite(depth)):
                raise DamagedModel(damaged)
        record = {key: value for key, value in spec.items()
                  if key not in ("rule", "normalisation", "weights", "quantiles", "bin_weights", "label_bins",
                                 "stacking", "label_depth", "label_log_inverse_propensity", "tail_slots")}
        return Fusion(spec["rule"], weights, quantiles, record, bin_weights, label_bins, stacking, depth,
                      log_inverse, tail_alpha, tail_after)


def _valid_weights(weights: list[float]) -> bool:
    return all(math.isfinite(w) and w >= 0 for w in weights) and sum(weights) > 0


def score_quantiles(labels: np.ndarray, scores: np.ndarray, top_k: int) -> np.ndarray:
    """A member's (V, k) validation top lists -> (Q,) sorted quantiles of its scores in the first top_k
    columns (empty slots, label -1, left out), Q = min(QUANTILES, number of scores); (0,) when none."""
    values = np.asarray(scores, dtype=np.float64)[:, :top_k][np.asarray(labels)[:, :top_k] >= 0]
    if values.size == 0:
        return values
    return np.quantile(values, np.linspace(0.0, 1.0, min(QUANTILES, values.size)))


def normalise(scores: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
    """Scores of one member (any shape) -> [0, 1]: the fraction of the member's validation scores below each
    score, read from its (Q,) sorted quantiles, linear in between (a run of equal quantiles counts at its
    middle, so tied validation scores do not pull a score to either end)."""
    values, first, repeats = np.unique(quantiles, return_index=True, return_counts=True)
    if len(quantiles) == 1:
        levels = np.array([0.5])
    else:
        levels = (first + (repeats - 1) / 2) / (len(quantiles) - 1)
    return np.interp(np.asarray(scores, dtype=np.float64), values, levels)


def fuse(labels: Sequence[np.ndarray], scores: Sequence[np.ndarray], top_k: int,
         fusion: Fusion, sizes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Members' top lists -> the ensemble's top-k under a fusion rule; shapes as in combine(). sizes: each
    member's vocabulary size (nested vocabularies, see weighted_scores); None: one vocabulary."""
    if fusion.rule == "sum":
        return combine(labels, scores, top_k)
    if fusion.stacking is not None:
        normalised = [normalise(np.asarray(member_scores)[:, :top_k], quantiles)
                      for member_scores, quantiles in zip(scores, fusion.quantiles)]
        fused = stacked_ranking([np.asarray(member_labels)[:, :top_k] for member_labels in labels], normalised,
                                fusion.stacking, fusion.label_depth, fusion.label_log_inverse_propensity, top_k)
    else:
        table = fusion.weight_table()
        # a member of weight 0 (in every bin) is left out before its scores are normalised
        normalised = [normalise(np.asarray(member_scores)[:, :top_k], quantiles) if weights.max() > 0 else None
                      for member_scores, quantiles, weights in zip(scores, fusion.quantiles, table)]
        fused = weighted_fusion([np.asarray(member_labels)[:, :top_k] for member_labels in labels], normalised,
                                table, sizes, top_k, fusion.label_bins)
    if fusion.tail_alpha == 0:
        return fused
    return tail_slots(*fused, fusion.label_log_inverse_propensity, fusion.tail_after, fusion.tail_alpha,
                      log_scores=fusion.stacking is not None)


def tail_slots(labels: np.ndarray, scores: np.ndarray, label_log_inverse_propensity: np.ndarray, after: int,
               alpha: float, log_scores: bool) -> tuple[np.ndarray, np.ndarray]:
    """A ranking's (N, k) top lists, best first (-1: empty, at the end) -> the same labels with the first `after`
    places as they are and the later places holding the rest of each row by score x (1 / propensity) ** alpha
    (score + alpha x log(1 / propensity) where log_scores: a stacked model ranks by log-odds).

    Ranking by the probability of relevance maximises expected P@k, by that probability over propensity
    expected PSP@k (Jain et al. 2016): the first places stay the ranking's, and a rare label the ranking holds
    lower can take a later one. Only labels already in a row's top k move. The scores stay those of the places
    (a row's scores still descend, and a threshold keeps as many places as before). label_log_inverse_propensity:
    (L,) log(1 / p_l) of the labels the ids index."""
    labels = np.asarray(labels)
    if alpha == 0 or labels.shape[1] <= after:
        return labels, scores
    present = labels >= 0
    boost = alpha * np.asarray(label_log_inverse_propensity)[np.where(present, labels, 0)]      # (N, k)
    values = np.asarray(scores, dtype=np.float64)
    values = values + boost if log_scores else values * np.exp(boost)
    values = np.where(present, values, -np.inf)
    values[:, :after] = np.inf      # the first places keep their order: the sort below is stable
    order = np.argsort(-values, axis=1, kind="stable")
    return np.take_along_axis(labels, order, axis=1), scores


def with_tail_slots(predictions, inverse_propensity: np.ndarray, alpha: float):
    """A run's predictions (inference.Predictions: labels and scores (N, k), best first) with tail slots at a fixed
    alpha, the run's setting tail_alpha: its first TAIL_SLOTS_AFTER places as they are, the later ones by score x
    (1 / p_l) ** alpha over the rest of each row's top k (tail_slots; the places keep their scores). A run's scores
    are read as probabilities: one below 0 counts as 0, so such a label moves behind every label scored above 0.
    inverse_propensity: (L,) 1 / p_l of the labels the ids index (LabelInfo.inverse_propensities). alpha 0, or
    predictions None (a run without validation rows): the predictions as they are."""
    if alpha == 0 or predictions is None:
        return predictions
    probabilities = np.maximum(np.asarray(predictions.scores, dtype=np.float64), 0.0)
    labels, _ = tail_slots(predictions.labels, probabilities, np.log(inverse_propensity), TAIL_SLOTS_AFTER, alpha,
                           log_scores=False)
    return replace(predictions, labels=labels)


def weighted_fusion(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray | None], weights,
                    sizes: Sequence[int] | None, top_k: int,
                    label_bins: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The weighted rule's top-k: the members of weight > 0, their (N, k) normalised scores weighted
    (weighted_scores) and summed per label (combine). weights: (M,) one per member, or (M, B) one per member
    and weight bin, with label_bins (L,) each label's bin."""
    table = np.asarray(weights, dtype=np.float64).reshape(len(labels), -1)           # (M, B)
    kept = [m for m in range(len(labels)) if table[m].max() > 0]

    def pick(values):
        return [values[m] for m in kept]

    return combine(pick(labels), weighted_scores(pick(labels), pick(normalised), table[kept],
                                                 None if sizes is None else pick(sizes), label_bins), top_k)


def weighted_scores(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray], weights,
                    sizes: Sequence[int] | None, label_bins: np.ndarray | None = None) -> list[np.ndarray]:
    """Each member's (N, k) normalised scores times its weight, the terms combine() sums. weights: (M,) or
    (M, B); with B > 1 a label's terms take the weights of its bin (label_bins (L,)). With vocabularies of
    different sizes (sizes[m]: member m's, each the beginning of the longest), a label beyond some members'
    vocabulary is scored by the others only: its terms are divided by the weight of the members whose vocabulary
    holds it, so a zero-shot label one member alone can score keeps that member's normalised score, not a share
    of it."""
    table = np.asarray(weights, dtype=np.float64).reshape(len(labels), -1)           # (M, B)
    nested = sizes is not None and len(set(sizes)) > 1
    terms = []
    for member, (ids, values) in enumerate(zip(labels, normalised)):
        # each slot's weight bin: (N, k), or the one bin of one weight per member
        bins = 0 if label_bins is None else label_bins[np.where(ids >= 0, ids, 0)]
        weight = table[member][bins]
        if nested:   # the weight, in this label's bin, of the members whose vocabulary holds the label
            cover = sum(table[other][bins] * (ids < size) for other, size in enumerate(sizes))
            terms.append(weight * values / np.clip(cover, 1e-12, None))
        else:
            terms.append(weight * values)
    return terms


def weight_grid(num_members: int) -> list[tuple[float, ...]]:
    """The weights tried: every split of 1 into num_members shares of at least one step of 1/n (n = 20, or the
    finest of 10, 5, 4, 3, 2, 1 that keeps the grid within MAX_GRID_POINTS), plus equal weights. No member weighs
    0: that point is another member alone, whose lead over itself is 0 by construction, untouched by the
    validation rows' noise, so FUSION_OBJECTIVE would settle there whenever that noise hid a mixture's lead."""
    steps = next(n for n in (20, 10, 5, 4, 3, 2, 1)
                 if math.comb(n - 1, num_members - 1) <= MAX_GRID_POINTS)
    points = []
    # every member takes at least one step: num_members - 1 cuts among the steps - 1 places between steps
    for cuts in itertools.combinations(range(1, steps), num_members - 1):
        edges = (0, *cuts, steps)
        points.append(tuple((edges[i + 1] - edges[i]) / steps for i in range(num_members)))
    equal = tuple(1.0 / num_members for _ in range(num_members))
    if not any(np.allclose(point, equal) for point in points):
        points.append(equal)
    return points


def members_alone(labels: Sequence[np.ndarray], truth, inv_propensity: np.ndarray) -> list[dict]:
    """Each member's own (V, k) validation top list scored: its P@1 and PSP@5, the leads objective() measures, and
    its P@5, the floor of the tail slots (choose_tail_alpha)."""
    found = []
    for member_labels in labels:
        metrics = evaluate(member_labels, truth, ks=(1, 5), inv_propensity=inv_propensity)
        found.append({"P@1": metrics["P@1"], "P@5": metrics["P@5"], "PSP@5": metrics["PSP@5"]})
    return found


def leads(metrics: dict, alone: Sequence[dict]) -> tuple[float, float]:
    """The fusion's lead in P@1 and in PSP@5, in points, over the member alone (members_alone) that is closest to it
    in each; negative where some member is ahead."""
    return tuple(min(metrics[key] - member[key] for member in alone) for key in ("P@1", "PSP@5"))


def objective(metrics: dict, alone: Sequence[dict]) -> float:
    """FUSION_OBJECTIVE, in points: the smaller of the fusion's two leads (leads); negative where some member is
    ahead in P@1 or PSP@5."""
    return min(leads(metrics, alone))


def served_metrics(ranked: tuple[np.ndarray, np.ndarray], truth, inv_propensity: np.ndarray, tail_alpha: float,
                   log_scores: bool) -> dict:
    """A fused validation ranking ((V, k) labels and scores, best first) scored at P@1 / P@5 / PSP@5 as it will be
    served: with tail slots at tail_alpha (0: none, the ranking as it is). fit_stacking judges its alpha on the
    ranking with the members' tail slots (rule version 10), choose_tail_alpha each candidate alpha. truth:
    (V, L_total); inv_propensity: (L_total,); log_scores: as in tail_slots."""
    labels, _ = tail_slots(*ranked, np.log(inv_propensity), TAIL_SLOTS_AFTER, tail_alpha, log_scores)
    return evaluate(labels, truth, ks=(1, 5), inv_propensity=inv_propensity)


def tail_alpha_candidates(members_tail_alpha: float) -> tuple[float, ...]:
    """The alphas a fitted fusion tries: TAIL_ALPHAS where no member has tail slots (members_tail_alpha 0), else
    those from the members' largest tail_alpha up, that one first. The fusion reads its members' scores, which tail
    slots leave as they were, so at a smaller alpha it would rank a member's rare labels back behind the places that
    member gave them (BENCHMARKS.md section 11, "Rule version 9")."""
    if members_tail_alpha == 0:
        return TAIL_ALPHAS
    return tuple(sorted({members_tail_alpha, *(alpha for alpha in TAIL_ALPHAS if alpha >= members_tail_alpha)}))


def choose_tail_alpha(fused: tuple[np.ndarray, np.ndarray], labels: Sequence[np.ndarray], truth,
                      inv_propensity: np.ndarray, log_scores: bool,
                      members_tail_alpha: float = 0.0) -> tuple[float, dict]:
    """The tail slots' alpha for a fitted fusion, one of tail_alpha_candidates(members_tail_alpha): the one whose
    validation ranking scores best on FUSION_OBJECTIVE, then on its other lead (tail slots leave P@1 as it is, so
    where P@1's lead is the smaller the objective ties and PSP@5's lead decides; full ties: the smaller alpha), among
    those that keep the fusion's P@5 at least at the lower of its own P@5 at the first candidate and its best
    member's: the places after TAIL_SLOTS_AFTER may trade P@5 for PSP@5 only while the fusion still ranks as well as
    every member there. The first candidate is always allowed.

    fused: the fusion's (V, k) validation labels and scores (fuse, without tail slots); labels[m]: member m's (V, k)
    validation labels; truth: (V, L_total); inv_propensity: (L_total,); members_tail_alpha: the largest tail_alpha
    the members ranked their own lists with (0: none did). Returns (alpha, a record of every alpha's validation
    P@1 / P@5 / PSP@5 / objective and the P@5 floor)."""
    alone = members_alone(labels, truth, inv_propensity)
    tried, floor = [], None
    best_alpha, best = 0.0, (-math.inf, -math.inf)
    for alpha in tail_alpha_candidates(members_tail_alpha):
        metrics = served_metrics(fused, truth, inv_propensity, alpha, log_scores)
        found = leads(metrics, alone)
        value = (min(found), max(found))      # FUSION_OBJECTIVE, then the other lead
        if floor is None:     # the first candidate: 0 (no tail slots) unless the members ranked with them
            floor = min(metrics["P@5"], max(member["P@5"] for member in alone))
        allowed = metrics["P@5"] >= floor - 1e-9
        tried.append({"alpha": alpha, "P@1": metrics["P@1"], "P@5": metrics["P@5"], "PSP@5": metrics["PSP@5"],
                      "objective": value[0], "P@5_floor_kept": bool(allowed)})
        if allowed and (value[0] > best[0] + 1e-9 or (value[0] > best[0] - 1e-9 and value[1] > best[1] + 1e-9)):
            best_alpha, best = alpha, value
    return best_alpha, {"after": TAIL_SLOTS_AFTER, "alpha": best_alpha, "members_tail_alpha": members_tail_alpha,
                        "P@5_floor": floor, "alphas_tried": tried}


def weight_bin_groups(positives: Sequence[int]) -> list[list[int]]:
    """The weight bins' validation positives (B,) -> groups of adjacent bins that share weights, tail first, each
    holding at least MIN_BIN_POSITIVES of them; [] when all bins together hold fewer.

    A bin short of positives joins its neighbour toward the head (the last bin, its neighbour toward the tail).
    The validation rows of a dataset of frequent labels hold few positives of its rarest labels (debian-debtags:
    18 of 8,934); left on their own those labels took the head's weights, where the member that scores them best
    has little say, and contributed nothing."""
    groups, current, found = [], [], 0
    for column, count in enumerate(positives):
        current.append(column)
        found += int(count)
        if found >= MIN_BIN_POSITIVES:
            groups.append(current)
            current, found = [], 0
    if current and groups:
        groups[-1].extend(current)
    return groups


def weight_group_name(group: Sequence[int]) -> str:
    """A group of adjacent weight bins by its training documents, e.g. [0, 1] -> "0-100", [2] -> ">100"."""
    lowest = 0 if group[0] == 0 else WEIGHT_BINS[group[0] - 1] + 1
    if group[-1] >= len(WEIGHT_BINS):
        return f">{lowest - 1}" if lowest else "all"
    return f"{lowest}-{WEIGHT_BINS[group[-1]]}"


def choose_bin_weights(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray], truth,
                       inv_propensity: np.ndarray, top_k: int, sizes: Sequence[int] | None, label_bins: np.ndarray,
                       start: Sequence[float], searched: Sequence[Sequence[int]],
                       num_bins: int | None = None, grid: Sequence[Sequence[float]] | None = None
                       ) -> tuple[np.ndarray, dict, int]:
    """Weights per bin: from `start` (the weights of choose_weights) in every bin, each group of bins of
    `searched` (weight_bin_groups) in turn takes the point of weight_grid() that scores best on FUSION_OBJECTIVE
    over the validation rows, the other bins held, for BIN_SEARCH_PASSES passes (coordinate ascent; a change must
    beat the current objective). The bins of a group share their weights. Shapes as in choose_weights;
    label_bins: (L,) each label's bin; num_bins: B (default: the highest bin in label_bins, plus one); grid: the
    points tried (default weight_grid()). Returns ((M, B) weights, their validation P@1 / PSP@5 / objective,
    fusions evaluated)."""
    num_bins = num_bins or (int(label_bins.max()) + 1 if len(label_bins) else 1)
    alone = members_alone(labels, truth, inv_propensity)

    def scored(table):
        fused, _ = weighted_fusion(labels, normalised, table, sizes, top_k, label_bins)
        metrics = evaluate(fused, truth, ks=(1, 5), inv_propensity=inv_propensity)
        value = objective(metrics, alone)
        return value, {"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"], "objective": value}

    table = np.repeat(np.asarray(start, dtype=np.float64)[:, None], num_bins, axis=1)
    best, best_metrics = scored(table)
    evaluations, grid = 1, weight_grid(len(labels)) if grid is None else grid
    for _ in range(BIN_SEARCH_PASSES):
        changed = False
        for group in searched:
            for point in grid:
                if np.allclose(table[:, group[0]], point):
                    continue
                trial = table.copy()
                trial[:, list(group)] = np.asarray(point)[:, None]
                value, metrics = scored(trial)
                evaluations += 1
                if value > best + 1e-9:
                    table, best, best_metrics, changed = trial, value, metrics, True
        if not changed:
            break
    return table, best_metrics, evaluations


def choose_weights(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray], truth, inv_propensity: np.ndarray,
                   top_k: int, sizes: Sequence[int] | None = None) -> tuple[list[float], dict, int]:
    """The weights of weight_grid() whose fusion of the members' validation top lists scores best on
    FUSION_OBJECTIVE (ties: closest to equal weights, then the first tried).

    labels[m]: (V, k) label ids of member m on the validation rows; normalised[m]: (V, k) its normalised
    scores; truth: (V, L_total) sparse; inv_propensity: (L_total,); sizes: the members' vocabulary sizes (see
    weighted_scores). Returns (weights, the chosen fusion's validation P@1 / PSP@5 / objective, number of weight
    combinations tried)."""
    grid = weight_grid(len(labels))
    equal = 1.0 / len(labels)
    alone = members_alone(labels, truth, inv_propensity)
    best_weights, best_metrics, best_value, best_distance = None, None, -math.inf, math.inf
    for weights in grid:
        fused, _ = weighted_fusion(labels, normalised, weights, sizes, top_k)
        metrics = evaluate(fused, truth, ks=(1, 5), inv_propensity=inv_propensity)
        value = objective(metrics, alone)
        distance = sum((weight - equal) ** 2 for weight in weights)
        if value > best_value + 1e-9 or (value > best_value - 1e-9 and distance < best_distance - 1e-12):
            best_weights, best_value, best_distance = list(weights), value, distance
            best_metrics = {"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"], "objective": value}
    return best_weights, best_metrics, len(grid)


def label_depth(counts: np.ndarray) -> np.ndarray:
    """(L,) each label's training documents -> (L,) log10(1 + n): how frequent a label is, as the stacked model
    reads it."""
    return np.log10(1.0 + np.asarray(counts, dtype=np.float64))


def stacking_feature_names(num_members: int) -> list[str]:
    """The stacked model's features in order: STACKING_FEATURES for each member, then STACKING_LABEL_FEATURES."""
    return [f"member {member + 1}: {name}" for member in range(num_members) for name in STACKING_FEATURES] \
        + list(STACKING_LABEL_FEATURES)


def candidate_features(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray],
                       label_depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every label in some member's top list, and what the stacked model reads of it.

    labels[m]: (N, k) label ids of member m (-1: empty); normalised[m]: (N, k) its normalised scores; label_depth:
    (L,) log10(1 + each label's training documents). Returns ids (N, M k), each label once per document (-1 in
    the slots of empty and repeated ids), and features (N, M k, 4 M + 2) in the order of stacking_feature_names:
    per member its normalised score of the label (0 outside its top list), whether the label is in its top list,
    both times the label's depth; then the depth and its square."""
    ids = np.concatenate([np.asarray(member_labels, dtype=np.int64) for member_labels in labels], axis=1)
    if ids.size and ids.max() >= len(label_depth):
        raise DamagedModel(f"a member ranked label {int(ids.max())}, beyond the {len(label_depth)} labels the "
                           "ensemble's stacked model knows; rebuild the ensemble with `xmcbench ensemble`")
    # a stable sort keeps each id's first slot first: the later slots of the same id are the repeats
    order = np.argsort(ids, axis=1, kind="stable")
    in_order = np.take_along_axis(ids, order, axis=1)
    repeated = np.zeros(ids.shape, dtype=bool)
    np.put_along_axis(repeated, order[:, 1:], in_order[:, 1:] == in_order[:, :-1], axis=1)
    ids = np.where(repeated | (ids < 0), -1, ids)
    depth = np.where(ids >= 0, label_depth[np.maximum(ids, 0)], 0.0)                      # (N, C)
    columns = []
    for member_labels, member_scores in zip(labels, normalised):
        member_labels = np.asarray(member_labels, dtype=np.int64)
        member_scores = np.asarray(member_scores, dtype=np.float64)
        present = np.zeros(ids.shape)
        score = np.zeros(ids.shape)
        # a block of rows at a time: the comparison is (rows, C, k)
        step = max(1, STACKING_BLOCK_ELEMENTS // max(1, ids.shape[1] * member_labels.shape[1]))
        for start in range(0, len(ids), step):
            block = slice(start, start + step)
            match = (ids[block, :, None] == member_labels[block, None, :]) & (ids[block, :, None] >= 0)
            present[block] = match.any(axis=2)
            score[block] = np.where(match, member_scores[block, None, :], 0.0).max(axis=2)
        columns += [score, present, score * depth, present * depth]
    return ids, np.stack(columns + [depth, depth * depth], axis=2)


def stacking_logits(features: np.ndarray, stacking: dict) -> np.ndarray:
    """(..., F) candidate features -> (...) the stacked model's log-odds that the label is relevant."""
    return features @ np.asarray(stacking["coefficients"], dtype=np.float64) + float(stacking["intercept"])


def ranked_candidates(ids: np.ndarray, values: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, C) candidate ids (-1: none) and their ranking values -> the top_k labels (N, top_k) int64 (-1 padded)
    and their values (N, top_k) float32 (the lowest float32 where padded); ties by ascending id."""
    values = np.where(ids >= 0, values, -np.inf)
    order = np.lexsort((np.where(ids >= 0, ids, np.iinfo(np.int64).max), -values), axis=1)[:, :top_k]
    chosen, chosen_values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
    padding = max(0, top_k - ids.shape[1])
    empty = chosen_values == -np.inf
    out_labels = np.pad(np.where(empty, -1, chosen), ((0, 0), (0, padding)), constant_values=-1)
    lowest = np.finfo(np.float32).min
    out_values = np.pad(np.where(empty, lowest, chosen_values), ((0, 0), (0, padding)), constant_values=lowest)
    return out_labels.astype(np.int64), out_values.astype(np.float32)


def stacked_ranking(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray], stacking: dict,
                    label_depth: np.ndarray, label_log_inverse_propensity: np.ndarray,
                    top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The stacked model's top-k: each candidate (candidate_features) ranked by its log-odds plus alpha x log(1 /
    propensity), which is alpha = 0 the order of the estimated probabilities (what maximises expected P@k) and
    alpha = 1 their order weighted by inverse propensity (what maximises expected PSP@k). Shapes as in
    candidate_features; returns (N, top_k) labels and values as ranked_candidates."""
    candidates = sum(np.asarray(member_labels).shape[1] for member_labels in labels)
    features_per_row = candidates * (len(STACKING_FEATURES) * len(labels) + len(STACKING_LABEL_FEATURES))
    step = max(1, STACKING_BLOCK_ELEMENTS // max(1, features_per_row))   # the features of a block of rows at a time
    ranked = []
    for start in range(0, len(np.asarray(labels[0])), step):
        block = slice(start, start + step)
        ids, features = candidate_features([np.asarray(member_labels)[block] for member_labels in labels],
                                           [np.asarray(member_scores)[block] for member_scores in normalised],
                                           label_depth)
        values = stacking_logits(features, stacking) \
            + float(stacking["alpha"]) * label_log_inverse_propensity[np.maximum(ids, 0)]
        ranked.append(ranked_candidates(ids, values, top_k))
    if not ranked:
        return ranked_candidates(np.full((0, candidates), -1, dtype=np.int64), np.zeros((0, candidates)), top_k)
    return np.concatenate([block[0] for block in ranked]), np.concatenate([block[1] for block in ranked])


def fit_stacking(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray], truth, inv_propensity: np.ndarray,
                 top_k: int, label_depth: np.ndarray, tail_alpha: float = 0.0) -> tuple[dict, dict, int] | None:
    """The stacked model fitted on the validation rows: a logistic regression (L2, C = STACKING_C) of whether each
    candidate is relevant on its features (candidate_features), then alpha, the weight of log(1 / propensity)
    in the ranking, the point of STACKING_ALPHAS that scores best on FUSION_OBJECTIVE (ties: the smaller).

    Shapes as in choose_weights; label_depth: (L,), the labels the members can rank; tail_alpha: the largest
    tail_alpha of the members (served_metrics: each alpha is judged on the ranking with their tail slots). Returns
    (the stacked model, its validation P@1 / PSP@5 / objective, alphas tried), or None when the candidates hold
    fewer than STACKING_MIN_POSITIVES relevant labels or no irrelevant one (nothing to fit)."""
    from sklearn.linear_model import LogisticRegression   # scikit-learn loads only when a stacked model is fitted

    ids, features = candidate_features(labels, normalised, label_depth)
    present = ids >= 0
    positives = relevant(ids, truth)[present]
    if positives.sum() < STACKING_MIN_POSITIVES or positives.all():
        return None
    model = LogisticRegression(C=STACKING_C, max_iter=1000).fit(features[present], positives)
    stacking = {"coefficients": [float(value) for value in model.coef_[0]], "intercept": float(model.intercept_[0]),
                "features": stacking_feature_names(len(labels))}
    logits = stacking_logits(features, stacking)
    log_inverse = np.log(inv_propensity)[np.maximum(ids, 0)]
    alone = members_alone(labels, truth, inv_propensity)
    best_alpha, best_metrics = None, None
    for alpha in STACKING_ALPHAS:
        ranked = ranked_candidates(ids, logits + alpha * log_inverse, top_k)
        metrics = served_metrics(ranked, truth, inv_propensity, tail_alpha, log_scores=True)
        value = objective(metrics, alone)
        if best_metrics is None or value > best_metrics["objective"] + 1e-9:
            best_alpha, best_metrics = alpha, {"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"], "objective": value}
    return {**stacking, "alpha": best_alpha}, best_metrics, len(STACKING_ALPHAS)


def describe_weights(fusion: Fusion) -> str:
    """e.g. "lightxml 0.6, plt 0.4", or per weight bin "0-3 training documents: lightxml 0.2, plt 0.8; 4-100 ...",
    bins that share their weights named once as their group ("0-100 training documents: ..."); for a stacked
    fusion, its stacked model."""
    methods = fusion.record.get("member_methods") or [f"member {m + 1}" for m in range(len(fusion.weights))]

    def listed(weights):
        return ", ".join(f"{method} {weight:g}" for method, weight in zip(methods, weights))

    if fusion.stacking is not None:
        return (f"a stacked model of the members' normalised scores and the labels' training documents, ranking by "
                f"its log-odds + {fusion.stacking['alpha']:g} x log(1 / propensity)")
    if fusion.bin_weights is None:
        return listed(fusion.weights)
    return "; ".join(f"{name} training documents: {listed(weights)}"
                     for name, weights in shared_bin_weights(fusion.record.get("bins"), fusion.bin_weights))


def shared_bin_weights(bins: list | None, bin_weights: list) -> list[tuple[str, list]]:
    """A fusion's weights per bin as (name, weights), one entry per group of bins that share them: consecutive
    bins whose record (ensemble.json's "bins") names one "weights_shared_by" group are listed once, under that
    name; bins recorded without a group (ensembles built before groups existed) under their own name."""
    names = []
    for column, weights in enumerate(bin_weights):
        found = bins[column] if isinstance(bins, list) and column < len(bins) and isinstance(bins[column], dict) \
            else {}
        names.append(found.get("weights_shared_by") or found.get("training_documents")
                     or (WEIGHT_BIN_NAMES[column] if column < len(WEIGHT_BIN_NAMES) else "?"))
    return [(name, bin_weights[column]) for column, name in enumerate(names)
            if column == 0 or name != names[column - 1]]
