"""LightXML (Jiang et al., AAAI 2021) as xmcbench's reference plugin set.

Registered through the `xmcbench` entry-point group like any third-party plugin (see `plugin.py`).
"""
