"""Ensembles of saved runs: the paper's Table 3 (three encoders, or three label-cluster trees), and hybrids
of different method families (a transformer beside a linear tree method).

Both fusion rules (`--fusion`) work on the union of the members' top-k label ids per document (a label
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
  one it is unsure of. Then the fused score is sum over members of w_m * normalised score, with weights
  w_m >= 0 summing to 1 chosen on the validation rows, never on the test set: a grid over the weights
  (steps of 1/10 for up to 4 members, coarser beyond, so at most MAX_GRID_POINTS combinations; equal weights
  always tried) maximising the validation objective (P@1 + PSP@5) / 2 - the aim of a hybrid is to beat each
  member on the frequent labels (P@1) and on the tail (PSP@5) at once. Ties go to the weights closest to
  equal. A member given weight 0 is left out.
  Weights per bin: then the labels are put in weight bins by their training documents (WEIGHT_BINS: at most 3,
  4 to 30, more; the counts the members' models saved in model/label_info.json), and each bin holding at least
  MIN_BIN_POSITIVES validation positives gets weights of its own, by coordinate ascent from the weights above
  (choose_bin_weights): one member may lead the head and another the tail. They are kept only when they score
  better on the validation rows than one weight per member; the record says which, and why.
  The validation rows: every member must have `validation_predictions.safetensors` (written by
  `xmcbench run` when validation_size > 0; see xmcbench.rundir.save_validation_predictions) over the same
  training rows, i.e. trained with the same seed, validation_size and max_train_docs. Their truth is the
  dataset's training labels at those rows; PSP@5's propensities are the ones every score uses
  (scoring.propensities).

An ensemble directory:

    ensemble.json             {"schema", "members": [paths, relative to the ensemble directory], "top_k",
                               "label_names_sha256", "fusion": {"rule", "normalisation", and for weighted:
                               "weights" (one per member), "objective", the validation figures, "quantiles"
                               (per member), and with weights per bin "bin_weights" (per bin, per member) and
                               "label_bins" (each label's bin)}}: all that `predict` and `evaluate` need. Schema 1
                               for sum (as before), 2 for weighted, 3 for weighted with weights per bin (an older
                               xmcbench refuses what it cannot fuse right)
    config.json               method "ensemble(m1+m2+...)" (sum) or "weighted-ensemble(m1+m2+...)", dataset
                              and version, member 0's config, the fusion (without quantiles), so a report
                              reads it like a run
    metrics.json              test metrics of the ensemble (written last: its presence marks a finished build)
    timings.json              members' training seconds and prediction ms/document, summed
    predictions.safetensors   the ensemble's test-set top-k (labels (N, k) int64, scores (N, k) float32)
    predictions.npz           the same as a scipy CSR score matrix, predictions_labels.json its column names
                              (rundir.save_predictions_npz)
    environment.json          library versions, platform, date

It is written into a new folder beside --output and swapped in when complete (storage.written_beside), so a
build that fails midway (a full disk, Ctrl-C) leaves an earlier ensemble there as it was.

Members must be finished runs sharing one label vocabulary (model/labels.json), or vocabularies of which each is
the beginning of the longest: a method that scores unseen labels (a dual encoder) extends the training labels
with the dataset's test-only ones, in the same order. The ensemble's vocabulary is then the longest, and under
the weighted rule a label only some members can score (a zero-shot label, outside the others' vocabulary) keeps
its score: its fused score is divided by the weight of the members that can score it. Building reuses the
members' saved test predictions when they all have them for the current version of one dataset (each file
checked by prediction_files.read_predictions: one damaged or changed after its run wrote it is refused);
otherwise (and always for `evaluate`) every member model predicts the test split, one model at a time.
The metrics are taken at the first member's eval_ks (build with --top-k >= max(eval_ks)). Propensities for
PSP@k, PSnDCG@k, PSR@k and the label counts of the frequency bins are the ones of every run and of
`xmcbench evaluate` (scoring.propensities: the dataset's whole training set, the first member's A and B), so
the ensemble's row compares with its members'.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from xmcbench.config import TrainConfig
from xmcbench.errors import DamagedModel, XmcError
from xmcbench.formats import open_dataset
from xmcbench.inference import Predictions
from xmcbench.metrics import evaluate
from xmcbench.labels import load_label_info
from xmcbench.models import load_model, predict_documents, saved_zero_shot_mask
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import Registry, build_registry
from xmcbench.rundir import PREDICTIONS_NPZ, VALIDATION_PREDICTIONS_FILE, environment, reading_of, save_predictions, \
    save_predictions_npz
from xmcbench.scoring import evaluation_config, filtered_pairs, propensities, remap_labels, score
from xmcbench.storage import read_json, write_json, written_beside

ENSEMBLE_FILE = "ensemble.json"
SCHEMA_VERSION = 3   # 1: sum (the only rule before weighted fusion), 2: weighted, 3: weighted with weights per bin
MIN_TOP_K = 5   # the default eval_ks go to @5, and weighted fusion chooses its weights on PSP@5
FUSION_RULES = ("sum", "weighted")
FUSION_OBJECTIVE = "(P@1 + PSP@5) / 2"
QUANTILES = 201          # validation-score quantiles kept per member: every half percent
MAX_GRID_POINTS = 2000   # weight combinations tried at most
# The weight bins: labels by their training documents, at most 3 (the tail, 0 included), 4 to 30, more (the head).
# Each bin gets weights of its own where the validation rows hold MIN_BIN_POSITIVES of its labels' positives.
WEIGHT_BINS = (3, 30)
WEIGHT_BIN_NAMES = ("0-3", "4-30", ">30")
MIN_BIN_POSITIVES = 50
BIN_SEARCH_PASSES = 2


# -- the combination rule ---------------------------------------------------------------------------

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


# -- weighted fusion --------------------------------------------------------------------------------

@dataclass
class Fusion:
    """How the members' scores are fused (see the module docstring). rule "sum": raw scores summed.
    rule "weighted": weights (one per member, >= 0, summing to 1) and quantiles (per member, its (Q,) sorted
    validation-score quantiles); record: what the weights were chosen on and how well they did. With
    bin_weights (one list of member weights per weight bin, WEIGHT_BINS) a label's scores are weighted by its
    bin's weights; label_bins: (L,) the bin of each label of the ensemble's vocabulary."""

    rule: str = "sum"
    weights: list[float] | None = None
    quantiles: list[np.ndarray] | None = None
    record: dict = field(default_factory=dict)
    bin_weights: list[list[float]] | None = None
    label_bins: np.ndarray | None = None

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
        return {"rule": "weighted", "normalisation": "validation-quantiles", "weights": self.weights, **bins,
                **self.record}

    def to_json(self) -> dict:
        """The fusion as ensemble.json keeps it: the summary, plus the quantiles (and label bins) for weighted."""
        if self.rule == "sum":
            return self.summary()
        bins = {} if self.label_bins is None else {"label_bins": [int(b) for b in self.label_bins]}
        return {**self.summary(), "quantiles": [[float(value) for value in q] for q in self.quantiles], **bins}

    @staticmethod
    def from_json(spec, num_members: int, path: Path) -> "Fusion":
        damaged = (f"{path} has a damaged \"fusion\" entry (a rule, and for weighted one weight and one list of "
                   "quantiles per member); rebuild the ensemble with `xmcbench ensemble`")
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
        record = {key: value for key, value in spec.items()
                  if key not in ("rule", "normalisation", "weights", "quantiles", "bin_weights", "label_bins")}
        return Fusion("weighted", weights, quantiles, record, bin_weights, label_bins)


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
    table = fusion.weight_table()
    # a member of weight 0 (in every bin) is left out before its scores are normalised
    normalised = [normalise(np.asarray(member_scores)[:, :top_k], quantiles) if weights.max() > 0 else None
                  for member_scores, quantiles, weights in zip(scores, fusion.quantiles, table)]
    return weighted_fusion([np.asarray(member_labels)[:, :top_k] for member_labels in labels], normalised,
                           table, sizes, top_k, fusion.label_bins)


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
    """The weights tried: every split of 1 into num_members shares in steps of 1/n (n = 10, or the finest of
    5, 4, 3, 2, 1 that keeps the grid within MAX_GRID_POINTS), plus equal weights."""
    steps = next(n for n in (10, 5, 4, 3, 2, 1) if math.comb(n + num_members - 1, num_members - 1) <= MAX_GRID_POINTS)
    points = []
    # stars and bars: num_members - 1 bars among steps + num_members - 1 places; the gaps are the shares
    for bars in itertools.combinations(range(steps + num_members - 1), num_members - 1):
        edges = (-1, *bars, steps + num_members - 1)
        points.append(tuple((edges[i + 1] - edges[i] - 1) / steps for i in range(num_members)))
    equal = tuple(1.0 / num_members for _ in range(num_members))
    if not any(np.allclose(point, equal) for point in points):
        points.append(equal)
    return points


def _objective(metrics: dict) -> float:
    return (metrics["P@1"] + metrics["PSP@5"]) / 2


def choose_bin_weights(labels: Sequence[np.ndarray], normalised: Sequence[np.ndarray], truth,
                       inv_propensity: np.ndarray, top_k: int, sizes: Sequence[int] | None, label_bins: np.ndarray,
                       start: Sequence[float], searched: Sequence[int],
                       num_bins: int | None = None) -> tuple[np.ndarray, dict, int]:
    """Weights per bin: from `start` (the weights of choose_weights) in every bin, each bin of `searched` in
    turn takes the point of weight_grid() that scores best on FUSION_OBJECTIVE over the validation rows, the
    other bins held, for BIN_SEARCH_PASSES passes (coordinate ascent; a change must beat the current
    objective). Shapes as in choose_weights; label_bins: (L,) each label's bin; num_bins: B (default: the
    highest bin in label_bins, plus one). Returns ((M, B) weights, their validation P@1 / PSP@5 / objective,
    fusions evaluated)."""
    num_bins = num_bins or (int(label_bins.max()) + 1 if len(label_bins) else 1)

    def scored(table):
        fused, _ = weighted_fusion(labels, normalised, table, sizes, top_k, label_bins)
        metrics = evaluate(fused, truth, ks=(1, 5), inv_propensity=inv_propensity)
        value = _objective(metrics)
        return value, {"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"], "objective": value}

    table = np.repeat(np.asarray(start, dtype=np.float64)[:, None], num_bins, axis=1)
    best, best_metrics = scored(table)
    evaluations, grid = 1, weight_grid(len(labels))
    for _ in range(BIN_SEARCH_PASSES):
        changed = False
        for column in searched:
            for point in grid:
                if np.allclose(table[:, column], point):
                    continue
                trial = table.copy()
                trial[:, column] = point
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
    best_weights, best_metrics, best_value, best_distance = None, None, -math.inf, math.inf
    for weights in grid:
        fused, _ = weighted_fusion(labels, normalised, weights, sizes, top_k)
        metrics = evaluate(fused, truth, ks=(1, 5), inv_propensity=inv_propensity)
        value = _objective(metrics)
        distance = sum((weight - equal) ** 2 for weight in weights)
        if value > best_value + 1e-9 or (value > best_value - 1e-9 and distance < best_distance - 1e-12):
            best_weights, best_value, best_distance = list(weights), value, distance
            best_metrics = {"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"], "objective": value}
    return best_weights, best_metrics, len(grid)


# -- members ----------------------------------------------------------------------------------------

@dataclass
class Member:
    path: Path            # as given (or as resolved from ensemble.json)
    config: dict          # the run's config.json
    label_names: list[str]
    labels_sha256: str

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))


def labels_digest(label_names: list[str]) -> str:
    """sha256 of the label list in canonical JSON (independent of file formatting)."""
    text = json.dumps(label_names, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_ensemble(directory: Path) -> bool:
    return (Path(directory) / ENSEMBLE_FILE).is_file()


def read_member(path: Path) -> Member:
    """A finished run directory usable as an ensemble member; anything else ends in one XmcError line."""
    path = Path(path)
    if not path.exists():
        raise XmcError(f"ensemble member {path} does not exist (give run directories written by `xmcbench run`)")
    if is_ensemble(path):
        raise XmcError(f"ensemble member {path} is itself an ensemble: give its member runs instead")
    if not (path / "config.json").is_file():
        raise XmcError(f"ensemble member {path} is not an xmcbench run directory (config.json is missing)")
    if not (path / "metrics.json").is_file():
        raise XmcError(f"ensemble member {path} is an unfinished run (metrics.json is missing): finish it with "
                       f"`xmcbench run --resume {path}` or leave it out of the ensemble")
    labels_path = path / "model" / "labels.json"
    for needed in (path / "model" / "model.json", labels_path):
        if not needed.is_file():
            raise XmcError(f"ensemble member {path} has no complete saved model ({needed} is missing); re-run training")
    config = read_json(path / "config.json", "the run's configuration")
    label_names = read_json(labels_path, "the label list")
    if not isinstance(config, dict) or not isinstance(label_names, list) \
            or not all(isinstance(name, str) for name in label_names):
        raise DamagedModel(f"ensemble member {path}: config.json or model/labels.json is damaged; re-run training")
    return Member(path, config, label_names, labels_digest(label_names))


def vocabulary(members: list[Member], expected_sha256: str | None = None) -> list[str]:
    """The ensemble's label vocabulary: the longest member's, of which every member's must be the beginning (one
    vocabulary, or the training labels and a member that adds the test-only ones after them); expected_sha256:
    the digest ensemble.json recorded for it. Anything else ends in one XmcError line."""
    longest = max(members, key=lambda member: len(member.label_names))
    for member in members:
        if member.label_names != longest.label_names[:len(member.label_names)]:
            differ = sorted(set(member.label_names) ^ set(longest.label_names[:len(member.label_names)]))
            detail = f"e.g. {differ[0]!r} is in one and not the other" if differ else "the same labels in another order"
            raise XmcError(f"ensemble member {member.path} has another label vocabulary than {longest.path} "
                           f"({len(member.label_names)} vs {len(longest.label_names)} labels, {detail}): members "
                           "must be trained on the same labels (a method that scores unseen labels may add the "
                           "test-only ones after them)")
    if expected_sha256 is not None and labels_digest(longest.label_names) != expected_sha256:
        raise XmcError(f"ensemble member {longest.path} has another label vocabulary than when the ensemble was "
                       "built (model/labels.json changed); rebuild the ensemble with `xmcbench ensemble`")
    return longest.label_names


# -- ensemble.json ----------------------------------------------------------------------------------

@dataclass
class Ensemble:
    directory: Path
    members: list[Member]
    member_refs: list[str]   # as written in ensemble.json
    top_k: int
    label_names_sha256: str
    fusion: Fusion
    label_names: list[str] = field(default_factory=list)   # the ensemble's vocabulary (see vocabulary())

    @property
    def sizes(self) -> list[int]:
        """The members' vocabulary sizes, for fuse()."""
        return [len(member.label_names) for member in self.members]


def read_ensemble(directory: Path) -> Ensemble:
    """The ensemble in `directory`, with every member re-checked (finished, same vocabulary as built)."""
    directory = Path(directory)
    path = directory / ENSEMBLE_FILE
    spec = read_json(path, "the ensemble description")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), int):
        raise DamagedModel(f"{path} is not an ensemble description (no schema number); rebuild it with "
                           "`xmcbench ensemble`")
    if spec["schema"] > SCHEMA_VERSION:
        raise XmcError(f"{path} has ensemble schema {spec['schema']} but this xmcbench reads {SCHEMA_VERSION} at "
                       "most; upgrade xmcbench")
    refs, top_k, sha = spec.get("members"), spec.get("top_k"), spec.get("label_names_sha256")
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs) \
            or not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1 or not isinstance(sha, str):
        raise XmcError(f"{path} lacks valid \"members\", \"top_k\" or \"label_names_sha256\": the ensemble "
                       "description is damaged; rebuild it with `xmcbench ensemble`")
    base = directory.resolve()
    members = [read_member(Path(ref) if Path(ref).is_absolute() else Path(os.path.normpath(base / ref)))
               for ref in refs]
    names = vocabulary(members, sha)
    return Ensemble(directory, members, refs, top_k, sha, Fusion.from_json(spec.get("fusion"), len(refs), path), names)


# -- scoring and predicting -------------------------------------------------------------------------

def scoring_config(members: list[Member], set_options: Sequence[str] = ()):
    """The TrainConfig whose eval_ks and propensity settings score an ensemble: its first member's (the one
    config.json shows), with `evaluate --set` scoring settings over them (scoring.evaluation_config)."""
    try:
        config = TrainConfig.from_dict(members[0].config.get("config", {}))
    except XmcError as error:
        raise XmcError(f"ensemble member {members[0].path}: config.json: {error}") from None
    return evaluation_config(config, set_options)


def _score(labels: np.ndarray, dataset, members: list[Member], families: tuple | None = None) -> dict:
    """Metrics of test-set top lists (ids in the members' vocabulary) at the first member's eval_ks, with the
    propensities every run and `xmcbench evaluate` use (scoring.propensities: the dataset's whole training
    set), so an ensemble's row compares with its members' rows; families: the registry's metric families (None:
    xmcbench's own)."""
    names = vocabulary(members)
    config = scoring_config(members)
    weights = propensities(dataset, config, names)
    truth = remap_labels(dataset.test_labels, dataset.label_names, names)
    # a label is zero-shot for the ensemble when no member had a training document for it
    zero_shot = np.logical_and.reduce([saved_zero_shot_mask(member.path, member.label_names, truth.shape[1])
                                       for member in members])
    return score(Predictions(labels, None, None), truth, None, weights, config.eval_ks,
                 filtered=filtered_pairs(dataset, "test", names), zero_shot=zero_shot, families=families)


def _predict_member(member: Member, texts: list[str], texts_key: str | None, top_k: int, registry: Registry,
                    description: str = "predicting") -> Predictions:
    model, config, label_names = load_model(member.path, registry)
    if label_names != member.label_names:
        raise XmcError(f"ensemble member {member.path} has another label vocabulary than the ensemble; rebuild "
                       "the ensemble with `xmcbench ensemble`")
    config.top_k = top_k
    return predict_documents(model, texts, texts_key, config, description=f"{description} ({member.path.name})",
                               tokenizing=f"tokenizing ({member.path.name})")


def _predict_test(members: list[Member], dataset, top_k: int, registry: Registry,
                  fusion: Fusion) -> tuple[np.ndarray, np.ndarray]:
    """Every member predicts the dataset's test split (one model in memory at a time); fused top-k."""
    found = [_predict_member(m, dataset.test_texts, f"{dataset.version}/test", top_k, registry,
                             description="predicting test") for m in members]
    return fuse([p.labels for p in found], [p.scores for p in found], top_k, fusion,
                [len(m.label_names) for m in members])


def _saved_predictions(members: list[Member], dataset, top_k: int):
    """The members' saved test predictions, or None when any is missing, of another dataset version or too
    short for top_k (then every member predicts again). A saved file that does not hold valid predictions
    (prediction_files.read_predictions) is refused: its member folder was damaged or changed."""
    labels, scores = [], []
    for member in members:
        path = member.path / "predictions.safetensors"
        if not path.is_file() or member.config.get("dataset_version") != dataset.version:
            return None
        saved = read_predictions(path, len(member.label_names), f"delete it, and the ensemble predicts the test "
                                 f"split with the model of {member.path} instead", documents=dataset.test_labels.shape[0])
        if saved.labels.shape[1] < top_k:
            return None
        labels.append(saved.labels)
        scores.append(saved.scores)
    return labels, scores


def _validation_settings(member: Member) -> str:
    settings = member.config.get("config", {})
    return (f"validation_size={settings.get('validation_size', '?')}, seed={settings.get('seed', '?')}, "
            f"max_train_docs={settings.get('max_train_docs', '?')}")


def _rerun_hint(reference: Member | None) -> str:
    if reference is None:
        return "`--set validation_size=N --set seed=S` (one N and S for every member)"
    settings = reference.config.get("config", {})
    return (f"`--set validation_size={settings.get('validation_size', 'N')} --set seed={settings.get('seed', 'S')}` "
            f"as {reference.path} was trained")


def _validation_predictions(members: list[Member], dataset, top_k: int) -> tuple[list, list, np.ndarray]:
    """The members' saved top lists on their validation rows: (labels [(V, k)], scores [(V, k)], rows (V,)),
    each file checked (prediction_files.read_predictions). Anything that keeps them from sharing one
    validation split ends in one XmcError line saying how to rerun."""
    paths = [member.path / VALIDATION_PREDICTIONS_FILE for member in members]
    with_file = [member for member, path in zip(members, paths) if path.is_file()]
    labels, scores, found_rows = [], [], []
    for member, path in zip(members, paths):
        if not path.is_file():
            raise XmcError(f"ensemble member {member.path} has no validation predictions "
                           f"({VALIDATION_PREDICTIONS_FILE}: it was trained without a validation split or by an "
                           "older xmcbench), and --fusion "
                           "weighted chooses its weights on validation rows, never on test; rerun it with "
                           f"{_rerun_hint(with_file[0] if with_file else None)}, or use --fusion sum")
        if member.config.get("dataset_version") != dataset.version:
            raise XmcError(f"ensemble member {member.path} was trained on another version of {dataset.name} than the "
                           "one here, so its validation rows may no longer be the same documents; rerun it, or use "
                           "--fusion sum")
        saved = read_predictions(path, len(member.label_names), "rerun the member",
                                 training_rows=dataset.train_labels.shape[0])
        member_labels, member_scores, rows = saved.labels, saved.scores, saved.rows
        if member_labels.shape[1] < top_k:
            raise XmcError(f"ensemble member {member.path} kept its top {member_labels.shape[1]} labels on the "
                           f"validation rows, fewer than --top-k {top_k}; pass --top-k {member_labels.shape[1]}")
        if found_rows and not np.array_equal(rows, found_rows[0]):
            raise XmcError(f"ensemble members {members[0].path} and {member.path} were validated on different "
                           f"training rows ({_validation_settings(members[0])} vs {_validation_settings(member)}): "
                           "--fusion weighted needs one validation split for all members; rerun them with the same "
                           "`--set validation_size=N --set seed=S` (and max_train_docs), or use --fusion sum")
        labels.append(member_labels)
        scores.append(member_scores)
        found_rows.append(rows)
    if found_rows[0].size == 0:
        raise XmcError(f"the members' validation predictions hold no rows; rerun them with {_rerun_hint(None)}")
    return labels, scores, found_rows[0]


def fit_fusion(members: list[Member], dataset, top_k: int) -> Fusion:
    """The weighted fusion of these members, fitted on their shared validation rows (module docstring)."""
    labels, scores, rows = _validation_predictions(members, dataset, top_k)
    quantiles = [score_quantiles(member_labels, member_scores, top_k)
                 for member_labels, member_scores in zip(labels, scores)]
    for member, member_quantiles in zip(members, quantiles):
        if member_quantiles.size == 0:
            raise XmcError(f"ensemble member {member.path} predicted no label for any validation row; it cannot be "
                           "weighed against the others")
    names = vocabulary(members)
    truth = remap_labels(dataset.train_labels[rows], dataset.label_names, names)
    inv_propensity = propensities(dataset, scoring_config(members), names).inverse
    top_lists = [member_labels[:, :top_k] for member_labels in labels]
    normalised = [normalise(member_scores[:, :top_k], q) for member_scores, q in zip(scores, quantiles)]
    sizes = [len(member.label_names) for member in members]
    weights, chosen, tried = choose_weights(top_lists, normalised, truth, inv_propensity, top_k, sizes)
    alone = []
    for member_labels in top_lists:
        metrics = evaluate(member_labels, truth, ks=(1, 5), inv_propensity=inv_propensity)
        alone.append({"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"], "objective": _objective(metrics)})
    record = {"member_methods": [member.method for member in members], "objective": FUSION_OBJECTIVE,
              "validation_documents": int(len(rows)), "weight_combinations_tried": tried,
              "validation": chosen, "validation_members_alone": alone}
    counts = training_counts(members, len(names))
    if counts is None:
        record["bin_weights_chosen"] = ("no: a member's model keeps no label_info.json (trained by an older "
                                        "xmcbench), so the labels' training documents are not known")
        return Fusion("weighted", weights, quantiles, record)
    label_bins = np.searchsorted(np.asarray(WEIGHT_BINS), counts, side="left")      # (L,) 0: at most 3 documents
    known = truth.indices[truth.indices < len(names)]
    positives = np.bincount(label_bins[known], minlength=len(WEIGHT_BIN_NAMES))
    searched = [b for b, found in enumerate(positives) if found >= MIN_BIN_POSITIVES]
    bins = [{"training_documents": name, "validation_positives": int(found)}
            for name, found in zip(WEIGHT_BIN_NAMES, positives)]
    if len(searched) < 2:
        record["bins"] = bins
        record["bin_weights_chosen"] = (f"no: fewer than two weight bins hold {MIN_BIN_POSITIVES} validation "
                                        "positives")
        return Fusion("weighted", weights, quantiles, record)
    table, per_bin, evaluations = choose_bin_weights(top_lists, normalised, truth, inv_propensity, top_k, sizes,
                                                     label_bins, weights, searched, len(WEIGHT_BIN_NAMES))
    record["bins"] = bins
    record["validation_one_weight_per_member"] = chosen
    record["bin_fusions_tried"] = evaluations
    if per_bin["objective"] <= chosen["objective"] + 1e-9:
        record["bin_weights_chosen"] = "no: weights per bin did not score better on the validation rows"
        return Fusion("weighted", weights, quantiles, record)
    record["bin_weights_chosen"] = "yes"
    record["validation"] = per_bin
    return Fusion("weighted", weights, quantiles, record, table.T.tolist(), label_bins)


def training_counts(members: list[Member], num_labels: int) -> np.ndarray | None:
    """(L,) the training documents of each label of the ensemble's vocabulary, from the members' saved label
    information (model/label_info.json; members share their training rows, so they agree; a label beyond a
    member's vocabulary counts 0 there); None when a member's model keeps none."""
    counts = np.zeros(num_labels, dtype=np.int64)
    for member in members:
        info = load_label_info(member.path / "model", member.label_names, "re-run training")
        if info is None:
            return None
        counts[:len(info.counts)] = np.maximum(counts[:len(info.counts)], info.counts)
    return counts


def describe_weights(fusion: Fusion) -> str:
    """e.g. "lightxml 0.6, plt 0.4", or per weight bin "0-3: lightxml 0.2, plt 0.8; 4-30: ..."."""
    methods = fusion.record.get("member_methods") or [f"member {m + 1}" for m in range(len(fusion.weights))]

    def listed(weights):
        return ", ".join(f"{method} {weight:g}" for method, weight in zip(methods, weights))

    if fusion.bin_weights is None:
        return listed(fusion.weights)
    return "; ".join(f"{name} training documents: {listed(weights)}"
                     for name, weights in zip(WEIGHT_BIN_NAMES, fusion.bin_weights))


# -- the commands -----------------------------------------------------------------------------------

def _check_output(output: Path, members: list[Member], overwrite: bool) -> None:
    """Refuse to write over anything but an earlier ensemble (and that only with overwrite)."""
    resolved = output.resolve()
    for member in members:
        where = member.path.resolve()
        if where == resolved or resolved in where.parents:
            raise XmcError(f"--output {output} holds ensemble member {member.path}; choose another --output")
    if not output.exists() or not any(output.iterdir()):
        return
    if not is_ensemble(output):
        raise XmcError(f"{output} is not empty and holds no xmcbench ensemble; choose another --output")
    if not overwrite:
        raise XmcError(f"{output} already holds an ensemble; choose another --output or pass --overwrite")


def default_output(dataset: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"ensemble-{Path(dataset).name}-{stamp}"


def check_fusion(fusion: str) -> None:
    if fusion not in FUSION_RULES:
        raise XmcError(f"unknown --fusion {fusion!r}: choose sum (the paper's rule: raw scores summed, for members "
                       "of one method family) or weighted (normalised scores, weights chosen on validation rows)")


def build_ensemble(run_dirs: Sequence[Path], output: Path | None = None, top_k: int | None = None,
                   data_dir: Path | None = None, overwrite: bool = False, registry: Registry | None = None,
                   log=print, fusion: str = "sum") -> Path:
    """Write an ensemble directory of finished runs and score it on the test split; return the directory.
    fusion: "sum" or "weighted" (see the module docstring)."""
    check_fusion(fusion)
    if len(run_dirs) < 2:
        raise XmcError(f"an ensemble needs at least two runs, got {len(run_dirs)}")
    members = [read_member(Path(p)) for p in run_dirs]
    seen = {}
    for member in members:
        key = member.path.resolve()
        if key in seen:
            raise XmcError(f"run {member.path} is given twice (also as {seen[key]}); give each member once")
        seen[key] = member.path
    names = vocabulary(members)
    saved_k = [int(m.config.get("config", {}).get("top_k", 0) or 0) for m in members]
    top_k = top_k if top_k is not None else min(saved_k)
    if top_k < MIN_TOP_K:
        raise XmcError(f"--top-k {top_k} is too small: the metrics need each member's top {MIN_TOP_K} at least")
    deepest = max(scoring_config(members).eval_ks)
    if top_k < deepest:
        raise XmcError(f"--top-k {top_k} is too small: the first member's eval_ks go to @{deepest}; pass --top-k "
                       f"{deepest} (members that kept fewer labels are then asked to predict again)")
    first = members[0]
    dataset_ref = first.config.get("dataset")
    if not isinstance(dataset_ref, str):
        raise XmcError(f"ensemble member {first.path}: config.json does not say which dataset it was trained on")
    output = Path(output) if output else default_output(dataset_ref)
    _check_output(output, members, overwrite)

    registry = registry or build_registry()
    dataset = open_dataset(registry, dataset_ref, data_dir, reading_of(first.config))
    sha = labels_digest(names)
    same_data = all(m.config.get("dataset") == dataset_ref for m in members)
    if fusion == "weighted":
        if not same_data:
            raise XmcError("--fusion weighted chooses weights on the members' shared validation rows, so every "
                           f"member must be trained on one dataset; {first.path} was trained on {dataset_ref} and "
                           "another member was not")
        rule = fit_fusion(members, dataset, top_k)
        log(f"weighted fusion: weights {describe_weights(rule)}, chosen on {rule.record['validation_documents']} "
            f"validation documents ({FUSION_OBJECTIVE} {rule.record['validation']['objective']:.2f})")
    else:
        rule = Fusion()
    saved = _saved_predictions(members, dataset, top_k) if same_data else None
    started = time.perf_counter()
    if saved is not None:
        labels, scores = fuse(saved[0], saved[1], top_k, rule, [len(m.label_names) for m in members])
        source = "saved predictions"
    else:
        log("the members' saved test predictions cannot be reused (missing, another dataset or version, or fewer "
            f"than {top_k} labels): predicting the test split with every member")
        labels, scores = _predict_test(members, dataset, top_k, registry, rule)
        source = "predicted"
    combine_seconds = time.perf_counter() - started
    metrics = _score(labels, dataset, members, registry.metric_families())

    # written beside the output and swapped in when complete: a full disk or Ctrl-C midway leaves the earlier
    # ensemble (overwrite was checked above) as it was, and never a half-written one
    base = output.resolve()
    refs = [os.path.relpath(m.path.resolve(), base) for m in members]
    with written_beside(output) as staging:
        _write_ensemble(staging, members, refs, top_k, sha, rule, dataset, dataset_ref, labels, scores, metrics,
                        source, combine_seconds)
    return output


def _write_ensemble(output: Path, members: list[Member], refs: list[str], top_k: int, sha: str, rule: Fusion,
                    dataset, dataset_ref: str, labels: np.ndarray, scores: np.ndarray, metrics: dict, source: str,
                    combine_seconds: float) -> None:
    """The files of an ensemble directory (module docstring) into `output`, metrics.json last."""
    first = members[0]
    # schema 1 for sum, which every xmcbench reads right; 2 makes one that predates weighted fusion refuse it, 3 one
    # that predates weights per bin (it would fuse with the one weight per member and say nothing)
    schema = 1 if rule.rule == "sum" else 2 if rule.bin_weights is None else 3
    write_json(output / ENSEMBLE_FILE, {"schema": schema, "members": refs, "top_k": top_k,
                                        "label_names_sha256": sha, "fusion": rule.to_json()})
    write_json(output / "config.json", {
        "method": ("ensemble(" if rule.rule == "sum" else "weighted-ensemble(") + "+".join(m.method for m in members)
        + ")",
        "dataset": dataset_ref, "dataset_name": dataset.name, "dataset_version": dataset.version,
        "members": refs, "config": first.config.get("config", {}), "fusion": rule.summary(),
        "resolved": {**first.config.get("resolved", {}), "num_labels": len(vocabulary(members)),
                     "ensemble_members": len(members), "top_k": top_k, "fusion": rule.rule,
                     "member_methods": [m.method for m in members],
                     "member_seeds": [m.config.get("config", {}).get("seed") for m in members]}})
    timings = [read_json(m.path / "timings.json", "the run's timings") if (m.path / "timings.json").is_file()
               else {} for m in members]

    def total(key: str):
        values = [t.get(key) for t in timings]
        return float(sum(values)) if all(isinstance(v, (int, float)) for v in values) else None

    write_json(output / "timings.json", {
        "train_seconds": total("train_seconds"), "train_ms_per_document": total("train_ms_per_document"),
        "predict_seconds": total("predict_seconds"), "predict_ms_per_document": total("predict_ms_per_document"),
        "combine_ms_per_document": 1000 * combine_seconds / max(1, len(dataset.test_texts)),
        "metrics_from": source})
    write_json(output / "environment.json", environment())
    save_predictions(output / "predictions.safetensors", Predictions(labels, scores, None))
    save_predictions_npz(output / PREDICTIONS_NPZ, labels, scores, vocabulary(members))
    write_json(output / "metrics.json", {"dataset": dataset.name, "test_documents": len(dataset.test_texts),
                                         "unseen_test_labels": len(dataset.label_names) - dataset.num_labels,
                                         "members": len(members), "top_k": top_k, "fusion": rule.rule,
                                         "metrics_from": source, **metrics})
