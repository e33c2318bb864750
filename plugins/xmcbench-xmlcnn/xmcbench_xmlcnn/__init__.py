"""XML-CNN for xmcbench: the convolutional encoder of Liu et al. (SIGIR 2017) as an `Encoder` plugin.

Nothing registers on import: xmcbench loads `xmcbench_xmlcnn.plugin` through its entry-point group.
"""

__version__ = "0.1.0"
