"""Every hook a plugin can implement. A plugin is a module listed under the `xmcbench` entry-point group.

Each hook receives the registry and calls its `add_*` methods; the registry checks types and rejects
duplicate names, naming both plugins. Implement a hook with `@xmcbench.hookimpl`.
"""

import pluggy

PROJECT_NAME = "xmcbench"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def xmcbench_register_components(registry):
    """Register encoders, recallers, rankers and samplers.

    Call `registry.add_component(kind, name, factory)` where kind is one of "encoder", "recaller",
    "ranker", "sampler" and `factory(**params)` builds an `xmcbench.interfaces` object of that kind.
    """


@hookspec
def xmcbench_register_methods(registry):
    """Register methods: named recipes of one component per kind plus default hyperparameters.

    Call `registry.add_method(MethodSpec(...))`; see `xmcbench.config.MethodSpec`.
    """


@hookspec
def xmcbench_register_datasets(registry):
    """Register datasets a user can name with `--dataset`.

    Call `registry.add_dataset(DatasetSpec(...))`; see `xmcbench.data.DatasetSpec`.
    """
