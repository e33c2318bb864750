"""Entry point of the xmcbench-xmlcnn package: registers the `xml-cnn` encoder and the `xmlcnn` methods.

The recaller, ranker and sampler the methods name are the built-in ones; this package adds an encoder only.
"""

from xmcbench.hookspecs import hookimpl
from xmcbench_xmlcnn.methods import xmlcnn_methods
from xmcbench_xmlcnn.options import OPTIONS


@hookimpl
def xmcbench_register_components(registry):
    # named "module:attribute": imported when a run uses it, so loading the plugin imports no torch
    registry.add_component("encoder", "xml-cnn", "xmcbench_xmlcnn.encoder:build_xmlcnn", options=OPTIONS)


@hookimpl
def xmcbench_register_methods(registry):
    for method in xmlcnn_methods():
        registry.add_method(method)
