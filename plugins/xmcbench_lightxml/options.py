"""The options LightXML's components declare, in a module of their own: the plugin registers them without
importing the components (torch), see plugin.py."""

from xmcbench.config import Option

POSITIVE_WEIGHT = Option("positive_weight", str, "none", "weight of a label's positives in the recall loss: none, or "
                         "propensity (its inverse propensity, 1/p_l of PSP@k: about 1 for the most frequent labels, "
                         "up to about 10 for labels seen once); propensity needs a flat run (one label per cluster)",
                         choices=("none", "propensity"))
HEAD_INIT = Option("head_init", str, "random", "how each label's row of a flat recaller starts: random (nn.Linear's "
                   "default); pifa: the mean of its training documents' representations under the pretrained "
                   "encoder (centred, unit length, as PECOS's PIFA), its bias at the label's log-odds prior, so a "
                   "label seen once starts at its one document (needs a flat run: one label per cluster); auto "
                   "(lightxml's default): pifa where the run is flat (one row per label), random otherwise",
                   choices=("random", "pifa", "auto"))
RECALLER_OPTIONS = (POSITIVE_WEIGHT, HEAD_INIT)
