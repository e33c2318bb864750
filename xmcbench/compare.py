"""`xmcbench compare`: run every (method, seed) cell that has no saved result, reuse those that do,
and write a report from the saved results.

A result is identified by its key (result_key): a hash of its resolved configuration, the method's stages, the
dataset's version and its provenance (`provenance`: the code of the method and of each component — the
version of the distribution that ships it, or a digest of its source files where that version does not
identify the code, as in an editable install —, xmcbench's version, every declared option with its default
filled in, and the contents of the files that path options name). Changing any setting, the data, the recipe,
a plugin's code, an option's default or an option's file trains again, and nothing else does.

Runs saved before keys held the provenance are found by their old key (legacy_result_key) and adopted once:
their config.json gets the provenance of the code installed when compare first reuses them (marked
"adopted"), and they are reused only as long as it stays the same.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import xmcbench
from xmcbench.config import TrainConfig, training_stages
from xmcbench.errors import XmcError
from xmcbench.executors import Executor, GridContext, LocalExecutor, cell_task, run_grid
from xmcbench.formats import FormatOptions, open_dataset
from xmcbench.registry import Registry, source_digest
from xmcbench.rundir import FINISHED_MARKER
from xmcbench.runs.component import check_components
from xmcbench.runs.plan import Plan, plan_run, provenance
from xmcbench.storage import fingerprint, read_json, write_json


# Settings added after result keys existed: hashed only when set to something else than their default, so
# the keys, and with them the runs saved before these settings existed, stay what they were.
LATER_SETTINGS = ("eval_ks", "propensity_a", "propensity_b", "tree_levels", "level_top", "score_combiner", "ranker_weight",
                  "zero_shot_labels", "indexer", "validation_split", "tail_alpha")
# Settings that cannot change a result (what is logged where): never hashed, so adding a logger finds the run.
RESULT_NEUTRAL_SETTINGS = ("loggers",)


def _settings_and_stages(registry: Registry, plan: Plan) -> tuple[dict, list[dict]]:
    stages = [dataclasses.asdict(stage) for stage in training_stages(registry.method(plan.method).stages, plan.config)]
    settings, defaults = plan.config.to_dict(), TrainConfig().to_dict()
    for key in LATER_SETTINGS:
        if settings[key] == defaults[key]:
            del settings[key]
    for key in RESULT_NEUTRAL_SETTINGS:
        del settings[key]
    return settings, stages


def result_key(registry: Registry, plan: Plan, dataset_version: str, record: dict | None = None) -> str:
    """The key of a run's result: its settings (LATER_SETTINGS only when not at their default, never the
    RESULT_NEUTRAL_SETTINGS), stages, dataset version and provenance (record: provenance(), computed when
    not given)."""
    settings, stages = _settings_and_stages(registry, plan)
    record = record if record is not None else provenance(registry, plan.method, plan.config)
    return fingerprint(plan.method, settings, stages, dataset_version, record)


def legacy_result_key(registry: Registry, plan: Plan, dataset_version: str) -> str:
    """The key runs had before result keys held their provenance: settings, stages and dataset version only.
    Kept to find those runs (adoptable); never the key of a new run."""
    settings, stages = _settings_and_stages(registry, plan)
    return fingerprint(plan.method, settings, stages, dataset_version)


ADOPTED = "adopted"   # the key of config.json's provenance that marks it recorded after the run, by compare


def adoptable(run_dir: Path, record: dict) -> bool:
    """Whether `run_dir`, a finished run at a legacy key, may stand for a result of provenance `record`: it
    holds no provenance (saved before keys held one, so the code installed now is taken to be what trained
    it), or one compare recorded when adopting it that equals `record`."""
    if not (run_dir / FINISHED_MARKER).exists():
        return False
    try:
        recorded = read_json(run_dir / "config.json").get("provenance")
    except (OSError, ValueError, AttributeError):
        return False
    if recorded is None:
        return True
    return isinstance(recorded, dict) and ADOPTED in recorded and \
        {key: value for key, value in recorded.items() if key != ADOPTED} == record


def adopt(run_dir: Path, record: dict) -> None:
    """Record `record` as the provenance of a run saved before keys held one (see adoptable), once."""
    saved = read_json(run_dir / "config.json")
    if "provenance" not in saved:
        date = datetime.datetime.now().isoformat(timespec="seconds")
        write_json(run_dir / "config.json", {**saved, "provenance": {**record, ADOPTED: date}})


def check_shared_validation(plans: dict[tuple[str, int], Plan]) -> None:
    """Weighted and stacked ensembles fuse the methods of one seed on their validation rows: refuse, before
    anything trains, cells without a validation split or whose splits would differ."""
    for (method, seed), plan in plans.items():
        size = getattr(plan.config, "validation_size", None)
        if size == 0:
            raise XmcError(f"--ensemble --fusion weighted or stacked is fitted on validation rows, but {method} runs "
                           "with validation_size=0 here; add --set validation_size=N (e.g. 10 % of the training set)")
    for (method, seed), plan in plans.items():
        first_method = next(m for (m, s) in plans if s == seed)
        first = plans[(first_method, seed)].config
        keys = ("validation_size", "validation_split", "max_train_docs")
        if [getattr(plan.config, key, None) for key in keys] != [getattr(first, key, None) for key in keys]:
            raise XmcError(f"--ensemble --fusion weighted or stacked needs one validation split per seed, but "
                           f"{method} and {first_method} differ in validation_size, validation_split or "
                           "max_train_docs; set them with --set")


def run_cells(registry: Registry, methods: list[str], dataset: str | None, seeds: list[int],
              set_options: list[str], config_file: Path | None, results_dir: Path, data_dir: Path | None = None,
              log=print, shared_validation: bool = False,
              reading: FormatOptions | None = None, executor: Executor | None = None) -> dict[str, list[Path]]:
    """Train what is missing; return {method: [run directory per seed]}. shared_validation: refuse first
    unless the methods of each seed share one validation split (check_shared_validation). reading: how to read
    a dataset path (formats.open_dataset); its values are part of the dataset's version, hence of the keys.
    executor: runs the cells without a finished run (xmcbench.executors; default: one after another in this
    process), with the grid's locks and log in results_dir's sibling folder `grid`."""
    if not methods:
        raise XmcError("name at least one method to compare (e.g. xmcbench compare lightxml lightxml-static)")
    loaded = open_dataset(registry, dataset or registry.default_dataset(), data_dir, reading)
    # every setting is checked before anything trains; the reading is recorded in config.json, so that --resume,
    # evaluate and rescore read the path alike
    plans = {(method, seed): plan_run(registry, method, dataset, config_file, set_options, seed, data_dir,
                                      loaded=loaded, reading=reading)
             for method in methods for seed in seeds}
    if shared_validation:
        check_shared_validation(plans)
    for plan in plans.values():   # every component's own check, before anything trains
        if registry.method(plan.method).whole_method is None:
            check_components(registry, plan, loaded)
    version = loaded.version
    grid_folder = Path(results_dir).parent / "grid"
    cells: dict[str, list[Path]] = {method: [] for method in methods}
    tasks = []
    for (method, seed), plan in plans.items():
        record = provenance(registry, method, plan.config)
        run_dir = results_dir / f"{method}-seed{seed}-{result_key(registry, plan, version, record)}"
        legacy = results_dir / f"{method}-seed{seed}-{legacy_result_key(registry, plan, version)}"
        if not run_dir.exists() and adoptable(legacy, record):
            adopt(legacy, record)
            log(f"{method} seed {seed}: reusing {legacy} (saved before result keys held the code and option "
                "files; taken as made by the code installed now)")
            cells[method].append(legacy)
            continue
        cells[method].append(run_dir)
        if (run_dir / FINISHED_MARKER).exists():
            log(f"{method} seed {seed}: reusing {run_dir}")
        else:
            tasks.append(cell_task(run_dir.name, method, seed, plan, run_dir, version, grid_folder, data_dir))
    if tasks:
        run_grid(executor or LocalExecutor(), tasks, GridContext(registry, loaded, log, grid_folder))
    return cells


def ensemble_members(cells: dict[str, list[Path]], seeds: list[int], fusion: str) -> dict[str, list[Path]]:
    """{ensemble folder name: member runs}. sum: each method's seeds (the paper's ensembles of one method);
    weighted and stacked: per seed, every compared method (a hybrid whose weights are chosen on the validation split
    that seed gives all of them), so the hybrid gets one result per seed like a method. A name ends in a
    hash of its members' folders, which name their settings, and of the fusion's code (fusion_code_digest): other
    members or another fusion, another ensemble."""
    if fusion == "sum":
        groups = {f"{method}-x{len(paths)}": paths for method, paths in cells.items() if len(paths) > 1}
    else:
        groups = {f"{fusion}-{'+'.join(cells)}-seed{seed}": [paths[index] for paths in cells.values()]
                  for index, seed in enumerate(seeds)}
    code = fusion_code_digest()
    return {f"{name}-{fingerprint([path.name for path in paths], code)[:8]}": paths for name, paths in groups.items()}


def fusion_code_digest() -> str:
    """The version and source digest of the code that fuses and scores ensembles: an ensemble saved by other code
    is not reused."""
    from xmcbench import ensemble, fusion, metrics

    return f"{xmcbench.__version__}/{source_digest((ensemble.__file__, fusion.__file__, metrics.__file__))}"


def compare(registry: Registry, methods: list[str], dataset: str | None, seeds: list[int], output: Path,
            set_options: list[str] = (), config_file: Path | None = None, baseline: str | None = None,
            fmt: str = "github", ensemble: bool = False, data_dir: Path | None = None, command: str | None = None,
            log=print, fusion: str = "sum", reading: FormatOptions | None = None,
            executor: Executor | None = None) -> Path:
    """Run the missing cells under output/runs, optionally ensembles under output/ensembles (ensemble_members:
    each method's seeds with fusion "sum", all methods per seed with "weighted" or "stacked"), and write
    output/report.md (its metric columns in the order of the registry's metric families); return its path.
    executor: runs the missing cells (run_cells)."""
    from xmcbench.ensemble import build_ensemble, check_fusion
    from xmcbench.fusion import FITTED_RULES
    from xmcbench.report import load_runs, write_report

    check_fusion(fusion)
    if baseline is not None and baseline not in methods:
        raise XmcError(f"--baseline {baseline!r} is not among the compared methods: {', '.join(methods)}")
    weighted = ensemble and fusion in FITTED_RULES
    if weighted and len(set(methods)) < 2:
        raise XmcError(f"--ensemble --fusion {fusion} fuses the compared methods seed by seed; name at least two "
                       "methods (an ensemble of one method's seeds uses --fusion sum)")
    cells = run_cells(registry, methods, dataset, seeds, list(set_options), config_file, output / "runs",
                      data_dir, log, shared_validation=weighted, reading=reading, executor=executor)
    run_dirs = [path for paths in cells.values() for path in paths]
    if ensemble:
        for name, paths in ensemble_members(cells, seeds, fusion).items():
            target = output / "ensembles" / name
            if not (target / FINISHED_MARKER).exists():
                build_ensemble(paths, target, fusion=fusion, registry=registry, log=log)
            run_dirs.append(target)
    return write_report(load_runs(run_dirs), output, baseline=baseline, fmt=fmt, command=command,
                        families=registry.metric_families())
