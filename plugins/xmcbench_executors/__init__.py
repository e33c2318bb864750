"""xmcbench's built-in grid executors (`xmcbench compare --executor NAME`), one module per engine besides
`local`, the default, which is core (`xmcbench.executors.LocalExecutor`): Ray (`ray_grid.py`) and Slurm
through submitit (`slurm_grid.py`). Each module has a factory `build(options)` registered through the
`xmcbench_register_executors` hook (`plugin.py`); the engines are optional (`pip install 'xmcbench[ray]'`,
`'xmcbench[slurm]'`) and imported only when chosen."""
