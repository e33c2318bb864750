"""The paper's five benchmarks, which LightXML's presets are for. They are too large and not ours to
redistribute: users download them and point ``--data-dir`` (or ``$XMCBENCH_DATA_DIR``) at the folder holding
e.g. ``Wiki-500K/``. (The Debian datasets that ship with xmcbench are registered by xmcbench's own
``xmcbench_datasets`` plugin.)
"""

from __future__ import annotations

from xmcbench.data import DatasetSpec

PAPER_SOURCE = (
    "the raw-text releases linked from the AttentionXML and LightXML repositories "
    "(github.com/yourh/AttentionXML, github.com/kongds/LightXML) and the Extreme Classification Repository "
    "(manikvarma.org/downloads/XC/XMLRepository.html)"
)

XC_REPOSITORY = "http://manikvarma.org/downloads/XC/XMLRepository.html"


def _paper(name: str, description: str, dirname: str, num_train: int, num_test: int, num_labels: int,
           a: float, b: float) -> DatasetSpec:
    return DatasetSpec(
        name=name,
        description=description,
        dirname=dirname,
        num_train=num_train,
        num_test=num_test,
        num_labels=num_labels,
        propensity_a=a,
        propensity_b=b,
        source=PAPER_SOURCE,
        card=XC_REPOSITORY,
    )


def paper_datasets() -> list[DatasetSpec]:
    """The registry entries this plugin contributes, smallest first."""
    # Statistics are Table 1 of LightXML (copied from AttentionXML); propensity A, B follow Jain et al. 2016:
    # 0.5/0.4 for Wikipedia-LSHTC-like data, 0.6/2.6 for Amazon, 0.55/1.5 otherwise.
    return [
        _paper("eurlex4k", "EUR-Lex legal documents -> EUROVOC descriptors (LightXML Table 1)",
               "Eurlex-4K", 15_449, 3_865, 3_956, 0.55, 1.5),
        _paper("wiki10-31k", "Wikipedia articles -> social bookmarking tags (LightXML Table 1)",
               "Wiki10-31K", 14_146, 6_616, 30_938, 0.55, 1.5),
        _paper("amazoncat13k", "Amazon product descriptions -> product categories (LightXML Table 1)",
               "AmazonCat-13K", 1_186_239, 306_782, 13_330, 0.55, 1.5),
        # 501,008 labels as in AttentionXML/LightXML; X-Transformer/PECOS report 501,070 for their own copy.
        _paper("wiki500k", "Wikipedia articles -> Wikipedia categories (LightXML Table 1)",
               "Wiki-500K", 1_779_881, 769_421, 501_008, 0.5, 0.4),
        _paper("amazon670k", "Amazon product texts -> recommended products (LightXML Table 1)",
               "Amazon-670K", 490_449, 153_025, 670_091, 0.6, 2.6),
    ]
