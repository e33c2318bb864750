"""Ensembles of saved runs: the paper's Table 3 (three encoders, or three label-cluster trees), and hybrids
of different method families (a transformer beside a linear tree method).

The fusion rules (`--fusion sum`, the paper's, and `--fusion weighted` and `--fusion stacked`, for mixed families)
are xmcbench.fusion's.

An ensemble directory:

    ensemble.json             {"schema", "members": [paths, relative to the ensemble directory], "top_k",
                               "label_names_sha256", "fusion": {"rule", "normalisation", and for weighted:
                               "weights" (one per member), "objective", the validation figures, "quantiles"
                               (per member), and with weights per bin "bin_weights" (per bin, per member) and
                               "label_bins" (each label's bin), and for stacked the same plus "stacking" (its
                               coefficients, intercept and alpha), "label_depth" and
                               "label_log_inverse_propensity" (per label); for both "tail_slots" ("after", and
                               "alpha", 0 for none; with alpha > 0 also "label_log_inverse_propensity")}}: all that
                               `predict` and `evaluate` need. Schema 1 for sum (as before), 2 for weighted, 3 for
                               weighted with weights per bin, 4 for stacked, 5 with tail slots (an older xmcbench
                               refuses what it cannot fuse right)
    config.json               method "ensemble(m1+m2+...)" (sum), "weighted-ensemble(m1+m2+...)" or
                              "stacked-ensemble(m1+m2+...)" (the --fusion asked for, also where weighted kept
                              its stacked model: schema 4 and "rule" say what ranks), dataset and version,
                              member 0's config, the fusion (without quantiles), so a report reads it like a run
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
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from xmcbench.config import TrainConfig
from xmcbench.errors import DamagedModel, XmcError
from xmcbench.formats import open_dataset
from xmcbench.fusion import FITTED_RULES, FUSION_OBJECTIVE, FUSION_RULES, MIN_BIN_POSITIVES, STACKING_MIN_POSITIVES, \
    WEIGHT_BIN_NAMES, WEIGHT_BINS, Fusion, choose_bin_weights, choose_tail_alpha, choose_weights, describe_weights, \
    fit_stacking, fuse, label_depth, members_alone, normalise, objective, score_quantiles, weight_bin_groups, \
    weight_group_name
from xmcbench.inference import Predictions
from xmcbench.labels import load_label_info
from xmcbench.metrics import evaluate
from xmcbench.models import load_model, predict_documents, saved_zero_shot_mask
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import Registry, build_registry
from xmcbench.rundir import PREDICTIONS_NPZ, VALIDATION_PREDICTIONS_FILE, environment, reading_of, save_predictions, \
    save_predictions_npz
from xmcbench.scoring import evaluation_config, filtered_pairs, propensities, remap_labels, score
from xmcbench.storage import read_json, write_json, written_beside

ENSEMBLE_FILE = "ensemble.json"
SCHEMA_VERSION = 5   # 1: sum (the only rule before weighted fusion), 2: weighted, 3: weighted with weights per bin,
#                      4: stacked, 5: tail slots (a fitted rule whose later places go by score over propensity)
MIN_TOP_K = 5   # the default eval_ks go to @5, and weighted fusion chooses its weights on PSP@5


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

def member_config(member: Member) -> TrainConfig:
    """The TrainConfig a member was trained with; a config.json it cannot be read from ends in one line."""
    try:
        return TrainConfig.from_dict(member.config.get("config", {}))
    except XmcError as error:
        raise XmcError(f"ensemble member {member.path}: config.json: {error}") from None


def scoring_config(members: list[Member], set_options: Sequence[str] = ()):
    """The TrainConfig whose eval_ks and propensity settings score an ensemble: its first member's (the one
    config.json shows), with `evaluate --set` scoring settings over them (scoring.evaluation_config)."""
    return evaluation_config(member_config(members[0]), set_options)


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
    return predict_documents(model, texts, texts_key, config, model_dir=member.path,
                             description=f"{description} ({member.path.name})",
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
    return (f"validation_size={settings.get('validation_size', '?')}, "
            f"validation_split={settings.get('validation_split', 'random')}, seed={settings.get('seed', '?')}, "
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


def fit_fusion(members: list[Member], dataset, top_k: int, rule: str = "weighted") -> Fusion:
    """The weighted or stacked fusion of these members (`rule`), fitted on their shared validation rows, then its
    tail slots (xmcbench.fusion.choose_tail_alpha; module docstring). A stacked one that cannot be fitted ends in
    one line saying why."""
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
    members_tail_alpha = max(member_config(member).tail_alpha for member in members)
    fusion = _fit_rule(members, rule, labels, scores, rows, quantiles, names, truth, inv_propensity, top_k,
                       members_tail_alpha)
    sizes = [len(member.label_names) for member in members]
    fused = fuse(labels, scores, top_k, fusion, sizes)          # the validation rows, before tail slots
    alpha, record = choose_tail_alpha(fused, [member_labels[:, :top_k] for member_labels in labels], truth,
                                      inv_propensity, log_scores=fusion.stacking is not None,
                                      members_tail_alpha=members_tail_alpha)
    fusion.record["tail_slots_chosen"] = record
    if alpha > 0:
        # the stacked model's own figures already hold its members' tail slots (fit_stacking): score the ranking
        before = evaluate(fused[0], truth, ks=(1, 5), inv_propensity=inv_propensity)
        fusion.record["validation_before_tail_slots"] = {
            "P@1": before["P@1"], "PSP@5": before["PSP@5"],
            "objective": objective(before, fusion.record["validation_members_alone"])}
        fusion.record["validation"] = next({key: found[key] for key in ("P@1", "PSP@5", "objective")}
                                           for found in record["alphas_tried"] if found["alpha"] == alpha)
        fusion.tail_alpha = alpha
        fusion.label_log_inverse_propensity = np.log(inv_propensity[:len(names)])
    return fusion


def _fit_rule(members: list[Member], rule: str, labels: list, scores: list, rows: np.ndarray, quantiles: list,
              names: list[str], truth, inv_propensity: np.ndarray, top_k: int, members_tail_alpha: float) -> Fusion:
    """fit_fusion's weights, weights per bin or stacked model, before tail slots; the stacked model's alpha is
    chosen on the validation ranking with the tail slots its members ranked with (members_tail_alpha)."""
    top_lists = [member_labels[:, :top_k] for member_labels in labels]
    normalised = [normalise(member_scores[:, :top_k], q) for member_scores, q in zip(scores, quantiles)]
    sizes = [len(member.label_names) for member in members]
    weights, chosen, tried = choose_weights(top_lists, normalised, truth, inv_propensity, top_k, sizes)
    alone = members_alone(top_lists, truth, inv_propensity)
    record = {"member_methods": [member.method for member in members], "objective": FUSION_OBJECTIVE,
              "validation_documents": int(len(rows)), "weight_combinations_tried": tried,
              "validation": chosen, "validation_members_alone": alone}
    counts = training_counts(members, len(names))
    if counts is None:
        if rule == "stacked":
            raise XmcError("--fusion stacked reads each label's training documents, but a member's model keeps no "
                           "label_info.json (trained by an older xmcbench); train it again, or use --fusion weighted")
        unknown = ("no: a member's model keeps no label_info.json (trained by an older xmcbench), so the labels' "
                   "training documents are not known")
        record["bin_weights_chosen"] = record["stacked_model_chosen"] = unknown
        return Fusion("weighted", weights, quantiles, record)
    label_bins = np.searchsorted(np.asarray(WEIGHT_BINS), counts, side="left")      # (L,) 0: at most 3 documents
    known = truth.indices[truth.indices < len(names)]
    positives = np.bincount(label_bins[known], minlength=len(WEIGHT_BIN_NAMES))
    searched = weight_bin_groups(positives)
    bins = [{"training_documents": name, "validation_positives": int(found),
             "weights_shared_by": next((weight_group_name(group) for group in searched if b in group), None)}
            for b, (name, found) in enumerate(zip(WEIGHT_BIN_NAMES, positives))]
    record["bins"] = bins
    fusion = Fusion("weighted", weights, quantiles, record)
    if len(searched) < 2:
        record["bin_weights_chosen"] = (f"no: the weight bins do not make two groups of {MIN_BIN_POSITIVES} "
                                        "validation positives")
    else:
        table, per_bin, evaluations = choose_bin_weights(top_lists, normalised, truth, inv_propensity, top_k, sizes,
                                                         label_bins, weights, searched, len(WEIGHT_BIN_NAMES))
        record["validation_one_weight_per_member"] = chosen
        record["bin_fusions_tried"] = evaluations
        if per_bin["objective"] <= chosen["objective"] + 1e-9:
            record["bin_weights_chosen"] = "no: weights per bin did not score better on the validation rows"
        else:
            record["bin_weights_chosen"] = "yes"
            record["validation"] = per_bin
            fusion = Fusion("weighted", weights, quantiles, record, table.T.tolist(), label_bins)
    if rule == "weighted" and len(set(sizes)) > 1:
        # the weights keep a zero-shot label (outside some member's vocabulary) its score; the stacked model would
        # read it as a label that member does not propose, and the validation rows hold none to learn otherwise
        record["stacked_model_chosen"] = ("no: the members' vocabularies differ (zero-shot labels), which the "
                                          "weights score and the stacked model cannot learn on validation rows")
        return fusion
    depth = label_depth(counts)
    fitted = fit_stacking(top_lists, normalised, truth, inv_propensity, top_k, depth, members_tail_alpha)
    if fitted is None:
        if rule == "weighted":
            record["stacked_model_chosen"] = (f"no: the validation rows hold fewer than {STACKING_MIN_POSITIVES} "
                                              "relevant labels (or no irrelevant one) among the members' top lists")
            return fusion
        raise XmcError(f"--fusion stacked needs {STACKING_MIN_POSITIVES} relevant labels (and an irrelevant one) "
                       f"among the members' top-{top_k} on the {len(rows)} validation rows, and they hold fewer; "
                       "train the members with a larger --set validation_size=N, or use --fusion weighted")
    stacking, validation, _ = fitted
    if rule == "weighted":
        if validation["objective"] <= record["validation"]["objective"] + 1e-9:
            record["stacked_model_chosen"] = "no: the stacked model did not score better on the validation rows"
            record["validation_stacked_model"] = validation
            return fusion
        record["stacked_model_chosen"] = "yes: it scored better on the validation rows than the weights"
    record["validation_weights"] = record["validation"]   # what the weights alone would have chosen
    record["validation"] = validation
    return Fusion("stacked", weights, quantiles, record, fusion.bin_weights, fusion.label_bins, stacking, depth,
                  np.log(inv_propensity[:len(depth)]))   # the vocabulary's labels: only those can be candidates


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
                       "of one method family), weighted (normalised scores, weights chosen on validation rows) or "
                       "stacked (normalised scores, a logistic regression fitted on validation rows)")


def build_ensemble(run_dirs: Sequence[Path], output: Path | None = None, top_k: int | None = None,
                   data_dir: Path | None = None, overwrite: bool = False, registry: Registry | None = None,
                   log=print, fusion: str = "sum") -> Path:
    """Write an ensemble directory of finished runs and score it on the test split; return the directory.
    fusion: "sum", "weighted" or "stacked" (see the module docstring)."""
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
    if fusion in FITTED_RULES:
        if not same_data:
            raise XmcError(f"--fusion {fusion} is fitted on the members' shared validation rows, so every "
                           f"member must be trained on one dataset; {first.path} was trained on {dataset_ref} and "
                           "another member was not")
        rule = fit_fusion(members, dataset, top_k, fusion)
        chosen = describe_weights(rule) if rule.stacking is not None else f"weights {describe_weights(rule)}"
        if rule.tail_alpha > 0:
            chosen += (f"; places after the first {rule.tail_after} by score x (1 / propensity) ^ "
                       f"{rule.tail_alpha:g}")
        log(f"{fusion} fusion: {chosen}, chosen on {rule.record['validation_documents']} validation documents "
            f"({FUSION_OBJECTIVE}: {rule.record['validation']['objective']:+.2f})")
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
                        source, combine_seconds, fusion)
    return output


def _write_ensemble(output: Path, members: list[Member], refs: list[str], top_k: int, sha: str, rule: Fusion,
                    dataset, dataset_ref: str, labels: np.ndarray, scores: np.ndarray, metrics: dict, source: str,
                    combine_seconds: float, requested: str) -> None:
    """The files of an ensemble directory (module docstring) into `output`, metrics.json last. requested: the
    --fusion asked for, which names the method: a weighted fusion that ranks with its stacked model stays
    "weighted-ensemble(...)", so the seeds of one hybrid make one row of a report whichever each kept."""
    first = members[0]
    # schema 1 for sum, which every xmcbench reads right; 2 makes one that predates weighted fusion refuse it, 3 one
    # that predates weights per bin (it would fuse with the one weight per member and say nothing), 4 one that
    # predates the stacked rule, 5 one that predates tail slots
    schema = 1 if rule.rule == "sum" else 5 if rule.tail_alpha > 0 else 4 if rule.rule == "stacked" \
        else 2 if rule.bin_weights is None else 3
    write_json(output / ENSEMBLE_FILE, {"schema": schema, "members": refs, "top_k": top_k,
                                        "label_names_sha256": sha, "fusion": rule.to_json()})
    write_json(output / "config.json", {
        "method": ("ensemble(" if requested == "sum" else f"{requested}-ensemble(")
        + "+".join(m.method for m in members) + ")",
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
