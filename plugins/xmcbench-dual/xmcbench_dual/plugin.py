"""Entry point of the xmcbench-dual package: registers the `transformer-mean` encoder, the `label-index` retriever,
the `dual-tower` ranker, the `index-negatives` sampler and the `dual`, `dual-dexa` and `dual-ngame` methods."""

from xmcbench.hookspecs import hookimpl
from xmcbench_dual.components import RANKER_OPTIONS, SAMPLER_OPTIONS, build_dual_tower, build_index_negatives, \
    build_label_index
from xmcbench_dual.encoder import build_transformer_mean
from xmcbench_dual.methods import dual_methods


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("encoder", "transformer-mean", build_transformer_mean)
    registry.add_component("recaller", "label-index", build_label_index, retriever=True)
    registry.add_component("ranker", "dual-tower", build_dual_tower, options=RANKER_OPTIONS)
    registry.add_component("sampler", "index-negatives", build_index_negatives, options=SAMPLER_OPTIONS)


@hookimpl
def xmcbench_register_methods(registry):
    for method in dual_methods():
        registry.add_method(method)
