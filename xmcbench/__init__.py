"""xmcbench: a plugin-based benchmarking toolkit for extreme multi-label text classification."""

__version__ = "0.1.0"
