"""Entry point of the built-in grid executors: `local` (core), then one executor per module of this package."""

from xmcbench.executors import LocalExecutor
from xmcbench.hookspecs import hookimpl
from xmcbench_executors import ray_grid, slurm_grid


@hookimpl
def xmcbench_register_executors(registry):
    registry.add_executor("local", LocalExecutor, "the cells one after another in this process (the default)")
    for module in (ray_grid, slurm_grid):
        registry.add_executor(module.NAME, module.build, module.DESCRIPTION, extra=module.EXTRA)
