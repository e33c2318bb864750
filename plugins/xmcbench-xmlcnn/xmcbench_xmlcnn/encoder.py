"""`xml-cnn`: the encoder of XML-CNN (Liu, Chang, Wu and Yang, "Deep Learning for Extreme Multi-label Text
Classification", SIGIR 2017).

    ids (B, T) -> word embeddings (B, T, E) -> Conv1d for each filter size k (F filters each) -> ReLU
    -> dynamic max pooling: each document's valid positions split into p chunks, max per chunk (B, F, p)
    -> concat over filter sizes (B, len(sizes) * F * p) -> Linear -> hidden H -> ReLU -> dropout
    -> representation (B, H)

The token ids are those of a Hugging Face fast tokenizer (by default the one of config.model_name, the
bundled all-MiniLM-L6-v2), so the pipeline's tokenization, caching and batching are shared with the
transformer encoders. Only the tokenizer's vocabulary is used: the word embeddings are NOT pretrained
(the paper's word2vec/GloVe vectors are not used); they are initialised at random, uniformly in
[-0.25, 0.25] as in Kim's CNN, from the run's seed.

Settings (config.options, e.g. `--set options.xmlcnn_emb_dim=300`), with their defaults:

    xmlcnn_emb_dim       300        E, word-embedding size
    xmlcnn_filter_sizes  "2,4,8"    convolution widths k (a list, or a comma-separated string)
    xmlcnn_num_filters   128        F, filters per width
    xmlcnn_pool_chunks   8          p, chunks of dynamic max pooling
    xmlcnn_hidden        512        H, the bottleneck (= out_dim)

plus `dropout` (a TrainConfig field) after the bottleneck.

Pooling is per document: the chunks split the positions of *that document's* text, not the padded batch
width. The pipeline pads each batch to its longest document, so pooling over the padded width (plain
adaptive_max_pool1d) would make a document's representation depend on its batch neighbours; here
padding never enters a window or a chunk, and appending padding changes nothing. A convolution window
is valid when it lies inside the text; a text shorter than the widest filter is treated as padded (with
the zero pad embedding) up to that width, so every document has at least one window per filter size.
Chunk j of a document with L valid windows holds windows r with floor(r * p / L) == j: the chunks of
adaptive max pooling when p divides L, disjoint otherwise. A chunk with no window (L < p) pools to 0
(the ReLU's floor).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from xmcbench.config import check_options
from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder
from xmcbench.tokenization import load_tokenizer
from xmcbench_xmlcnn.options import OPTIONS

HYPERPARAMETERS_FILE = "xmlcnn.json"

DEFAULTS = {option.name: option.default for option in OPTIONS}


def xmlcnn_hyperparameters(config) -> dict:
    """The encoder's shape settings from config.options (defaults for the missing ones), checked: an unknown
    xmlcnn_ name gets the closest declared ones, a bad value one line (the same rules `--set` applies)."""
    given = {key: value for key, value in (getattr(config, "options", {}) or {}).items() if key.startswith("xmlcnn_")}
    check_options(given, {option.name: (option, "encoder xml-cnn") for option in OPTIONS}, "options")
    values = {option.name: option.value_of(config) for option in OPTIONS}
    return {"emb_dim": values["xmlcnn_emb_dim"], "filter_sizes": list(values["xmlcnn_filter_sizes"]),
            "num_filters": values["xmlcnn_num_filters"], "pool_chunks": values["xmlcnn_pool_chunks"],
            "hidden": values["xmlcnn_hidden"]}


class XMLCNNEncoder(Encoder):
    """(B, T) ids + 0/1 mask -> (B, hidden) XML-CNN representation, dropout applied.

    Word embeddings are randomly initialised (no pretrained word vectors); the pad token's row is zero
    and stays zero (padding_idx)."""

    def __init__(self, tokenizer, emb_dim: int = 300, filter_sizes=(2, 4, 8), num_filters: int = 128,
                 pool_chunks: int = 8, hidden: int = 512, dropout: float = 0.5) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.vocab_size = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))
        self.emb_dim, self.num_filters, self.pool_chunks = emb_dim, num_filters, pool_chunks
        self.filter_sizes = tuple(int(k) for k in filter_sizes)
        self.max_filter = max(self.filter_sizes)
        self.hidden_size, self.dropout_p = hidden, float(dropout)
        self.out_dim = hidden

        self.embedding = nn.Embedding(self.vocab_size, emb_dim, padding_idx=self.pad_token_id)
        nn.init.uniform_(self.embedding.weight, -0.25, 0.25)
        with torch.no_grad():
            self.embedding.weight[self.pad_token_id].zero_()
        self.convs = nn.ModuleList(nn.Conv1d(emb_dim, num_filters, kernel_size=k) for k in self.filter_sizes)
        self.bottleneck = nn.Linear(len(self.filter_sizes) * num_filters * pool_chunks, hidden)
        self.dropout = nn.Dropout(dropout)

    def hyperparameters(self) -> dict:
        return {"emb_dim": self.emb_dim, "filter_sizes": list(self.filter_sizes), "num_filters": self.num_filters,
                "pool_chunks": self.pool_chunks, "hidden": self.hidden_size, "dropout": self.dropout_p,
                "vocab_size": self.vocab_size, "pad_token_id": self.pad_token_id}

    def _dynamic_max_pool(self, features: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                          kernel: int) -> torch.Tensor:
        """features (B, F, W) conv outputs (window r starts at token r); offsets, lengths (B,): where each
        text starts and how many tokens it has (at least the widest filter) -> (B, F, p)."""
        batch, filters, width = features.shape
        p = self.pool_chunks
        windows = (lengths - kernel + 1).unsqueeze(1)                          # (B, 1) valid windows, >= 1
        relative = torch.arange(width, device=features.device).unsqueeze(0) - offsets.unsqueeze(1)  # (B, W)
        valid = (relative >= 0) & (relative < windows)
        chunk = torch.div(relative.clamp(min=0) * p, windows, rounding_mode="floor")
        chunk = torch.where(valid, chunk, torch.full_like(chunk, p))           # padding -> a discarded chunk p
        pooled = features.new_full((batch, filters, p + 1), float("-inf"))
        pooled = pooled.scatter_reduce(2, chunk.unsqueeze(1).expand(-1, filters, -1), features, reduce="amax",
                                       include_self=True)[:, :, :p]
        return torch.where(torch.isneginf(pooled), torch.zeros_like(pooled), pooled)   # empty chunks -> 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.bool()                                           # (B, T)
        embedded = self.embedding(input_ids)                                   # (B, T, E)
        embedded = embedded * mask.unsqueeze(-1).to(embedded.dtype)            # padding is zero whatever its id
        # room for every text to be read as at least max_filter tokens long (short texts, left padding)
        embedded = F.pad(embedded.transpose(1, 2), (0, self.max_filter - 1))   # (B, E, T + kmax - 1)
        lengths = mask.sum(dim=1).clamp(min=self.max_filter)                   # (B,)
        offsets = mask.int().argmax(dim=1)                                     # first text token (B,)
        pooled = [self._dynamic_max_pool(torch.relu(conv(embedded)), offsets, lengths, kernel)
                  for conv, kernel in zip(self.convs, self.filter_sizes)]     # each (B, F, p)
        features = torch.cat(pooled, dim=1).flatten(1)                        # (B, sizes * F * p)
        return self.dropout(torch.relu(self.bottleneck(features)))             # (B, hidden)

    def export(self, directory: Path) -> dict:
        """Write the tokenizer and xmlcnn.json (the shape settings); the weights are the pipeline's."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(directory)
        (directory / HYPERPARAMETERS_FILE).write_text(json.dumps(self.hyperparameters(), indent=2) + "\n",
                                                      encoding="utf-8")
        return {"model_name": str(directory)}


def _saved_hyperparameters(folder: Path) -> dict | None:
    path = folder / HYPERPARAMETERS_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return {"emb_dim": int(saved["emb_dim"]), "filter_sizes": [int(k) for k in saved["filter_sizes"]],
                "num_filters": int(saved["num_filters"]), "pool_chunks": int(saved["pool_chunks"]),
                "hidden": int(saved["hidden"]), "dropout": float(saved["dropout"])}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise XmcError(f"{path} is damaged ({type(error).__name__}: {error}); re-run training") from None


def build_xmlcnn(config, **exported) -> XMLCNNEncoder:
    """Factory: the tokenizer of `model_name` (exported folder, else config.model_name); shape settings
    from that folder's xmlcnn.json when it has one (a saved model), else from config.options."""
    model_name = str(exported.get("model_name", config.model_name))
    tokenizer = load_tokenizer(model_name)
    settings = _saved_hyperparameters(Path(model_name)) if Path(model_name).is_dir() else None
    if settings is None:
        settings = {**xmlcnn_hyperparameters(config), "dropout": config.dropout}
    return XMLCNNEncoder(tokenizer, **settings)
