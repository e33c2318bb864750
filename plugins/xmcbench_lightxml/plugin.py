"""Entry point of the reference plugin set: registers LightXML's components, methods, label indexer and the paper's
benchmarks."""

from xmcbench.clustering import balanced_clusters
from xmcbench.hookspecs import hookimpl
from xmcbench_lightxml.datasets import paper_datasets
from xmcbench_lightxml.encoder import build_transformer_cls
from xmcbench_lightxml.methods import lightxml_methods
from xmcbench_lightxml.ranker import build_bottleneck
from xmcbench_lightxml.recaller import RECALLER_OPTIONS, build_cluster_linear, check_cluster_linear
from xmcbench_lightxml.sampler import build_dynamic, build_random, build_static


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("encoder", "transformer-cls", build_transformer_cls)
    registry.add_component("recaller", "cluster-linear", build_cluster_linear, options=RECALLER_OPTIONS,
                           check=check_cluster_linear)
    registry.add_component("ranker", "bottleneck", build_bottleneck)
    registry.add_component("sampler", "dynamic", build_dynamic)
    registry.add_component("sampler", "static", build_static)
    registry.add_component("sampler", "random", build_random)


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
    registry.add_indexer("balanced-2means", balanced_clusters,
                         "recursive balanced spherical 2-means on the labels' PIFA features (LightXML, AttentionXML)")
