"""The `xmlcnn` methods: the XML-CNN encoder with xmcbench's own recaller, ranker and sampler.

Sized for a 2-core CPU: `xmcbench run xmlcnn` (debian-debtags-mini) trains in a few minutes. The encoder
starts from random word embeddings, so everything learns at 1e-3 (Adam's usual rate, as in XML-CNN) and
for more epochs than the fine-tuned transformers need; SWA is off.
"""

from xmcbench.config import MethodSpec

XMLCNN_DEFAULTS = {
    "encoder": "xml-cnn",
    "recaller": "cluster-linear",
    "ranker": "bottleneck",
    "sampler": "dynamic",
    "model_name": "sentence-transformers/all-MiniLM-L6-v2",   # only its tokenizer: XML-CNN learns its embeddings
    "dropout": 0.5,
    "lr": 1e-3,
    "head_lr": 1e-3,
    "weight_decay": 0.0,
    "epochs": 15,
    "batch_size": 64,
    "max_length": 256,
    "swa": False,
}

CLUSTER_DEFAULTS = {"cluster_size": 8, "top_clusters": 16}


def xmlcnn_methods() -> list[MethodSpec]:
    return [
        MethodSpec(
            name="xmlcnn",
            description="XML-CNN encoder (Liu et al., SIGIR 2017: word embeddings, convolutions of several widths, "
                        "dynamic max pooling, hidden bottleneck) with a linear classifier over the labels "
                        "(label clusters only beyond flat_below labels)",
            defaults=XMLCNN_DEFAULTS,
        ),
        MethodSpec(
            name="xmlcnn-clusters",
            description="XML-CNN encoder with label clusters of 8: cluster recaller (top 16), bottleneck ranker, "
                        "dynamic negative sampling",
            defaults={**XMLCNN_DEFAULTS, **CLUSTER_DEFAULTS},
        ),
    ]
