"""`transformer-mean`: a Hugging Face encoder whose text representation is the mean of its last layer's token
states over the real tokens (sentence-transformers' pooling, which all-MiniLM-L6-v2 and msmarco-distilbert were
trained with; their [CLS] state was never trained as a summary)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xmcbench.interfaces import Encoder
from xmcbench.tokenization import load_transformer


class TransformerMeanEncoder(Encoder):
    """(B, T) ids + mask -> (B, hidden) the mean of the last layer's states over unmasked tokens, dropout applied."""

    def __init__(self, model_name: str, dropout: float = 0.0, pretrained_weights: bool = True) -> None:
        super().__init__()
        # float32 master weights whatever dtype the files hold; AMP still computes in half precision
        self.transformer, model_config, self.tokenizer, self.loaded_dtype = load_transformer(model_name,
                                                                                             pretrained_weights)
        self.out_dim = model_config.hidden_size
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        mask = attention_mask.unsqueeze(-1).to(states.dtype)                                           # (B, T, 1)
        return self.dropout((states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1))   # padding never counts

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return {"model_name": str(directory), "pretrained_weights": False}


def build_transformer_mean(config, **exported) -> TransformerMeanEncoder:
    """Factory: model_name and dropout from the run config; `exported` comes from `export`."""
    return TransformerMeanEncoder(model_name=exported.get("model_name", config.model_name), dropout=config.dropout,
                                  pretrained_weights=exported.get("pretrained_weights", config.pretrained_weights))
