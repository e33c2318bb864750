"""What the commands do, as plain functions the CLI and the tests both call.

A run: resolve the configuration, load the dataset, build label clusters (cached), build the model from
the registered components, tokenize (cached), train, predict the test set, score it, write the run
directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import platform
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import xmcbench
from xmcbench import clustering, whole_methods
from xmcbench.config import MAX_TOP_K, MethodSpec, TrainConfig, apply_overrides, check_options, check_top_k, \
    parse_set_options, read_config_file, resolve_config, training_stages
from xmcbench.data import Dataset, _dataset_files, data_dir_from_env, load_dataset, load_dataset_from_path
from xmcbench.defaults import RULE_VERSION, DatasetStatistics, Derived, DeviceFacts, dataset_statistics, \
    derive_settings
from xmcbench.distributed import Distributed, broadcast_text, from_environment, shutdown
from xmcbench.errors import XmcError, joined_line
from xmcbench.formats import FormatOptions, read_dataset
from xmcbench.interfaces import LabelClusters, WholeMethod
from xmcbench.labels import label_info
from xmcbench.metrics import evaluate, propensity_scores
from xmcbench.modelio import build_model, load_model_dir, save_model_dir, storage_dtype
from xmcbench.callbacks import JsonLog, ValidationLog, still_improving
from xmcbench.checkpoint import load_checkpoint
from xmcbench.device import pick_device, seed_everything, set_threads
from xmcbench.inference import Predictions, predict, recalled_truth
from xmcbench.model import XMCModel
from xmcbench.training import Trainer, TrainingInterrupted
from xmcbench.registry import COMPONENT_KINDS, Registry, build_registry
from xmcbench.rundir import ClaimedRun, claim_existing, claim_output, model_bytes
from xmcbench.storage import atomic_write, cache_dir, fingerprint, write_json
from xmcbench.tokenization import load_tokenizer, tokenize

FINISHED_MARKER = "metrics.json"
VALIDATION_PREDICTIONS_FILE = "validation_predictions.safetensors"   # see save_validation_predictions
PREDICTIONS_NPZ = "predictions.npz"   # the test top-k as a scipy CSR score matrix, see save_predictions_npz
IN_MEMORY = "in-memory:"   # the dataset name of data given as Python lists (xmcbench.api): never read from disk
SELECTION_METRICS = tuple(f"{name}@{k}" for name in ("P", "nDCG", "PSP", "PSnDCG", "R") for k in (1, 3, 5))
VERSIONED_PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "scipy", "scikit-learn", "safetensors")


@dataclass
class Plan:
    """Everything a run is decided by, before anything heavy happens.

    derived: the settings the dataset-aware rule chose (xmcbench.defaults), with what each follows from;
    empty when the method has a preset for the dataset. statistics, device: what the rule read.
    loaded: the dataset, when planning had to read it (the run then reads it no second time).
    preset: the key of the method's preset that applied, if one did."""

    method: str
    dataset: str
    config: TrainConfig
    derived: dict[str, Derived] = field(default_factory=dict)
    statistics: DatasetStatistics | None = None
    device: DeviceFacts | None = None
    loaded: Dataset | None = field(default=None, repr=False, compare=False)
    preset: str | None = None
    reading: FormatOptions = field(default_factory=FormatOptions)   # how a dataset path is read (--format, ...)

    def describe(self) -> dict:
        """What `xmcbench config` prints and config.json records about how the settings were chosen."""
        if self.statistics is None:
            return {"derived": {}}
        return {"derived": {key: derived.to_dict() for key, derived in self.derived.items()},
                "rule_version": RULE_VERSION, "dataset_statistics": self.statistics.to_dict(),
                "device_facts": self.device.to_dict()}


def plan_run(registry: Registry, method: str, dataset: str | None = None, config_file: Path | None = None,
             set_options: list[str] = (), seed: int | None = None, data_dir: Path | None = None,
             loaded: Dataset | None = None) -> Plan:
    """Resolve a run's settings. Without a preset of the method for the dataset, the dataset is read and its
    statistics decide the settings the user, the method and a config file leave open (xmcbench.defaults).
    loaded: the dataset, already read (compare plans many cells of one dataset)."""
    spec = registry.method(method)
    dataset = dataset or default_dataset(registry)
    check_dataset_name(registry, dataset)
    preset_key = preset_for(spec, dataset if dataset in registry.datasets else Path(dataset).name)
    options = list(set_options) + ([f"seed={seed}"] if seed is not None else [])
    to_derive = preset_key not in spec.presets and spec.derive is not None   # only a method derives a tree
    check_option_names(parse_set_options(options),
                       declared_options(registry, spec, resolve_config(spec, preset_key, config_file,
                                                                       tree_derived_later=to_derive)))
    config = resolve_config(spec, preset_key, config_file, options, tree_derived_later=to_derive)
    check_settings(registry, config, spec, tree_derived_later=to_derive)   # fail before any data is read
    if preset_key in spec.presets:
        return Plan(method, dataset, config, preset=preset_key)
    loaded = loaded or open_dataset(registry, dataset, data_dir)
    whole_methods.check_inputs(method, spec.whole_method, loaded, registry)
    pool = training_pool(loaded, config)
    statistics = dataset_statistics([loaded.train_texts[i] for i in pool] if loaded.train_texts else None,
                                    loaded.train_labels[pool][:, :loaded.num_labels].tocsr(),
                                    load_tokenizer(config.model_name) if config.model_name else None, seed=config.seed)
    device = device_facts(config)
    explicit = set(spec.defaults) | set(parse_set_options(options))
    if config_file is not None:
        explicit |= set(read_config_file(config_file))
    derived = {**derive_settings(statistics, device), **(spec.derive(statistics, device) if spec.derive else {})}
    derived = {key: value for key, value in derived.items() if key not in explicit}
    config = resolve_config(spec, preset_key, config_file, options,
                            derived={key: value.value for key, value in derived.items()})
    check_settings(registry, config, spec)
    return Plan(method, dataset, config, derived, statistics, device, loaded)


def default_dataset(registry: Registry) -> str:
    """The dataset a run uses when none is named: the first registered one whose plugin marks it
    (DatasetSpec.is_default; xmcbench's own datasets plugin marks its smallest)."""
    for name, entry in registry.datasets.items():
        if entry.value.is_default:
            return name
    raise XmcError("no dataset named and no installed plugin marks a default one: give --dataset NAME_OR_PATH "
                   "(`xmcbench datasets` lists them)")


def preset_for(spec: MethodSpec, name: str) -> str:
    """The key of the method's preset for a dataset name, matched without case or punctuation (a folder
    named "Big-Set-2" gets a preset keyed "bigset2"); the name itself when there is none."""
    def plain(text: str) -> str:
        return "".join(character for character in text.lower() if character.isalnum())
    if name in spec.presets:
        return name
    return next((key for key in spec.presets if plain(key) == plain(name)), name)


def check_dataset_name(registry: Registry, name: str) -> None:
    """A bare name that is both a registered dataset and a folder here is ambiguous: refuse it."""
    if name in registry.datasets and "/" not in name and Path(name).is_dir():
        raise XmcError(f"{name!r} is both a registered dataset and a folder in {Path.cwd()}; pass ./{name} for "
                       "the folder, or run from another folder for the registered dataset")


def check_settings(registry: Registry, config: TrainConfig, spec: MethodSpec | None = None,
                   tree_derived_later: bool = False) -> None:
    """Settings that can be checked without data: ranges, component names (not for a whole method, which
    has none), loggers, device, storage dtype, selection metric (tree_derived_later: TrainConfig.validate)."""
    config.validate(tree_derived_later=tree_derived_later)
    for kind in COMPONENT_KINDS if spec is None or spec.whole_method is None else ():
        if not getattr(config, kind):
            owner = f"the method {spec.name} names" if spec is not None else "the settings name"
            raise XmcError(f"{owner} no {kind}: name one in the method's defaults or with --set {kind}=NAME "
                           "(`xmcbench plugins` lists them)")
        registry.component(kind, getattr(config, kind))
    declared = declared_options(registry, spec, config)
    if declared:   # the options the method and its components declare: typed and checked like core settings
        config.options = check_options(config.options, declared, "--set / --config")
    if spec is not None and spec.whole_method is not None:
        if config.loggers:
            raise XmcError(f"loggers={','.join(config.loggers)}: {spec.name} fits on its own, without training steps "
                           "to log; drop the loggers setting")
    else:
        for name in config.loggers:
            registry.logger(name)
    pick_device(config)
    storage_dtype(config.storage_dtype)   # and not after training, when the model is saved
    if config.selection_metric not in SELECTION_METRICS:
        raise XmcError(f"selection_metric={config.selection_metric!r} is not a validation metric; choose one of "
                       f"{', '.join(SELECTION_METRICS)}")


def declared_options(registry: Registry, spec: MethodSpec | None, config: TrainConfig) -> dict[str, tuple]:
    """{name: (Option, owner)} of the options a run's method and the components its config names declare
    (`MethodSpec.options`, `registry.add_component(..., options=...)`); empty when none declares any."""
    declared: dict[str, tuple] = {}
    if spec is not None:
        declared.update({option.name: (option, f"method {spec.name}") for option in spec.options})
    for kind in COMPONENT_KINDS if spec is None or spec.whole_method is None else ():
        name = getattr(config, kind)
        for option in registry.component_options.get((kind, name), ()):
            declared.setdefault(option.name, (option, f"{kind} {name}"))
    return declared


def check_option_names(set_options: dict, declared: dict[str, tuple]) -> None:
    """`--set cosine_scale=5` for a declared option: say it is options.cosine_scale, not a core setting."""
    core = set(TrainConfig.__dataclass_fields__)
    for key in set_options:
        if "." not in key and key not in core and key in declared:
            raise XmcError(f"--set {key}: unknown setting {key!r}; {key} is an option of the "
                           f"{declared[key][1]}: --set options.{key}=VALUE")


def device_facts(config: TrainConfig) -> DeviceFacts:
    """The device a run will use, as the dataset-aware rule sees it (no CUDA initialisation on a CPU)."""
    wants_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if wants_cuda and torch.cuda.is_available():
        index = 0 if config.device == "auto" else (torch.device(config.device).index or 0)
        return DeviceFacts("cuda", round(torch.cuda.get_device_properties(index).total_memory / 2**30, 1))
    return DeviceFacts("cpu")


def open_dataset(registry: Registry, name: str, data_dir: Path | None = None,
                 options: FormatOptions | None = None) -> Dataset:
    """A registered dataset by name, or a folder or file by path: the raw-text layout first, else the one
    registered data format that recognises it (xmcbench.formats); `options` are the reading options
    (--format, --text-column, ...). A dataset may hold sparse features and no texts: the methods that cannot
    read it refuse it (whole_methods.check_inputs)."""
    options = options or FormatOptions()
    if name.startswith(IN_MEMORY):
        raise XmcError(f"{name} was data given as Python lists, which no file holds; pass the data again "
                       "(xmcbench.evaluate(run, data=...), or a dataset name or path)")
    path = Path(name).expanduser()
    if name in registry.datasets or not path.exists():
        if options != FormatOptions():
            raise XmcError(f"{', '.join(_flags(options))} read a folder or file, not the registered dataset {name!r}; "
                           "drop them, or pass the path of your data")
        return load_dataset(registry.dataset(name), data_dir_from_env(data_dir))
    if options == FormatOptions() and path.is_dir() and _dataset_files(path)[0]:
        return load_dataset_from_path(path)   # the raw-text layout, or an error naming the files it misses
    return read_dataset(registry, path, options)


def _flags(options: FormatOptions) -> list[str]:
    given = {"format": options.format_name, **options.given(), "label_texts": options.label_texts}
    return ["--" + key.replace("_", "-") for key, value in given.items() if value is not None and key != "seed"]


# -- label clusters ---------------------------------------------------------------------------------

def resolve_num_clusters(config: TrainConfig, num_labels: int) -> int:
    """Number of clusters K; K == num_labels means flat (one label per cluster)."""
    if config.num_clusters > 0:
        if config.num_clusters > num_labels:
            raise XmcError(f"num_clusters={config.num_clusters} exceeds the {num_labels} training labels")
        return config.num_clusters
    size = config.cluster_size
    if size == 0:
        size = 1 if num_labels < config.flat_below else config.auto_cluster_size
    if size == 1:
        return num_labels
    return clustering.num_clusters_for(num_labels, size)


def label_clusters(dataset: Dataset, config: TrainConfig, train_rows: np.ndarray) -> LabelClusters:
    """Balanced clusters of the training labels from their TF-IDF (or provided sparse) features, cached on
    disk per (dataset version, training rows, K, seed)."""
    num_labels = dataset.num_labels
    num_clusters = resolve_num_clusters(config, num_labels)
    if num_clusters == num_labels:
        return LabelClusters.from_assignment(torch.arange(num_labels), num_labels)
    key = fingerprint(dataset.version, train_rows.tolist() if len(train_rows) < len(dataset.train_texts) else "all",
                      num_clusters, config.seed, str(dataset.feature_file and dataset.feature_file.name),
                      clustering.ALGORITHM_VERSION,
                      *([f"zero-shot {config.zero_shot_labels}"] if config.zero_shot_labels else []))
    path = cache_dir() / "clusters" / f"{key}.npy"
    if path.exists():
        assignment = np.load(path, allow_pickle=False)
    else:
        if dataset.feature_file is not None:
            features = clustering.read_sparse_features(dataset.feature_file, len(dataset.train_texts))[train_rows]
        else:
            features = clustering.tfidf_features([dataset.train_texts[i] for i in train_rows])
        labels = dataset.train_labels[train_rows][:, :num_labels]
        assignment = clustering.balanced_clusters(clustering.label_features(features, labels), num_clusters,
                                                  seed=config.seed)

        def write(temporary: Path) -> None:
            with open(temporary, "wb") as file:
                np.save(file, assignment)

        atomic_write(path, write)
    return LabelClusters.from_assignment(torch.from_numpy(assignment), num_clusters)


# -- scoring ----------------------------------------------------------------------------------------

def label_document_counts(labels: sp.spmatrix) -> np.ndarray:
    """(L,) int64 documents per label column of (N, L) training labels: the one source of training label
    frequencies, for the propensities (PSP@k) and the frequency bins of the metrics alike."""
    return np.asarray((labels > 0).sum(axis=0)).ravel().astype(np.int64)


@dataclass(frozen=True)
class Propensities:
    """The propensity model behind every PSP@k, PSnDCG@k and PSR@k xmcbench writes (see propensities()).

    inverse: (L,) 1 / p_l; label_counts: (L,) training documents per label, which the frequency bins use
    too; a, b: Jain et al.'s A and B; train_documents: N of the model."""

    inverse: np.ndarray
    label_counts: np.ndarray
    a: float
    b: float
    train_documents: int

    def record(self) -> dict:
        """What metrics.json records as "propensity"."""
        return {"model": "Jain et al. 2016: p = 1 / (1 + (log N - 1) (B + 1)^A (N_l + B)^-A)", "a": self.a,
                "b": self.b, "train_documents": self.train_documents,
                "counts_from": "all training documents of the dataset (validation rows included)"}


def propensities(dataset: Dataset, config: TrainConfig | None = None,
                 label_names: list[str] | None = None) -> Propensities:
    """The one propensity definition of runs, whole-method runs, validation, `evaluate` and ensembles: label
    frequencies N_l and N from every training document of the dataset (a run's validation rows and the rows
    max_train_docs leaves out included), so one dataset gives one set of weights whatever a run trained on.
    A and B are the dataset's (DatasetSpec.propensity_a/b), unless config sets propensity_a / propensity_b
    (> 0). label_names: the label order of the result, e.g. a saved model's vocabulary (labels the dataset
    lacks count 0); None: the dataset's own order. Shapes (L,), L = len(label_names) plus the dataset's labels
    not among them (remap_labels), or len(dataset.label_names)."""
    a = config.propensity_a if config is not None and config.propensity_a > 0 else dataset.propensity_a
    b = config.propensity_b if config is not None and config.propensity_b > 0 else dataset.propensity_b
    labels = dataset.train_labels
    if label_names is not None:
        labels = remap_labels(labels, dataset.label_names, label_names)
    counts = label_document_counts(labels)
    num_docs = dataset.train_labels.shape[0]
    return Propensities(1.0 / propensity_scores(counts, num_docs, a, b), counts, float(a), float(b), int(num_docs))


def score(predictions: Predictions, truth: sp.csr_matrix, model: XMCModel | None, weights: Propensities,
          ks=(1, 3, 5), frequency_bins: bool = True, filtered: sp.csr_matrix | None = None,
          zero_shot: np.ndarray | None = None) -> dict:
    """Metrics of a prediction at the cut-offs ks (xmcbench.metrics.evaluate), with the frequency bins and
    the propensity model recorded under "propensity"; truth (N, L) in the label order of `weights`.
    filtered: (N, L) pairs removed from the predictions first (without_filtered_pairs), recorded under
    "filtered_pairs"; None when the dataset has no filter. zero_shot: (L,) bool, the labels no training document
    of the model carried (zero_shot_mask): adds the "zero_shot" figures."""
    recalled = None
    if predictions.recalled is not None:
        recalled = recalled_truth(truth, predictions.recalled, model.label_cluster.cpu().numpy())
    labels, removal = without_filtered_pairs(predictions.labels, filtered)
    metrics = evaluate(labels, truth, ks=ks, inv_propensity=weights.inverse, recalled_truth=recalled,
                       label_counts=weights.label_counts if frequency_bins else None, zero_shot=zero_shot)
    return {**metrics, **removal, "propensity": weights.record()}


def zero_shot_mask(model_counts: np.ndarray | None, num_model_labels: int, total_labels: int) -> np.ndarray:
    """(total_labels,) bool, True for the labels no training document of a model carried: those of its vocabulary
    with a count of 0 (LabelInfo.counts: the run's training rows), and every label beyond its vocabulary (the
    dataset's test-only labels, in remap_labels' order). model_counts None (a model saved before label
    information was kept): only the labels beyond its vocabulary."""
    mask = np.ones(total_labels, dtype=bool)
    mask[:num_model_labels] = False if model_counts is None else np.asarray(model_counts)[:num_model_labels] == 0
    return mask


def saved_zero_shot_mask(model_dir: Path, label_names: list[str], total_labels: int) -> np.ndarray:
    """zero_shot_mask of a saved model (a run directory or its model/ folder), from the training counts its
    label_info.json kept (only the labels beyond its vocabulary for a model saved before that file existed)."""
    from xmcbench.labels import load_label_info
    from xmcbench.modelio import REDO

    folder = Path(model_dir) / "model" if (Path(model_dir) / "model").is_dir() else Path(model_dir)
    info = load_label_info(folder, label_names, REDO)
    return zero_shot_mask(None if info is None else info.counts, len(label_names), total_labels)


def training_view(dataset: Dataset, config: TrainConfig, spec: MethodSpec, log=print) -> tuple[Dataset, list[str]]:
    """The dataset as a run trains on it, and the names of the labels held out of training.

    zero_shot_labels = s > 0: a seeded share s of the training labels that the test set has are held out: their
    positives are removed from every training document (validation rows included), and they stay in the test
    set, where only a method that reads label texts can find them. A method that scores unseen labels
    (MethodSpec.scores_unseen_labels) on a dataset with label texts gets every label in its vocabulary (num_labels
    = all of label_names), test-only labels included. Propensities stay the dataset's (all its training documents,
    before any hold-out), as for max_train_docs: one dataset, one set of weights."""
    held_out: list[str] = []
    if config.zero_shot_labels > 0:
        in_test = np.flatnonzero(np.asarray(dataset.test_labels[:, :dataset.num_labels].sum(axis=0)).ravel() > 0)
        count = int(round(config.zero_shot_labels * len(in_test)))
        chosen = np.sort(np.random.default_rng(config.seed).permutation(in_test)[:count])
        keep = np.ones(dataset.train_labels.shape[1], dtype=np.float32)
        keep[chosen] = 0.0
        train_labels = (dataset.train_labels @ sp.diags(keep)).tocsr()
        train_labels.eliminate_zeros()
        train_labels.sort_indices()   # the product leaves rows unsorted; readers may expect the canonical form
        dataset = dataclasses.replace(dataset, train_labels=train_labels)
        held_out = [dataset.label_names[i] for i in chosen]
        log(f"zero-shot split: {count} of the {len(in_test)} training labels the test set has held out of training "
            f"(zero_shot_labels={config.zero_shot_labels:g}, seed {config.seed})")
    if spec.scores_unseen_labels and dataset.label_texts is not None and dataset.num_labels < len(dataset.label_names):
        dataset = dataclasses.replace(dataset, num_labels=len(dataset.label_names))
    return dataset, held_out


def without_filtered_pairs(labels: np.ndarray, filtered: sp.csr_matrix | None) -> tuple[np.ndarray, dict]:
    """The one removal of filtered (document, label) pairs before scoring, as the Extreme Classification
    Repository's evaluation removes those of filter_labels_*.txt (Dataset.test_filter / train_filter).

    labels: (N, k) predicted label ids, best first, -1 for an empty slot; filtered: (N, L) 0/1 csr in the same
    label ids, or None. Returns the (N, k) labels with each listed pair taken out of its row, the labels after
    it moved up and -1 filling the end, and {"filtered_pairs": {"listed": pairs in the filter, "removed": pairs
    taken out of these predictions}} for metrics.json ({} without a filter)."""
    if filtered is None:
        return labels, {}
    labels = np.asarray(labels)
    filtered = sp.csr_matrix(filtered)
    width = np.int64(filtered.shape[1])
    listed = filtered.tocoo()
    listed_keys = np.unique(listed.row.astype(np.int64) * width + listed.col)
    rows = np.broadcast_to(np.arange(labels.shape[0], dtype=np.int64)[:, None], labels.shape)
    valid = (labels >= 0) & (labels < width)
    drop = np.zeros(labels.shape, dtype=bool)
    drop[valid] = np.isin(rows[valid] * width + labels[valid], listed_keys)
    order = np.argsort(drop, axis=1, kind="stable")   # kept labels first, in their order
    kept = np.take_along_axis(labels, order, axis=1)
    kept[np.take_along_axis(drop, order, axis=1)] = -1
    return kept, {"filtered_pairs": {"listed": int(listed_keys.size), "removed": int(drop.sum())}}


def filtered_pairs(dataset: Dataset, split: str = "test", label_names: list[str] | None = None,
                   rows: np.ndarray | None = None) -> sp.csr_matrix | None:
    """The dataset's filtered pairs of a split ("test" or "train", at `rows`), in the label order of
    `label_names` (remap_labels; None: the dataset's own), for score(filtered=...); None without a filter."""
    pairs = dataset.test_filter if split == "test" else dataset.train_filter
    if pairs is None:
        return None
    if rows is not None:
        pairs = pairs[rows]
    return pairs if label_names is None else remap_labels(pairs, dataset.label_names, label_names)


def room_for_filtered_pairs(config: TrainConfig, dataset: Dataset, log=print) -> None:
    """Raise config.top_k so that a document keeps max(eval_ks) predictions after its filtered pairs are removed
    (without_filtered_pairs): a filtered label in the top k would otherwise leave a slot empty at the deepest
    cut-off, a miss the repository's evaluation, which ranks 100 or more labels, never counts. Nothing changes
    for a dataset without filters."""
    most = max((int(np.diff(sp.csr_matrix(pairs).indptr).max(initial=0))
                for pairs in (dataset.test_filter, dataset.train_filter) if pairs is not None), default=0)
    needed = min(MAX_TOP_K, max(config.eval_ks) + most)
    if most and config.top_k < needed:
        log(f"top_k {config.top_k} -> {needed}: a document has up to {most} filtered (document, label) pairs, removed "
            f"from its predictions before scoring")
        config.top_k = needed


def training_pool(dataset: Dataset, config: TrainConfig) -> np.ndarray:
    """The training rows a run draws from, in a seeded order: all, or a subset of max_train_docs."""
    rows = np.random.default_rng(config.seed).permutation(dataset.train_labels.shape[0])   # texts may be absent
    return rows[:config.max_train_docs] if config.max_train_docs else rows


def split_train_rows(dataset: Dataset, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (training rows, validation rows) of the training set; the test set is never looked at."""
    rows = training_pool(dataset, config)
    if config.validation_size >= len(rows):
        raise XmcError(f"validation_size={config.validation_size} leaves no training documents "
                       f"(the training set has {len(rows)})")
    validation, training = rows[:config.validation_size], rows[config.validation_size:]
    return np.sort(training), np.sort(validation)


# -- the run ----------------------------------------------------------------------------------------

def default_output(plan: Plan) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{plan.method}-{Path(plan.dataset).name}-{stamp}"


def is_finished(run_dir: Path) -> bool:
    return (Path(run_dir) / FINISHED_MARKER).exists()


def plan_resume(run_dir: Path) -> Plan:
    """The plan recorded in an unfinished run directory."""
    from xmcbench.storage import read_json

    recorded = Path(run_dir) / "config.json"
    if not recorded.exists():
        raise XmcError(f"{run_dir} holds no run to resume (config.json is missing)")
    if is_finished(run_dir):
        raise XmcError(f"{run_dir} holds a finished run: nothing to resume")
    try:
        saved = read_json(recorded)
        return Plan(saved["method"], saved["dataset"], TrainConfig.from_dict(saved["config"]),
                    reading=reading_of(saved))
    except (OSError, ValueError, KeyError, TypeError):   # unreadable, not JSON, not the expected object
        raise XmcError(f"{recorded} is damaged (it lacks the run's method, dataset or settings); this run cannot "
                       "be resumed, start a new one") from None


def reading_of(saved: dict) -> FormatOptions:
    """The reading options a run recorded in its config.json ("reading", see write_run_config), so that
    --resume, evaluate, rescore and ensembles read its dataset path as the run did; defaults when none."""
    recorded = saved.get("reading") or {}
    return FormatOptions(**{key: value for key, value in recorded.items() if key in FormatOptions.__dataclass_fields__})


def environment(packages: tuple[str, ...] = ()) -> dict:
    """environment.json: library versions (`packages`: a method's own backends too, None when missing),
    platform, GPU, date."""
    versions = {"python": sys.version.split()[0], "xmcbench": xmcbench.__version__}
    for package in VERSIONED_PACKAGES + tuple(packages):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            if package in packages:
                versions[package] = None
    return {"versions": versions, "platform": platform.platform(), "processor": platform.processor(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


PEAK_RSS_RESET = Path("/proc/self/clear_refs")   # Linux: writing 5 restarts VmHWM from the memory in use now
PROCESS_STATUS = Path("/proc/self/status")


def reset_peak_memory() -> None:
    """Start a run's memory peaks from what the process holds now: `compare` trains its runs one after another
    in one process, and without the reset every run would report the largest peak of the runs before it."""
    try:
        PEAK_RSS_RESET.write_text("5")
    except OSError:
        pass   # not Linux: peak_memory_mb falls back to the process's lifetime peak
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def peak_memory_mb(device: torch.device) -> dict:
    """The peak resident memory since reset_peak_memory (VmHWM; elsewhere the process's ru_maxrss), and on a
    GPU the peak allocated by torch on `device`."""
    try:
        kilobytes = next(int(line.split()[1]) for line in PROCESS_STATUS.read_text().splitlines()
                         if line.startswith("VmHWM:"))
    except (OSError, StopIteration, IndexError, ValueError):
        kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    memory = {"peak_rss_mb": kilobytes / 1024}
    if device.type == "cuda":
        memory["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return memory


def run(plan: Plan, output: Path | None = None, data_dir: Path | None = None, overwrite: bool = False,
        registry: Registry | None = None, log=print, resume: bool = False) -> Path:
    """Train, predict and score one method on one dataset; return the run directory.

    resume=True continues the unfinished run in `output` from its last checkpoint (see plan_resume)."""
    registry = registry or build_registry()
    dist = from_environment()
    reset_peak_memory()
    try:
        return _run(plan, output, data_dir, overwrite, registry, log, resume, dist)
    finally:
        shutdown(dist)


def continues_from_scratch(registry: Registry, method: str) -> bool:
    """Whether an interrupted run of `method` is fitted again rather than resumed: a whole method whose fit keeps
    no checkpoints (whole_methods.keeps_checkpoints)."""
    whole_method = registry.method(method).whole_method
    return whole_method is not None and not whole_methods.keeps_checkpoints(whole_method)


def _run(plan: Plan, output: Path | None, data_dir: Path | None, overwrite: bool, registry: Registry, log,
         resume: bool, dist: Distributed) -> Path:
    """run() in one process of a (possibly distributed) run: every process trains and predicts its share,
    rank 0 alone writes the run directory and logs."""
    whole_method = registry.method(plan.method).whole_method
    if whole_method is not None:   # no components, no training loop: the method fits itself
        return whole_methods.run_whole_method(plan, whole_method, output, data_dir, overwrite, registry, log, resume,
                                              dist)
    config = plan.config
    if not dist.is_main:
        log = lambda line: None  # noqa: E731  (one voice per run)
    # everything that can refuse the run does so before the output folder is touched
    threads = set_threads(config)
    device = pick_device(config, dist)
    dataset = plan.loaded or open_dataset(registry, plan.dataset, data_dir, plan.reading)
    check_flat(plan, dataset, registry)
    room_for_filtered_pairs(plan.config, dataset, log)
    check_components(registry, plan, dataset)
    claimed = None
    output = Path(output) if output else default_output(plan)
    if dist.is_main:
        claimed = claim_existing(output) if resume else claim_output(output, overwrite, is_finished)
        output = claimed.directory
    if dist.enabled:   # every process writes into the one directory rank 0 claimed (names carry the time)
        output = Path(broadcast_text(dist, str(output)))
    try:
        return _train_and_write(plan, output, claimed, dataset, threads, device, registry, log, resume, dist)
    finally:
        if claimed is not None:
            claimed.release()


def runs_flat(registry: Registry, config: TrainConfig, num_labels: int) -> bool:
    """Whether a run scores every label with the recaller alone, without ranker or sampler: one label per cluster,
    unless the recaller is a retriever that shortlists labels for the ranker and sampler the settings name."""
    shortlists = config.recaller in registry.retrievers and bool(config.ranker and config.sampler)
    return resolve_num_clusters(config, num_labels) == num_labels and not shortlists


def check_flat(plan: Plan, dataset: Dataset, registry: Registry) -> None:
    """Refuse, before the run folder is touched, a flat run (one logit per label: no clusters, no ranker) of a
    method whose stages train the ranker on its own."""
    spec = registry.method(plan.method)
    flat = runs_flat(registry, plan.config, dataset.num_labels)
    stages = training_stages(spec.stages, plan.config)
    if flat and any("rank" in stage.losses and "recall" not in stage.losses for stage in stages):
        raise XmcError(f"{plan.method} trains a ranker in a stage of its own, which needs label clusters, and this run "
                       f"is flat ({dataset.num_labels} labels, below flat_below={plan.config.flat_below}, or "
                       "cluster_size=1): set cluster_size above 1 (e.g. --set cluster_size=8)")


def check_components(registry: Registry, plan: Plan, dataset: Dataset) -> None:
    """Run the checks of the components a run will use (`add_component(..., check=...)`: a flat run uses no
    ranker or sampler) on its settings and its labels (xmcbench.labels.label_info), before the output folder
    is touched; a refusal is one XmcError line naming the component."""
    config = plan.config
    flat = runs_flat(registry, config, dataset.num_labels)
    checks = [(kind, name, registry.component_checks[(kind, name)])
              for kind, name in components_that_ran(config, flat).items()
              if (kind, name) in registry.component_checks]
    if not checks:
        return
    labels = label_info(dataset, config, split_train_rows(dataset, config)[0])
    for kind, name, check in checks:
        try:
            check(config, labels)
        except XmcError as error:
            raise XmcError(f"{kind} {name} refuses this run: {joined_line(error)}") from None


def components_that_ran(config: TrainConfig, flat: bool) -> dict[str, str]:
    """config.json's record of the components a run used: a flat run has no ranker and no sampler, whatever
    its settings name."""
    return {"encoder": config.encoder, "recaller": config.recaller,
            "ranker": "none (flat)" if flat else config.ranker, "sampler": "none (flat)" if flat else config.sampler}


def _train_and_write(plan: Plan, output: Path, claimed: ClaimedRun | None, dataset: Dataset, threads: int,
                     device: torch.device, registry: Registry, log, resume: bool, dist: Distributed) -> Path:
    config = plan.config
    if resume:
        from xmcbench.storage import read_json

        recorded = read_json(output / "config.json")["dataset_version"]
        if recorded != dataset.version:
            raise XmcError(f"the dataset {plan.dataset} changed since {output} was started "
                           f"(version {dataset.version}, recorded {recorded}); start a new run instead")
    weights = propensities(dataset, config)   # the dataset's, before any label is held out of training
    dataset, held_out = training_view(dataset, config, registry.method(plan.method), log)
    log(f"{plan.method} on {dataset.name}: {len(dataset.train_texts)} train / {len(dataset.test_texts)} test "
        f"documents, {dataset.num_labels} labels; device {device}, {threads} threads"
        + (f", {dist.world_size} processes (global batch {config.batch_size}, about "
           f"{config.batch_size / dist.world_size:g} documents per process)" if dist.enabled else ""))
    if plan.preset:
        log(f"settings of the {plan.method} preset for {plan.preset} (--set and --config win over it)")
    if plan.derived:
        log(f"settings derived from the data (no {plan.method} preset for {dataset.name}; see config.json): "
            + ", ".join(f"{key} {value.value}" for key, value in plan.derived.items()))
    if dataset.report:
        log("input policies applied (see data_report.json): "
            + ", ".join(f"{key} {value}" for key, value in sorted(dataset.report.items())))
    seed_everything(config.seed)
    train_rows, validation_rows = split_train_rows(dataset, config)
    with dist.main_first():   # rank 0 fills the caches, the others read them
        clusters = label_clusters(dataset, config, train_rows)
    run_labels = label_info(dataset, config, train_rows, weights)
    model = build_model(registry, config, clusters, label_info=run_labels)
    if model.is_flat:
        dropped = (f"flat run ({dataset.num_labels} labels, one logit each): the ranker {config.ranker!r} and the "
                   f"sampler {config.sampler!r} are not used; --set cluster_size=8 (or more) trains them")
        log(("warning: " if registry.method(plan.method).needs_ranker else "") + dropped)
    tokenizer = model.encoder.tokenizer
    with dist.main_first():
        train_tokens = tokenize(dataset.train_texts, tokenizer, config.max_length, f"{dataset.version}/train",
                                description="tokenizing train")
        test_tokens = tokenize(dataset.test_texts, tokenizer, config.max_length, f"{dataset.version}/test",
                               description="tokenizing test")
    if dist.enabled:   # same initial weights everywhere (DDP also broadcasts them), different dropout masks
        torch.manual_seed(config.seed + dist.rank)

    def label_tokens():   # tokenized only when a component asks for label embeddings; names where no texts
        texts = run_labels.texts or run_labels.names
        with dist.main_first():
            return tokenize(list(texts), tokenizer, config.max_length,
                            f"{dataset.version}/label-{'texts' if run_labels.has_texts else 'names'}",
                            description="tokenizing label texts")

    validate = None
    if len(validation_rows):
        validation_tokens = train_tokens.subset(validation_rows)
        validation_truth = dataset.train_labels[validation_rows]

        selection_k = int(config.selection_metric.split("@")[1])   # validation scores only the metric it selects by

        def validate(candidate: XMCModel) -> float:
            found = predict(candidate, validation_tokens, config, device, description="validating", dist=dist)
            return score(found, validation_truth, candidate, weights, ks=(selection_k,), frequency_bins=False,
                         filtered=filtered_pairs(dataset, "train", rows=validation_rows))[config.selection_metric]

    if dist.is_main:
        output.mkdir(parents=True, exist_ok=True)
        if not resume:
            write_run_config(output, plan, dataset, registry, {
                "num_labels": dataset.num_labels, "num_clusters": clusters.num_clusters, "flat": clusters.is_flat,
                "components": components_that_ran(config, model.is_flat),
                "threads": threads, "device": str(device), "processes": dist.world_size,
                "train_docs": len(train_rows), "validation_docs": len(validation_rows),
                **({"zero_shot_labels": held_out} if held_out else {}),
                "encoder_loaded_dtype": model.encoder.loaded_dtype,
                "parameter_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")})
    stages = training_stages(registry.method(plan.method).stages, config)
    trainer = Trainer(model, train_tokens.subset(train_rows), dataset.train_labels[train_rows], config, device,
                      validate, checkpoint_dir=output / "checkpoints", stages=stages, dist=dist,
                      callbacks=[ValidationLog(log, config), *training_loggers(registry, config, output)]
                      if dist.is_main else (),
                      label_info=run_labels, label_tokens=label_tokens)
    if resume:
        state = load_checkpoint(output / "checkpoints")
        if state is not None:
            trainer.load_state_dict(state)
            log(f"resuming {output} at step {trainer.step} (epoch {trainer.epoch + 1})")
    try:
        model, _ = trainer.fit()
    except TrainingInterrupted as stop:
        raise TrainingInterrupted(f"{stop}; continue with: xmcbench run --resume {output}") from None
    trainer.finalize()   # e.g. a retriever builds its label index from the final weights
    epochs = stages[-1].epochs(config)
    if dist.is_main and still_improving(trainer.log, epochs):
        log(f"training ended at its budget of {epochs} epochs while the validation score was still improving: "
            "more epochs may score better (--set epochs=N; config.json records it)")
        note_budget(output, epochs, trainer.log)
    train_seconds = trainer.train_seconds
    started = time.perf_counter()
    predictions = predict(model, test_tokens, config, device, description="predicting test", dist=dist)
    predict_seconds = time.perf_counter() - started
    validation_predictions = None
    if len(validation_rows):   # kept for ensembles, which choose member weights on these rows, never on test
        validation_predictions = predict(model, validation_tokens, config, device,
                                         description="predicting validation", dist=dist)
    if not dist.is_main:
        return output
    metrics = score(predictions, dataset.test_labels, model, weights, config.eval_ks, filtered=dataset.test_filter,
                    zero_shot=zero_shot_mask(run_labels.counts, dataset.num_labels, len(dataset.label_names)))
    save_model_dir(output / "model", model, config, dataset.label_names[:dataset.num_labels], run_labels)
    write_results(output, dataset, metrics, predictions, validation_predictions, validation_rows, train_seconds,
                  trainer.documents_trained, predict_seconds, resume, device)
    if not config.keep_checkpoint:
        shutil.rmtree(output / "checkpoints", ignore_errors=True)
    return claimed.finish()


def note_budget(output: Path, epochs: int, log) -> None:
    """config.json's "budget": training stopped at its epoch cap with the validation score still rising
    (callbacks.still_improving), the scores per epoch with it."""
    from xmcbench.storage import read_json

    recorded = read_json(output / "config.json")
    recorded["budget"] = {"epochs": epochs, "still_improving": True,
                          "validation": [{"epoch": r["epoch"], "score": r["score"]} for r in log.validation]}
    write_json(output / "config.json", recorded)


def write_run_config(output: Path, plan: Plan, dataset: Dataset, registry: Registry, resolved: dict,
                     packages: tuple[str, ...] = ()) -> None:
    """config.json (the method, the dataset and its version, every setting, what was derived, `resolved`:
    what the run decided, such as threads, device and the training rows, and `provenance`: the code, options
    and option files behind the result, see compare.provenance) and environment.json (its code part too)."""
    from xmcbench.compare import provenance

    dataset_ref = plan.dataset if plan.dataset in registry.datasets or plan.dataset.startswith(IN_MEMORY) \
        else str(Path(plan.dataset).resolve())
    reading = {} if plan.reading == FormatOptions() else {"reading": dataclasses.asdict(plan.reading)}
    record = provenance(registry, plan.method, plan.config)
    write_json(output / "config.json", {"method": plan.method, "dataset": dataset_ref, "dataset_name": dataset.name,
                                        "dataset_version": dataset.version, "config": plan.config.to_dict(),
                                        **reading, **plan.describe(), "resolved": resolved, "provenance": record})
    code = {key: record[key] for key in ("xmcbench", "method", "components") if key in record}
    write_json(output / "environment.json", {**environment(packages), "provenance": code})


def write_results(output: Path, dataset: Dataset, metrics: dict, predictions: Predictions,
                  validation_predictions: Predictions | None, validation_rows: np.ndarray, train_seconds: float,
                  documents_trained: int, predict_seconds: float, resumed: bool, device: torch.device) -> None:
    """The files every finished run has besides its model: predictions (test, and validation when there is a
    split; the test top-k also as predictions.npz), timings.json, data_report.json, and metrics.json last,
    whose presence marks the run finished."""
    save_predictions(output / "predictions.safetensors", predictions)
    save_predictions_npz(output / PREDICTIONS_NPZ, predictions.labels, predictions.scores,
                         dataset.label_names[:dataset.num_labels])
    if validation_predictions is not None:
        save_validation_predictions(output / VALIDATION_PREDICTIONS_FILE, validation_predictions.labels,
                                    validation_predictions.scores, validation_rows)
    write_json(output / "timings.json", {
        "train_seconds": train_seconds,
        "train_ms_per_document": 1000 * train_seconds / max(1, documents_trained),
        "documents_trained": documents_trained,
        "predict_seconds": predict_seconds,
        "predict_ms_per_document": 1000 * predict_seconds / max(1, len(dataset.test_texts)),
        "resumed": resumed,
        "model_bytes": model_bytes(output),   # so reports can give the size when the model files stay elsewhere
        **peak_memory_mb(device)})
    write_json(output / "data_report.json", dataset.report)
    write_json(output / FINISHED_MARKER, {"dataset": dataset.name, "test_documents": len(dataset.test_texts),
                                          "unseen_test_labels": len(dataset.label_names) - dataset.num_labels,
                                          **metrics})


def save_predictions(path: Path, predictions: Predictions) -> None:
    """Test-set top-k as tensors (labels (N, k) int64, scores (N, k) float32): for ensembles and checks."""
    from safetensors.numpy import save_file

    arrays = {"labels": predictions.labels, "scores": predictions.scores}
    if predictions.recalled is not None:
        arrays["recalled_clusters"] = predictions.recalled
    atomic_write(path, lambda temporary: save_file(arrays, str(temporary)))


def labels_file_of(npz_path: Path) -> Path:
    """The label-names file that goes with a predictions .npz: predictions.npz -> predictions_labels.json."""
    return Path(npz_path).with_name(Path(npz_path).stem + "_labels.json")


def save_predictions_npz(path: Path, labels: np.ndarray, scores: np.ndarray, label_names: list[str]) -> None:
    """The top-k as the sparse score matrix PECOS and pyxclib users exchange: a scipy CSR (N, L) of float32,
    row i holding the scores of document i's top-k labels (ids -1, empty slots, left out), written with
    scipy.sparse.save_npz; the L column names go beside it in labels_file_of(path), a JSON list.
    labels, scores: (N, k); label_names: (L,) the names of the label ids."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float32)
    rows = np.broadcast_to(np.arange(labels.shape[0])[:, None], labels.shape)
    kept = labels >= 0
    # built from (data, indices, indptr) directly: a COO conversion would drop nothing but sums duplicates,
    # and a score of 0.0 is a prediction that must stay a stored entry
    order = np.lexsort((labels[kept], rows[kept]))
    indptr = np.concatenate(([0], np.cumsum(kept.sum(axis=1))))
    matrix = sp.csr_matrix((scores[kept][order], labels[kept][order].astype(np.int32), indptr),
                           shape=(labels.shape[0], len(label_names)))

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as file:   # a file object: given a name, numpy would append ".npz" to it
            sp.save_npz(file, matrix, compressed=True)

    atomic_write(path, write)
    write_json(labels_file_of(path), list(label_names))


def save_validation_predictions(path: Path, labels: np.ndarray, scores: np.ndarray, rows: np.ndarray) -> None:
    """The final model's top-k on the validation rows, for choosing ensemble weights without the test set
    (xmcbench.ensemble, --fusion weighted). Every method writes this one format:

    labels (V, k) int64 label ids (-1: empty slot), scores (V, k) float32, rows (V,) int64 = the training-set
    row indices of the validation documents, as split_train_rows returns them (sorted)."""
    from safetensors.numpy import save_file

    labels, scores, rows = np.asarray(labels), np.asarray(scores), np.asarray(rows)
    if labels.ndim != 2 or labels.shape != scores.shape or rows.shape != (labels.shape[0],):
        raise ValueError(f"validation predictions need labels and scores of one shape (V, k) and rows (V,), got "
                         f"{labels.shape}, {scores.shape} and {rows.shape}")
    arrays = {"labels": np.ascontiguousarray(labels, dtype=np.int64),
              "scores": np.ascontiguousarray(scores, dtype=np.float32),
              "rows": np.ascontiguousarray(rows, dtype=np.int64)}
    atomic_write(path, lambda temporary: save_file(arrays, str(temporary)))


def training_loggers(registry: Registry, config: TrainConfig, output: Path) -> list:
    """The run's loggers: the run directory's JSON log (training_log.json and loss.png, which reports read),
    then config.loggers in the order given."""
    return [JsonLog(output), *(registry.logger(name)(output, config) for name in config.loggers)]


# -- using a saved model ----------------------------------------------------------------------------

def evaluate_run(run_dir: Path, dataset_name: str | None = None, data_dir: Path | None = None,
                 registry: Registry | None = None, options: FormatOptions | None = None,
                 set_options: list[str] = ()) -> dict:
    """Score a saved model on a dataset's test split (its own training dataset by default); options: how to
    read a dataset path (open_dataset); set_options: evaluation settings (evaluation_config) over the run's."""
    from xmcbench.storage import read_json

    registry = registry or build_registry()
    model, config, label_names = load_saved_model(run_dir, registry)
    config = evaluation_config(config, set_options)
    if dataset_name is None:
        config_path = Path(run_dir) / "config.json"
        if not config_path.exists():
            raise XmcError(f"{run_dir} does not say which dataset it was trained on; pass --dataset")
        saved = read_json(config_path)
        dataset_name = saved["dataset"]
        options = options if options not in (None, FormatOptions()) else reading_of(saved)
    dataset = open_dataset(registry, dataset_name, data_dir, options)
    truth = remap_labels(dataset.test_labels, dataset.label_names, label_names)
    documents = test_documents(model, dataset, registry)
    predictions = predict_saved_model(model, documents, f"{dataset.version}/test", config,
                                      description="predicting test", tokenizing="tokenizing test")
    return score(predictions, truth, model, propensities(dataset, config, label_names), config.eval_ks,
                 filtered=filtered_pairs(dataset, "test", label_names),
                 zero_shot=saved_zero_shot_mask(run_dir, label_names, truth.shape[1]))


def rescore_run(run_dir: Path, data_dir: Path | None = None, registry: Registry | None = None,
                log=print) -> dict:
    """Score a finished run's saved test predictions (predictions.safetensors) again under this version's
    metric definitions, on the dataset it was trained on, and rewrite its metrics.json (and write
    predictions.npz when missing); return the new metrics. The model files are not needed, so this works
    for runs whose weights were not kept or stayed on another machine. Recaller coverage needs the
    model's clusters: it is kept from the old metrics.json."""
    from xmcbench.prediction_files import read_predictions
    from xmcbench.storage import read_json

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
                    zero_shot=saved_zero_shot_mask(run_dir, label_names, truth.shape[1]))
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


# Settings that change how predictions are scored, not what a model predicts: `evaluate --set` takes these.
EVALUATION_SETTINGS = ("eval_ks", "propensity_a", "propensity_b")


def evaluation_config(config: TrainConfig, set_options: list[str] = ()) -> TrainConfig:
    """config with `--set` evaluation settings (EVALUATION_SETTINGS) applied, top_k raised to max(eval_ks)."""
    overrides = parse_set_options(list(set_options))
    others = [key for key in overrides if key not in EVALUATION_SETTINGS]
    if others:
        raise XmcError(f"--set {others[0]}: evaluate takes only the scoring settings {', '.join(EVALUATION_SETTINGS)}; "
                       "the model's other settings are fixed")
    config = apply_overrides(config, overrides, "--set")
    config.top_k = max(config.top_k, max(config.eval_ks))
    config.validate("--set")
    return config


def load_saved_model(run_dir: Path, registry: Registry) -> tuple[XMCModel | WholeMethod, TrainConfig, list[str]]:
    """The model of a run directory (or of its model/ folder), its config and label names, whichever kind it
    is: built from components (xmcbench.modelio) or a whole method's (xmcbench.whole_methods)."""
    if whole_methods.is_whole_method_model(run_dir):
        return whole_methods.load_model_dir(run_dir, registry)
    return load_model_dir(run_dir, registry)


def test_documents(model: XMCModel | WholeMethod, dataset: Dataset, registry: Registry) -> list[str] | sp.csr_matrix:
    """What a saved model reads of a dataset's test split: its texts, or its sparse features for a whole method
    that reads them (the choice its run made, whole_methods.reads_features)."""
    features = isinstance(model, WholeMethod) and whole_methods.reads_features(type(model), dataset)
    if not features and not dataset.test_texts:
        whole_methods.check_inputs("this model", None, dataset, registry)
    return whole_methods.documents_of(dataset, "test", None, features)


def predict_saved_model(model: XMCModel | WholeMethod, texts: list[str] | sp.csr_matrix, texts_key: str | None,
                        config: TrainConfig, description: str = "predicting",
                        tokenizing: str = "tokenizing") -> Predictions:
    """The top config.top_k labels of raw texts (or, for a whole method that reads them, (N, D) CSR sparse
    features) with a model from load_saved_model. texts_key: the texts' key in the tokenization cache (None:
    not cached); description, tokenizing: the progress lines' names."""
    if isinstance(model, WholeMethod):
        return whole_methods.predict(model, texts, config.top_k)
    set_threads(config)
    device = pick_device(config)
    tokens = tokenize(texts, model.encoder.tokenizer, config.max_length, texts_key, description=tokenizing)
    return predict(model, tokens, config, device, description=description)


def remap_labels(labels: sp.csr_matrix, names: list[str], model_names: list[str]) -> sp.csr_matrix:
    """Re-index label columns to the model's vocabulary; labels the model does not know go after it."""
    index = {name: i for i, name in enumerate(model_names)}
    unknown = [n for n in names if n not in index]
    index.update({name: len(model_names) + i for i, name in enumerate(unknown)})
    mapping = np.array([index[n] for n in names], dtype=np.int64)
    labels = labels.tocoo()
    return sp.csr_matrix((labels.data, (labels.row, mapping[labels.col])),
                         shape=(labels.shape[0], len(model_names) + len(unknown)))


# -- scoring predictions made elsewhere ------------------------------------------------------------

def ranked_labels(matrix: sp.csr_matrix, k: int) -> Predictions:
    """A (N, L) sparse score matrix -> its top k per row as Predictions: labels (N, k) int64 by descending
    score (ties: lower id first), scores (N, k) float32; rows with fewer stored entries end in -1 slots.
    Every stored entry is a prediction, whatever its score (0 and negative scores included)."""
    matrix = sp.csr_matrix(matrix)
    matrix.sum_duplicates()
    num_docs = matrix.shape[0]
    rows = np.repeat(np.arange(num_docs, dtype=np.int64), np.diff(matrix.indptr))
    order = np.lexsort((matrix.indices, -matrix.data, rows))
    rank = np.arange(rows.size) - matrix.indptr[rows]     # rows stay grouped in order: the row is the first key
    keep = rank < k
    labels = np.full((num_docs, k), -1, dtype=np.int64)
    scores = np.full((num_docs, k), -np.inf, dtype=np.float32)
    labels[rows[keep], rank[keep]] = matrix.indices[order][keep]
    scores[rows[keep], rank[keep]] = matrix.data[order][keep]
    return Predictions(labels, scores, None)


def _read_score_matrix(path: Path) -> sp.csr_matrix:
    path = Path(path)
    if not path.is_file():
        raise XmcError(f"{path} does not exist; pass a scipy sparse matrix saved with scipy.sparse.save_npz")
    try:
        matrix = sp.load_npz(path)
    except Exception as error:   # numpy and zipfile raise several types for a file that is not one
        raise XmcError(f"{path} is not a sparse matrix saved with scipy.sparse.save_npz ({type(error).__name__}: "
                       f"{joined_line(error)})") from None
    try:   # load_npz does not check the structure: an indptr that disagrees with the indices would fail later
        matrix = sp.csr_matrix(matrix, dtype=np.float64)
        matrix.check_format(full_check=True)
    except (ValueError, RuntimeError, IndexError, TypeError) as error:
        raise XmcError(f"{path} is not a consistent sparse matrix ({joined_line(error)}); save it again with "
                       "scipy.sparse.save_npz") from None
    if not np.all(np.isfinite(matrix.data)):
        raise XmcError(f"{path} holds scores that are not finite numbers (NaN or infinite); fix the system's output")
    return matrix


def _column_names(path: Path, labels_file: Path | None, num_columns: int, dataset: Dataset) -> list[str]:
    """The label name of each column of a score matrix: from labels_file (a JSON list, or one name per line),
    else from the file xmcbench writes beside its own (labels_file_of), else the dataset's label ids."""
    labels_file = labels_file or (labels_file_of(path) if labels_file_of(path).is_file() else None)
    if labels_file is None:
        if num_columns not in (dataset.num_labels, len(dataset.label_names)):
            raise XmcError(f"{path} has {num_columns} columns but {dataset.name} has {dataset.num_labels} training "
                           f"labels ({len(dataset.label_names)} with the test-only ones); give the name of each "
                           "column with --labels FILE")
        return list(dataset.label_names[:num_columns])
    from xmcbench.data import read_texts

    try:
        names = json.loads(Path(labels_file).read_text(encoding="utf-8")) if str(labels_file).endswith(".json") \
            else read_texts(labels_file)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise XmcError(f"cannot read the label names in {labels_file}: {error}") from None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise XmcError(f"{labels_file} must be a JSON list of label names, or one name per line")
    if len(names) != num_columns:
        raise XmcError(f"{labels_file} names {len(names)} labels but {path} has {num_columns} columns; one name "
                       "per column, in column order")
    if len(set(names)) != len(names):
        raise XmcError(f"{labels_file} names a label twice; one name per column")
    if names and not set(names) & set(dataset.label_names):
        raise XmcError(f"none of the {len(names)} label names in {labels_file} (e.g. {names[0]!r}) is a label of "
                       f"{dataset.name} (e.g. {dataset.label_names[0]!r}): every prediction would miss; give the "
                       "file that names the matrix's columns with the dataset's label names")
    return names


def evaluate_predictions(path: Path, dataset_name: str, data_dir: Path | None = None,
                         registry: Registry | None = None, options: FormatOptions | None = None,
                         set_options: list[str] = (), labels_file: Path | None = None) \
        -> tuple[dict, Dataset, TrainConfig]:
    """Score a score matrix that any system wrote (xmcbench's predictions.npz, PECOS, pyxclib, ...) on a
    dataset's test split, exactly as xmcbench scores its own runs.

    path: a scipy CSR (N_test, L) saved with scipy.sparse.save_npz, row i scoring test document i, every
    stored entry a predicted label; columns are the dataset's label ids (its sorted training labels, then
    the test-only ones), or named by labels_file (or by the labels file beside it, labels_file_of).
    set_options: scoring settings (EVALUATION_SETTINGS), over TrainConfig's defaults.
    Returns (metrics, the dataset, the config they were scored with)."""
    config = evaluation_config(TrainConfig(), set_options)
    registry = registry or build_registry()
    matrix = _read_score_matrix(path)
    dataset = open_dataset(registry, dataset_name, data_dir, options)
    num_test = dataset.test_labels.shape[0]
    if matrix.shape[0] != num_test:
        raise XmcError(f"{path} has {matrix.shape[0]} rows but the test split of {dataset.name} has {num_test} "
                       "documents; row i must score test document i")
    names = _column_names(path, labels_file, matrix.shape[1], dataset)
    truth = remap_labels(dataset.test_labels, dataset.label_names, names)
    predictions = ranked_labels(matrix, max(config.eval_ks))
    weights = propensities(dataset, config, names)
    # another system's training set is unknown: its zero-shot labels are those no training document of the dataset has
    return score(predictions, truth, None, weights, config.eval_ks, filtered=filtered_pairs(dataset, "test", names),
                 zero_shot=weights.label_counts == 0), dataset, config


def write_external_run(output: Path, name: str, predictions_path: Path, dataset_ref: str, dataset: Dataset,
                       config: TrainConfig, metrics: dict) -> Path:
    """A run-like directory for predictions made outside xmcbench, which `xmcbench report` reads beside
    runs: config.json (method "external:NAME", the dataset, the scoring settings) and metrics.json."""
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise XmcError(f"{output} is not an empty folder; choose another --output")
    settings = {key: getattr(config, key) for key in ("seed", *EVALUATION_SETTINGS)}
    if Path(dataset_ref).exists():   # a folder: its full path, as a run's config.json records it
        dataset_ref = str(Path(dataset_ref).resolve())
    write_json(output / "config.json", {
        "method": f"external:{name}", "dataset": dataset_ref, "dataset_name": dataset.name,
        "dataset_version": dataset.version, "config": settings,
        "resolved": {"predictions": str(Path(predictions_path).resolve())}})
    write_json(output / FINISHED_MARKER, {"dataset": dataset.name, "test_documents": dataset.test_labels.shape[0],
                                          "unseen_test_labels": len(dataset.label_names) - dataset.num_labels,
                                          **metrics})
    return output


def keep_scores_at_least(result: dict, threshold: float | None) -> dict:
    """A predict result ({"labels", "scores"}) without the labels scoring below threshold (None: all kept)."""
    if threshold is None:
        return result
    kept = [(label, value) for label, value in zip(result["labels"], result["scores"]) if value >= threshold]
    return {**result, "labels": [label for label, _ in kept], "scores": [value for _, value in kept]}


def predict_texts(run_dir: Path, texts: list[str], top_k: int = 5, registry: Registry | None = None) -> list[dict]:
    """Top-k labels with scores for raw texts, with a saved model."""
    check_top_k(top_k)
    registry = registry or build_registry()
    model, config, label_names = load_saved_model(run_dir, registry)
    config.top_k = top_k
    predictions = predict_saved_model(model, texts, None, config)
    return [{"labels": [label_names[i] for i in row if i >= 0],
             "scores": [round(float(s), 6) for i, s in zip(row, scores) if i >= 0]}
            for row, scores in zip(predictions.labels, predictions.scores)]
