"""`transformer-cls`: a Hugging Face encoder whose text representation is the summary-token state of
its last n layers, concatenated (LightXML uses n = 5), optionally followed by a bag of the window's word pieces
(options.lexical_buckets)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder
from xmcbench.tokenization import load_transformer
from xmcbench_lightxml.options import LEXICAL_BUCKETS

# Models whose summary token comes last (XLNet appends <sep><cls>); all others put it first.
SUMMARY_LAST_MODEL_TYPES = {"xlnet"}


class TransformerClsEncoder(Encoder):
    """(B, T) ids + mask -> (B, num_layers * hidden + lexical_buckets): the concatenated summary-token states,
    dropout applied, then, with lexical_buckets F > 0, the (B, F) bag of word pieces (lexical_bag)."""

    def __init__(self, model_name: str, num_layers: int = 5, dropout: float = 0.5,
                 pretrained_weights: bool = True, lexical_buckets: int = 0) -> None:
        super().__init__()
        # float32 master weights whatever dtype the files hold; AMP still computes in half precision
        self.transformer, model_config, self.tokenizer, self.loaded_dtype = load_transformer(model_name,
                                                                                             pretrained_weights)
        layers = model_config.num_hidden_layers
        if not 1 <= num_layers <= layers:
            raise XmcError(f"num_layers={num_layers} but {model_name!r} has {layers} layers; choose 1..{layers}")
        self.num_layers = num_layers
        self.summary_last = model_config.model_type in SUMMARY_LAST_MODEL_TYPES
        self.lexical_buckets = lexical_buckets
        self.out_dim = num_layers * model_config.hidden_size + lexical_buckets
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("special_ids", torch.tensor(sorted(self.tokenizer.all_special_ids), dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        outputs = self.transformer(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden_states = outputs.hidden_states[-self.num_layers:][::-1]  # last layer first, as in LightXML
        if self.summary_last:
            if self.tokenizer.padding_side == "left":
                position = torch.full_like(input_ids[:, 0], input_ids.shape[1] - 1)
            else:
                position = attention_mask.sum(dim=1) - 1
        else:
            position = torch.zeros_like(input_ids[:, 0])
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        summary = self.dropout(torch.cat([states[rows, position] for states in hidden_states], dim=-1))
        if not self.lexical_buckets:
            return summary
        return torch.cat([summary, self.lexical_bag(input_ids, attention_mask).to(summary.dtype)], dim=-1)

    def lexical_bag(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids + mask -> (B, F) float32: 1 + log(count) of the word pieces of each bucket (id modulo F),
        0 where a bucket has none; padding and special tokens count nothing. No dropout: unlike the summary's
        correlated coordinates, each bucket is the only place its words are seen."""
        counted = (attention_mask > 0) & ~torch.isin(input_ids, self.special_ids)
        counts = torch.zeros(input_ids.shape[0], self.lexical_buckets, device=input_ids.device).scatter_add_(
            1, input_ids % self.lexical_buckets, counted.float())
        return torch.where(counts > 0, 1 + counts.clamp_min(1).log(), 0.0)

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return {"model_name": str(directory), "pretrained_weights": False}


def build_transformer_cls(config, **exported) -> TransformerClsEncoder:
    """Factory: reads model_name, num_layers, dropout and options.lexical_buckets from the run config; `exported`
    comes from `export`."""
    return TransformerClsEncoder(
        model_name=exported.get("model_name", config.model_name),
        num_layers=config.num_layers,
        dropout=config.dropout,
        pretrained_weights=exported.get("pretrained_weights", config.pretrained_weights),
        lexical_buckets=LEXICAL_BUCKETS.value_of(config),
    )
