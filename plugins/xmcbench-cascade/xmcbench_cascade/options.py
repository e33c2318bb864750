"""The options of the `transformer-levels` encoder, in a module of their own: the plugin registers them without
importing the encoder (torch), see plugin.py."""

from xmcbench.config import Option

OPTIONS = (
    Option("level_layers", str, "", "the layers each scoring level reads, coarse to fine, e.g. 5-6,8,10,12 "
                                    "(1-based, a range for several); empty: derived from the encoder's depth"),
    Option("level_dropout", str, "", "dropout of each level's representation, e.g. 0.2,0.25,0.35,0.5; "
                                     "empty: the dropout setting at every level"),
)
