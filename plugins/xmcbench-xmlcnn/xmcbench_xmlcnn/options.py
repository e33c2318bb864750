"""The `xml-cnn` encoder's shape settings, declared to xmcbench (checked like core settings before a run, listed
by `xmcbench plugins --options`; building the encoder reads them with Option.value_of), in a module of their own:
the plugin registers them without importing the encoder (torch), see plugin.py."""

from xmcbench.config import Option

OPTIONS = (
    Option("xmlcnn_emb_dim", int, 300, "E, word-embedding size", minimum=1),
    Option("xmlcnn_filter_sizes", tuple[int, ...], (2, 4, 8), "convolution widths k (a list, or comma-separated)",
           minimum=1),
    Option("xmlcnn_num_filters", int, 128, "F, filters per width", minimum=1),
    Option("xmlcnn_pool_chunks", int, 8, "p, chunks of dynamic max pooling", minimum=1),
    Option("xmlcnn_hidden", int, 512, "H, the bottleneck (= out_dim)", minimum=1),
)
