"""`xmcbench compare`: run every (method, seed) cell that has no saved result, reuse those that do,
and write a report from the saved results.

A result is identified by a hash of its resolved configuration, the method's stages and the dataset's
version, so changing any setting, the data or the recipe trains again, and nothing else does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from xmcbench import runner
from xmcbench.config import training_stages
from xmcbench.errors import XmcError
from xmcbench.registry import Registry
from xmcbench.storage import fingerprint


def result_key(registry: Registry, plan: runner.Plan, dataset_version: str) -> str:
    stages = [dataclasses.asdict(stage) for stage in training_stages(registry.method(plan.method).stages, plan.config)]
    return fingerprint(plan.method, plan.config.to_dict(), stages, dataset_version)


def run_cells(registry: Registry, methods: list[str], dataset: str | None, seeds: list[int],
              set_options: list[str], config_file: Path | None, results_dir: Path, data_dir: Path | None = None,
              log=print) -> dict[str, list[Path]]:
    """Train what is missing; return {method: [run directory per seed]}."""
    if not methods:
        raise XmcError("name at least one method to compare (e.g. xmcbench compare lightxml lightxml-static)")
    loaded = runner.open_dataset(registry, dataset or runner.DEFAULT_DATASET, data_dir)
    plans = {(method, seed): runner.plan_run(registry, method, dataset, config_file, set_options, seed, data_dir,
                                             loaded=loaded)
             for method in methods for seed in seeds}   # every setting is checked before anything trains
    version = loaded.version
    cells: dict[str, list[Path]] = {method: [] for method in methods}
    for (method, seed), plan in plans.items():
        run_dir = results_dir / f"{method}-seed{seed}-{result_key(registry, plan, version)}"
        cells[method].append(run_dir)
        if (run_dir / runner.FINISHED_MARKER).exists():
            log(f"{method} seed {seed}: reusing {run_dir}")
        elif (run_dir / "config.json").exists():
            log(f"{method} seed {seed}: resuming {run_dir}")
            runner.run(runner.plan_resume(run_dir), run_dir, data_dir, registry=registry, log=log, resume=True)
        else:
            log(f"{method} seed {seed}: training into {run_dir}")
            runner.run(plan, run_dir, data_dir, registry=registry, log=log)
    return cells


def compare(registry: Registry, methods: list[str], dataset: str | None, seeds: list[int], output: Path,
            set_options: list[str] = (), config_file: Path | None = None, baseline: str | None = None,
            fmt: str = "github", ensemble: bool = False, data_dir: Path | None = None, command: str | None = None,
            log=print) -> Path:
    """Run the missing cells under output/runs, optionally an ensemble of each method's seeds under
    output/ensembles, and write output/report.md; return its path."""
    from xmcbench.report import load_runs, write_report

    if baseline is not None and baseline not in methods:
        raise XmcError(f"--baseline {baseline!r} is not among the compared methods: {', '.join(methods)}")
    cells = run_cells(registry, methods, dataset, seeds, list(set_options), config_file, output / "runs",
                      data_dir, log)
    run_dirs = [path for paths in cells.values() for path in paths]
    if ensemble:
        from xmcbench.ensemble import build_ensemble

        for method, paths in cells.items():
            if len(paths) > 1:
                target = output / "ensembles" / f"{method}-x{len(paths)}"
                if not (target / runner.FINISHED_MARKER).exists():
                    build_ensemble(paths, target)
                run_dirs.append(target)
    return write_report(load_runs(run_dirs), output, baseline=baseline, fmt=fmt, command=command)
