"""Entry point of the xmcbench-dual package: registers the `transformer-mean` encoder, the `label-index` retriever,
the `dual-tower` ranker, the `index-negatives` sampler and the `dual`, `dual-dexa` and `dual-ngame` methods."""

from xmcbench.hookspecs import hookimpl
from xmcbench_dual.methods import dual_methods
from xmcbench_dual.options import RANKER_OPTIONS, SAMPLER_OPTIONS


@hookimpl
def xmcbench_register_components(registry):
    # named "module:attribute": imported when a run uses them, so loading the plugin imports no torch
    registry.add_component("encoder", "transformer-mean", "xmcbench_dual.encoder:build_transformer_mean")
    registry.add_component("recaller", "label-index", "xmcbench_dual.components:build_label_index", retriever=True)
    registry.add_component("ranker", "dual-tower", "xmcbench_dual.components:build_dual_tower",
                           options=RANKER_OPTIONS)
    registry.add_component("sampler", "index-negatives", "xmcbench_dual.components:build_index_negatives",
                           options=SAMPLER_OPTIONS)


@hookimpl
def xmcbench_register_methods(registry):
    for method in dual_methods():
        registry.add_method(method)
