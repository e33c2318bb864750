"""CascadeXML-style multi-resolution training for xmcbench: a label tree of several levels, each scored from
its own layers of one transformer, candidates chained from level to level (the `cascade` method)."""
