"""The options LightXML's components declare, in a module of their own: the plugin registers them without
importing the components (torch), see plugin.py."""

from xmcbench.config import Option

POSITIVE_WEIGHT = Option("positive_weight", str, "none", "weight of a label's positives in the recall loss: none, or "
                         "propensity (its inverse propensity, 1/p_l of PSP@k: about 1 for the most frequent labels, "
                         "up to about 10 for labels seen once); propensity needs a flat run (one label per cluster)",
                         choices=("none", "propensity"))
RECALLER_OPTIONS = (POSITIVE_WEIGHT,)
