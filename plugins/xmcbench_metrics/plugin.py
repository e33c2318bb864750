"""Entry point of the built-in metric families: xmcbench.metrics.BUILTIN_FAMILIES, in their order."""

from xmcbench.hookspecs import hookimpl
from xmcbench.metrics import BUILTIN_FAMILIES


@hookimpl
def xmcbench_register_metrics(registry):
    for family in BUILTIN_FAMILIES:
        registry.add_metric_family(family)
