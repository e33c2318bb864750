"""xmcbench-linear: classic linear XMC methods (PLT, Parabel, Bonsai, one-vs-rest) on TF-IDF features, as
xmcbench whole methods. Importing this package registers nothing: xmcbench calls the hooks in `plugin`."""

__version__ = "0.1.0"
