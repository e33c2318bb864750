"""xmcbench: a plugin-based benchmarking toolkit for extreme multi-label text classification."""

__version__ = "0.1.0"

# The Python API (docs/api.md), imported on first use so that `import xmcbench` stays light.
_API = ("train", "load", "evaluate", "evaluate_predictions", "resolved_config", "Run", "Predictor")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from xmcbench import api

        return getattr(api, name)
    raise AttributeError(f"module 'xmcbench' has no attribute {name!r}")
