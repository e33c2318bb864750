"""Entry point of the reference plugin set: registers LightXML's components, methods, label indexer and the paper's
benchmarks. Factories are named "module:attribute" and imported when a run uses them, so loading the plugin
imports no torch (`xmcbench plugins` and `xmcbench datasets` answer in a fraction of a second)."""

from xmcbench.hookspecs import hookimpl
from xmcbench_lightxml.datasets import paper_datasets
from xmcbench_lightxml.methods import lightxml_methods
from xmcbench_lightxml.options import ENCODER_OPTIONS, RECALLER_OPTIONS


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("encoder", "transformer-cls", "xmcbench_lightxml.encoder:build_transformer_cls",
                           options=ENCODER_OPTIONS)
    registry.add_component("recaller", "cluster-linear", "xmcbench_lightxml.recaller:build_cluster_linear",
                           options=RECALLER_OPTIONS, check="xmcbench_lightxml.recaller:check_cluster_linear")
    registry.add_component("ranker", "bottleneck", "xmcbench_lightxml.ranker:build_bottleneck")
    registry.add_component("sampler", "dynamic", "xmcbench_lightxml.sampler:build_dynamic")
    registry.add_component("sampler", "static", "xmcbench_lightxml.sampler:build_static")
    registry.add_component("sampler", "random", "xmcbench_lightxml.sampler:build_random")


@hookimpl
def xmcbench_register_methods(registry):
    for method in lightxml_methods():
        registry.add_method(method)


@hookimpl
def xmcbench_register_datasets(registry):
    for dataset in paper_datasets():
        registry.add_dataset(dataset)


@hookimpl
def xmcbench_register_indexers(registry):
    registry.add_indexer("balanced-2means", "xmcbench.clustering:balanced_clusters",
                         "recursive balanced spherical 2-means on the labels' PIFA features (LightXML, AttentionXML)")
