"""Planning a run: its settings resolved and checked, its dataset read once, before anything heavy happens.

A plan is complete when plan_run returns it: the method, the dataset, every setting (a preset's, or those the
dataset-aware rule derived from the dataset's statistics), how a dataset path is read, and the dataset itself
when planning had to read it (the run then reads it no second time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import xmcbench
from xmcbench import whole_methods
from xmcbench.config import PATH_KIND, MethodSpec, TrainConfig, check_options, parse_set_options, read_config_file, \
    resolve_config
from xmcbench.data import Dataset
from xmcbench.defaults import RULE_VERSION, WHOLE_METHOD_DERIVED, DatasetStatistics, Derived, DeviceFacts, \
    dataset_statistics, derive_settings
from xmcbench.device import pick_device
from xmcbench.errors import XmcError
from xmcbench.formats import FormatOptions, open_dataset
from xmcbench.indexing import check_indexer
from xmcbench.interfaces import call_factory
from xmcbench.metrics import selection_metrics
from xmcbench.modelio import file_digest, storage_dtype
from xmcbench.registry import COMPONENT_KINDS, Registry, code_record
from xmcbench.rundir import is_finished, reading_of
from xmcbench.runs.splits import training_pool
from xmcbench.storage import read_json
from xmcbench.tokenization import load_tokenizer


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
             loaded: Dataset | None = None, reading: FormatOptions | None = None) -> Plan:
    """Resolve a run's settings. Without a preset of the method for the dataset, the dataset is read and its
    statistics decide the settings the user, the method and a config file leave open (xmcbench.defaults).
    loaded: the dataset, already read (compare plans many cells of one dataset, the API data held in memory).
    reading: how a dataset path is read (--format, ...); given, the dataset is read with it even under a preset,
    since its values are part of the dataset's version. The plan returned is complete: the run, resume, evaluate
    and rescore need nothing else."""
    spec = registry.method(method)
    dataset = dataset or registry.default_dataset()
    reading = reading or FormatOptions()
    check_dataset_name(registry, dataset)
    preset_key = preset_for(spec, dataset if dataset in registry.datasets else Path(dataset).name)
    options = list(set_options) + ([f"seed={seed}"] if seed is not None else [])
    to_derive = preset_key not in spec.presets and spec.derive is not None   # only a method derives a tree
    check_option_names(parse_set_options(options),
                       declared_options(registry, spec, resolve_config(spec, preset_key, config_file,
                                                                       tree_derived_later=to_derive)))
    config = resolve_config(spec, preset_key, config_file, options, tree_derived_later=to_derive)
    check_settings(registry, config, spec, tree_derived_later=to_derive)   # fail before any data is read
    if loaded is None and reading != FormatOptions():
        loaded = open_dataset(registry, dataset, data_dir, reading)
    if preset_key in spec.presets:
        return Plan(method, dataset, config, preset=preset_key, loaded=loaded, reading=reading)
    loaded = loaded or open_dataset(registry, dataset, data_dir)
    whole_methods.check_inputs(method, spec.whole_method, loaded, registry)
    pool = np.sort(training_pool(loaded, config))   # in file order: the seed orders the pool, not its statistics
    statistics = dataset_statistics([loaded.train_texts[i] for i in pool] if loaded.train_texts else None,
                                    loaded.train_labels[pool][:, :loaded.num_labels].tocsr(),
                                    load_tokenizer(config.model_name) if config.model_name else None)
    device = device_facts(config)
    explicit = set(spec.defaults) | set(parse_set_options(options))
    if config_file is not None:
        explicit |= set(read_config_file(config_file))
    derived = derive_settings(statistics, device)
    if spec.whole_method is not None:
        derived = {key: value for key, value in derived.items() if key in WHOLE_METHOD_DERIVED}
    if spec.derive:   # it sees the settings the run would have without it, the core's derived values included
        core = resolve_config(spec, preset_key, config_file, options, tree_derived_later=to_derive,
                              derived={key: value.value for key, value in derived.items()})
        derived = {**derived, **call_factory(spec.derive, statistics, device, settings=core)}
    derived = {key: value for key, value in derived.items() if key not in explicit}
    config = resolve_config(spec, preset_key, config_file, options,
                            derived={key: value.value for key, value in derived.items()})
    check_settings(registry, config, spec)
    return Plan(method, dataset, config, derived, statistics, device, loaded, reading=reading)


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
        check_indexer(registry, config)
    pick_device(config)
    storage_dtype(config.storage_dtype)   # and not after training, when the model is saved
    selectable = selection_metrics(registry.metric_families())
    if config.selection_metric not in selectable:
        raise XmcError(f"selection_metric={config.selection_metric!r} is not a validation metric; choose one of "
                       f"{', '.join(selectable) or 'none: no metric family is registered (see `xmcbench plugins`)'}")


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


def plan_resume(run_dir: Path) -> Plan:
    """The plan recorded in an unfinished run directory."""
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


def log_run_header(plan: Plan, dataset: Dataset, log, derived: dict[str, Derived] | None = None) -> None:
    """The lines every run logs after its first one: where its settings came from (a preset, or the settings
    `derived` from the data: default all of plan.derived) and the input policies the reading applied."""
    derived = plan.derived if derived is None else derived
    if plan.preset:
        log(f"settings of the {plan.method} preset for {plan.preset} (--set and --config win over it)")
    if derived:
        log(f"settings derived from the data (no {plan.method} preset for {dataset.name}; see config.json): "
            + ", ".join(f"{key} {value.value}" for key, value in derived.items()))
    if dataset.report:
        log("input policies applied (see data_report.json): "
            + ", ".join(f"{key} {value}" for key, value in sorted(dataset.report.items())))


def provenance(registry: Registry, method: str, config: TrainConfig) -> dict:
    """What made a run's result besides its settings and data, as JSON values: "xmcbench" (the version),
    "method" and, for a method built from components, "components" ({kind: {"name", ...}}): each one's
    `registry.code_record` (plugin, distribution, version, and "source_sha256" where the version does not
    identify the code), and "indexer" ({"name", ...}, its code record) unless it is the default one, so that the
    keys of runs saved before indexers were registered stay what they were; "options": every option the method
    and its components declare, set or defaulted; "option_files": {name: {"path", "bytes", "sha256"}} of each
    path option (Option(kind="path")) that names a file. result_key hashes it; config.json records it,
    environment.json its code part."""
    spec = registry.method(method)
    record = {"xmcbench": xmcbench.__version__, "method": code_record(registry.methods[method])}
    if spec.whole_method is None:
        record["components"] = {}
        for kind in COMPONENT_KINDS:
            name = getattr(config, kind)
            entry = registry.components[kind].get(name)
            record["components"][kind] = {"name": name, **(code_record(entry) if entry else {"plugin": None})}
        if config.indexer != TrainConfig.indexer:   # the default's absence keeps the keys of earlier runs
            entry = registry.indexers.get(config.indexer)
            record["indexer"] = {"name": config.indexer, **(code_record(entry) if entry else {"plugin": None})}
    declared = declared_options(registry, spec, config)
    record["options"] = {name: option.value_of(config) for name, (option, _) in sorted(declared.items())}
    record["option_files"] = {}
    for name, (option, owner) in sorted(declared.items()):
        path = record["options"][name]
        if option.kind == PATH_KIND and path is not None:
            try:
                record["option_files"][name] = {"path": str(path), **file_digest(Path(path).expanduser())}
            except OSError as error:
                raise XmcError(f"options.{name}={path} ({owner}) cannot be read: {error.strerror}; give a readable "
                               f"file with --set options.{name}=PATH") from None
    return json.loads(json.dumps(record, default=str))   # tuples as lists, as config.json reads back
