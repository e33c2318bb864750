"""The one entry point of a run: `run(plan)` trains (or fits), predicts, scores and writes one method on one
dataset, in this process or in each process of a torchrun launch."""

from __future__ import annotations

from pathlib import Path

from xmcbench.distributed import from_environment, shutdown
from xmcbench.registry import Registry, build_registry
from xmcbench.rundir import reset_peak_memory
from xmcbench.runs.component import run_component_method
from xmcbench.runs.plan import Plan
from xmcbench.runs.whole import run_whole_method
from xmcbench.whole_methods import keeps_checkpoints


def run(plan: Plan, output: Path | None = None, data_dir: Path | None = None, overwrite: bool = False,
        registry: Registry | None = None, log=print, resume: bool = False) -> Path:
    """Train, predict and score one method on one dataset; return the run directory.

    resume=True continues the unfinished run in `output` from its last checkpoint (see plan.plan_resume)."""
    registry = registry or build_registry()
    dist = from_environment()
    reset_peak_memory()
    whole_method = registry.method(plan.method).whole_method
    try:
        if whole_method is not None:   # no components, no training loop: the method fits itself
            return run_whole_method(plan, whole_method, output, data_dir, overwrite, registry, log, resume, dist)
        return run_component_method(plan, output, data_dir, overwrite, registry, log, resume, dist)
    finally:
        shutdown(dist)


def continues_from_scratch(registry: Registry, method: str) -> bool:
    """Whether an interrupted run of `method` is fitted again rather than resumed: a whole method whose fit keeps
    no checkpoints (whole_methods.keeps_checkpoints)."""
    whole_method = registry.method(method).whole_method
    return whole_method is not None and not keeps_checkpoints(whole_method)
