"""xmcbench's built-in metric families (P, nDCG, PSP, PSnDCG, R, PSR), registered through the
`xmcbench_register_metrics` hook (`plugin.py`) like a plugin's. Their definitions are core
(`xmcbench.metrics.BUILTIN_FAMILIES`), as `xmcbench.metrics.evaluate` computes them for callers without a registry."""
