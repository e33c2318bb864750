"""Entry point of the built-in data formats: registers one DataFormat per module of this package."""

from xmcbench.hookspecs import hookimpl
from xmcbench_formats import delimited, hf_datasets, pecos, raw_text, xc_label_features, xc_sparse


@hookimpl
def xmcbench_register_formats(registry):
    for module in (raw_text, delimited, xc_sparse, pecos, hf_datasets, xc_label_features):
        registry.add_format(module.FORMAT)
