"""Entry point of the xmcbench-linear package: registers the methods `plt`, `parabel`, `bonsai` and `ovr`.

They are whole methods (`xmcbench.interfaces.WholeMethod`), registered like any method; a backend that is
not installed does not hide its methods: running one says which extra installs it.
"""

from xmcbench.hookspecs import hookimpl
from xmcbench_linear.methods import linear_methods


@hookimpl
def xmcbench_register_methods(registry):
    for method in linear_methods():
        registry.add_method(method)
