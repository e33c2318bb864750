"""Entry point of the xmcbench-cascade package: registers the `transformer-levels` encoder, the `node-linear`
ranker and the `cascade` method. The recaller (`cluster-linear`) and sampler (`dynamic`) the method names are
xmcbench's built-in ones, used at every level of the tree."""

from xmcbench.hookspecs import hookimpl
from xmcbench_cascade.methods import cascade_methods
from xmcbench_cascade.options import OPTIONS


@hookimpl
def xmcbench_register_components(registry):
    # named "module:attribute": imported when a run uses them, so loading the plugin imports no torch
    registry.add_component("encoder", "transformer-levels", "xmcbench_cascade.encoder:build_transformer_levels",
                           options=OPTIONS)
    registry.add_component("ranker", "node-linear", "xmcbench_cascade.ranker:build_node_linear")


@hookimpl
def xmcbench_register_methods(registry):
    for method in cascade_methods():
        registry.add_method(method)
