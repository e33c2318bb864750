"""A saved model, whichever kind: a run's model (built from components, or a whole method's) or an ensemble's
member models, fused as its ensemble.json says. One predict path and one evaluate path for every kind:
`xmcbench predict`, `xmcbench evaluate`, the Python API (xmcbench.api) and the tests all go through
SavedModel. Also here: rescoring a finished run's saved predictions under this version's metric definitions.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

import xmcbench
from xmcbench.config import TrainConfig, check_top_k
from xmcbench.data import Dataset
from xmcbench.ensemble import Ensemble, is_ensemble, read_ensemble, scoring_config
from xmcbench.errors import XmcError
from xmcbench.formats import FormatOptions, open_dataset
from xmcbench.fusion import fuse
from xmcbench.inference import Predictions
from xmcbench.models import load_model, predict_documents, saved_zero_shot_mask, test_documents
from xmcbench.prediction_files import read_predictions
from xmcbench.registry import Registry, build_registry
from xmcbench.rundir import FINISHED_MARKER, PREDICTIONS_NPZ, reading_of, save_predictions_npz
from xmcbench.scoring import evaluation_config, filtered_pairs, propensities, remap_labels, score
from xmcbench.storage import read_json, write_json


@dataclass
class SavedModel:
    """A run's model, or an ensemble's member models, read once; predict and evaluate reuse them.

    models: [(model, TrainConfig)], one per member (one for a run); label_names: (L,) the model's vocabulary
    (an ensemble's: its members' shared one); ensemble: the ensemble's description, None for a run."""

    path: Path
    models: list[tuple[Any, TrainConfig]]
    label_names: list[str]
    registry: Registry
    ensemble: Ensemble | None = None

    def top(self, documents: Callable[[Any], Any], width: int, texts_key: str | None,
            description: str = "predicting", tokenizing: str = "tokenizing") -> Predictions:
        """The top `width` labels of what documents(model) gives each model: the model's Predictions, or the
        members' fused (fusion.fuse; no recalled clusters). texts_key: the texts' key in the tokenization
        cache (None: not cached)."""
        found = []
        for index, (model, config) in enumerate(self.models):
            config = copy.copy(config)
            config.top_k = width
            names = (description, tokenizing)
            if self.ensemble is not None:   # the progress lines name the member they are about
                member = self.ensemble.members[index].path.name
                names = (f"{description} ({member})", f"{tokenizing} ({member})")
            folder = self.path if self.ensemble is None else self.ensemble.members[index].path
            found.append(predict_documents(model, documents(model), texts_key, config, model_dir=folder,
                                           description=names[0], tokenizing=names[1]))
        if self.ensemble is None:
            return found[0]
        labels, scores = fuse([p.labels for p in found], [p.scores for p in found], width, self.ensemble.fusion,
                              self.ensemble.sizes)
        return Predictions(labels, scores, None)

    def predict(self, texts: list[str], top_k: int = 10, threshold: float | None = None) -> list[dict]:
        """texts: (N,) str. Returns N dicts {"labels": [name, ...], "scores": [float, ...]}, best first, at most
        top_k each (fewer when threshold drops the labels scoring below it) — what `xmcbench predict` writes.
        An ensemble's members contribute their top max(top_k, K) labels, K from ensemble.json, and a run with
        tail slots (tail_alpha) ranks its top max(top_k, K) with them, K its top_k, so for top_k <= K the result
        is the start of the ranking `evaluate` scores."""
        check_top_k(top_k)
        config = self.models[0][1]
        width = top_k if self.ensemble is None and config.tail_alpha == 0 else \
            max(top_k, config.top_k if self.ensemble is None else self.ensemble.top_k)
        found = self.top(lambda model: texts, width, None)
        names = self.label_names
        results = [{"labels": [names[i] for i in row[:top_k] if i >= 0],
                    "scores": [round(float(s), 6) for i, s in zip(row[:top_k], values[:top_k]) if i >= 0]}
                   for row, values in zip(found.labels, found.scores)]
        return [keep_scores_at_least(result, threshold) for result in results]

    def scoring_config(self, set_options: Sequence[str] = ()) -> TrainConfig:
        """The settings the model is scored with: a run's own (an ensemble's first member's), with `--set`
        scoring settings over them (scoring.evaluation_config); checked before any data is read."""
        if self.ensemble is None:
            return evaluation_config(copy.copy(self.models[0][1]), set_options)
        config = scoring_config(self.ensemble.members, set_options)
        if max(config.eval_ks) > self.ensemble.top_k:
            raise XmcError(f"the ensemble keeps its top {self.ensemble.top_k} labels, fewer than eval_ks asks for "
                           f"(@{max(config.eval_ks)}); build it again with a larger top_k (`xmcbench ensemble ... "
                           f"--top-k {max(config.eval_ks)}`)")
        return config

    def recorded_dataset(self, data_dir: Path | None = None, reading: FormatOptions | None = None) -> Dataset:
        """The dataset the run (or the ensemble's members) was trained on, read as it was read, or with `reading`
        when given (not the defaults); data_dir: the folder of user-provided registered datasets."""
        name, recorded = self._recorded_data()
        reading = reading if reading not in (None, FormatOptions()) else recorded
        return open_dataset(self.registry, name, data_dir, reading)

    def _recorded_data(self) -> tuple[str, FormatOptions]:
        recorded = self.path / "config.json"
        if self.ensemble is not None:
            first = self.ensemble.members[0].config
            saved = read_json(recorded, "the ensemble's configuration") if recorded.is_file() else None
            name = saved.get("dataset") if isinstance(saved, dict) else None
            name = name if isinstance(name, str) else first.get("dataset")
            if not isinstance(name, str):
                raise XmcError(f"{self.path} does not say which dataset it was built on; pass the dataset to score "
                               "on (data=, or --dataset)")
            return name, reading_of(first)
        if not recorded.is_file():
            raise XmcError(f"{self.path} does not say which dataset it was trained on; pass the dataset to score on "
                           "(data=, or --dataset)")
        saved = read_json(recorded)
        return saved["dataset"], reading_of(saved)

    def evaluate(self, dataset: Dataset, config: TrainConfig) -> dict:
        """Metrics (as in metrics.json) of the model on the test split of `dataset`, scored with `config`
        (scoring_config): the propensities every run uses, the dataset's filtered pairs, and the zero-shot
        labels (for an ensemble, those no member had a training document for)."""
        width = config.top_k if self.ensemble is None else self.ensemble.top_k
        found = self.top(lambda model: test_documents(model, dataset, self.registry), width,
                         f"{dataset.version}/test", "predicting test", "tokenizing test")
        truth = remap_labels(dataset.test_labels, dataset.label_names, self.label_names)
        members = [(self.path, self.label_names)] if self.ensemble is None else \
            [(member.path, member.label_names) for member in self.ensemble.members]
        zero_shot = np.logical_and.reduce([saved_zero_shot_mask(path, names, truth.shape[1])
                                           for path, names in members])
        model = self.models[0][0] if self.ensemble is None else None   # a run's recaller coverage needs its clusters
        return score(found, truth, model, propensities(dataset, config, self.label_names), config.eval_ks,
                     filtered=filtered_pairs(dataset, "test", self.label_names), zero_shot=zero_shot,
                     families=self.registry.metric_families())


def load(path: Path, registry: Registry | None = None, threads: int | None = None) -> SavedModel:
    """The model of a run directory (or its model/ folder), or the member models of an ensemble directory,
    read once. threads: torch CPU threads of its predictions (None: the ones each model trained with)."""
    path = Path(path)
    registry = registry or build_registry()
    if threads is not None and threads < 1:
        raise XmcError(f"threads={threads}: give 1 or more torch CPU threads")

    def with_threads(config: TrainConfig) -> TrainConfig:
        return config if threads is None else replace(config, threads=threads)

    if is_ensemble(path):
        found = read_ensemble(path)
        models = []
        for member in found.members:
            model, config, names = load_model(member.path, registry)
            if names != member.label_names:
                raise XmcError(f"ensemble member {member.path} has another label vocabulary than the ensemble; "
                               "rebuild the ensemble with `xmcbench ensemble`")
            models.append((model, with_threads(config)))
        return SavedModel(path, models, found.label_names, registry, found)
    if not path.exists():
        raise XmcError(f"{path} does not exist; pass a run directory or an ensemble directory")
    model, config, names = load_model(path, registry)
    return SavedModel(path, [(model, with_threads(config))], names, registry)


def evaluate(path: Path, dataset_name: str | None = None, data_dir: Path | None = None,
             registry: Registry | None = None, options: FormatOptions | None = None,
             set_options: Sequence[str] = ()) -> dict:
    """Score a saved run or ensemble on a dataset's test split (the one it was trained on by default, read as
    it was read); options: how to read a dataset path; set_options: `--set` scoring settings over its own."""
    registry = registry or build_registry()
    saved = load(path, registry)
    config = saved.scoring_config(set_options)
    dataset = saved.recorded_dataset(data_dir, options) if dataset_name is None else \
        open_dataset(registry, dataset_name, data_dir, options)
    return saved.evaluate(dataset, config)


def predict_texts(path: Path, texts: list[str], top_k: int = 5, registry: Registry | None = None) -> list[dict]:
    """Top-k labels with scores for raw texts, with a saved run or ensemble (SavedModel.predict)."""
    check_top_k(top_k)
    return load(path, registry).predict(texts, top_k)


def keep_scores_at_least(result: dict, threshold: float | None) -> dict:
    """A predict result ({"labels", "scores"}) without the labels scoring below threshold (None: all kept)."""
    if threshold is None:
        return result
    kept = [(label, value) for label, value in zip(result["labels"], result["scores"]) if value >= threshold]
    return {**result, "labels": [label for label, _ in kept], "scores": [value for _, value in kept]}


def rescore_run(run_dir: Path, data_dir: Path | None = None, registry: Registry | None = None,
                log=print) -> dict:
    """Score a finished run's saved test predictions (predictions.safetensors) again under this version's
    metric definitions, on the dataset it was trained on, and rewrite its metrics.json (and write
    predictions.npz when missing); return the new metrics. The model files are not needed, so this works
    for runs whose weights were not kept or stayed on another machine. Recaller coverage needs the
    model's clusters: it is kept from the old metrics.json."""
    run_dir = Path(run_dir)
    for needed in ("config.json", FINISHED_MARKER, "predictions.safetensors", "model/labels.json"):
        if not (run_dir / needed).is_file():
            raise XmcError(f"{run_dir} is not a finished run with saved predictions ({needed} is missing); "
                           "pass a run directory that `xmcbench run` finished")
    registry = registry or build_registry()
    saved, previous = read_json(run_dir / "config.json"), read_json(run_dir / FINISHED_MARKER)
    config = TrainConfig.from_dict(saved["config"])
    label_names = read_json(run_dir / "model" / "labels.json")
    dataset = open_dataset(registry, saved["dataset"], data_dir, reading_of(saved))
    if saved.get("dataset_version") not in (None, dataset.version):
        raise XmcError(f"{run_dir} was trained on version {saved['dataset_version']} of {saved['dataset']}, "
                       f"which now reads as version {dataset.version}; its predictions are of other documents")
    saved = read_predictions(run_dir / "predictions.safetensors", len(label_names), "rerun the run to predict again; "
                             "its metrics.json is left as it was", documents=dataset.test_labels.shape[0])
    predictions = Predictions(saved.labels, saved.scores, None)
    if predictions.labels.shape[1] < max(config.eval_ks):
        raise XmcError(f"{run_dir} saved {predictions.labels.shape[1]} labels per document, fewer than "
                       f"eval_ks needs ({max(config.eval_ks)})")
    truth = remap_labels(dataset.test_labels, dataset.label_names, label_names)
    metrics = score(predictions, truth, None, propensities(dataset, config, label_names), config.eval_ks,
                    filtered=filtered_pairs(dataset, "test", label_names),
                    zero_shot=saved_zero_shot_mask(run_dir, label_names, truth.shape[1]),
                    families=registry.metric_families())
    kept = {key: previous[key] for key in ("dataset", "test_documents", "unseen_test_labels", "coverage")
            if key in previous}
    rescored = {**kept, **metrics, "rescored": {"xmcbench_version": xmcbench.__version__,
                                                "date": datetime.datetime.now().isoformat(timespec="seconds")}}
    if not (run_dir / PREDICTIONS_NPZ).is_file():
        save_predictions_npz(run_dir / PREDICTIONS_NPZ, predictions.labels, predictions.scores, label_names)
    write_json(run_dir / FINISHED_MARKER, rescored)
    log(f"{run_dir}: P@1 {previous.get('P@1', float('nan')):.2f} -> {metrics['P@1']:.2f}, "
        f"PSP@5 {previous.get('PSP@5', float('nan')):.2f} -> {metrics.get('PSP@5', float('nan')):.2f}")
    return rescored
