"""The methods of this package: one MethodSpec per method, each naming its WholeMethod class.

Every option a method reads is in its `defaults` (as `options.NAME`), so `xmcbench config METHOD` shows
them and each run's config.json records them; `--set options.NAME=VALUE` changes one.
"""

from xmcbench.config import MethodSpec
from xmcbench_linear.base import LinearMethod
from xmcbench_linear.omikuji_trees import BONSAI, OmikujiTrees
from xmcbench_linear.ovr import OneVsRestSVM
from xmcbench_linear.plt import NapkinPLT


def _options(method: type[LinearMethod], **overrides) -> dict:
    return {f"options.{name}": value for name, value in {**method.declared_options(), **overrides}.items()}


def linear_methods() -> list[MethodSpec]:
    return [
        MethodSpec("plt", "TF-IDF (word 1-2-grams) + napkinXC probabilistic label tree (Jasinska-Kobus et al., "
                          "2020) [pip install 'xmcbench-linear[plt]']",
                   defaults=_options(NapkinPLT), whole_method=NapkinPLT),
        MethodSpec("parabel", "TF-IDF + omikuji's Parabel: 3 balanced 2-means label trees (Prabhu et al., 2018) "
                              "[pip install 'xmcbench-linear[omikuji]']",
                   defaults=_options(OmikujiTrees), whole_method=OmikujiTrees),
        MethodSpec("bonsai", "TF-IDF + omikuji's Bonsai: 3 shallow unbalanced 100-means label trees (Khandagale et "
                             "al., 2019) [pip install 'xmcbench-linear[omikuji]']",
                   defaults=_options(OmikujiTrees, **BONSAI), whole_method=OmikujiTrees),
        MethodSpec("ovr", "TF-IDF + one linear SVM per label, pruned weights (as DiSMEC), up to 5,000 labels "
                          "[pip install 'xmcbench-linear[ovr]']",
                   defaults=_options(OneVsRestSVM), whole_method=OneVsRestSVM),
    ]
