"""`transformer-cls`: a Hugging Face encoder whose text representation is the summary-token state of
its last n layers, concatenated (LightXML uses n = 5), optionally followed by a bag of the document's word pieces
(options.lexical_buckets) over the transformer's window or a longer one (options.lexical_window), raw or scaled to
one length (options.lexical_norm)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder
from xmcbench.tokenization import cuts_on_the_right, load_transformer
from xmcbench_lightxml.options import LEXICAL_BUCKETS, LEXICAL_NORM, LEXICAL_WINDOW

# Models whose summary token comes last (XLNet appends <sep><cls>); all others put it first.
SUMMARY_LAST_MODEL_TYPES = {"xlnet"}


class TransformerClsEncoder(Encoder):
    """(B, T) ids + mask -> (B, num_layers * hidden + lexical_buckets): the concatenated summary-token states,
    dropout applied, then, with lexical_buckets F > 0, the (B, F) bag of word pieces (lexical_bag).

    With lexical_window W > max_length the pipeline hands it up to W tokens a document (tokens_to_read); the bag
    counts them all and the transformer reads the first max_length (transformer_window)."""

    def __init__(self, model_name: str, num_layers: int = 5, dropout: float = 0.5,
                 pretrained_weights: bool = True, lexical_buckets: int = 0, lexical_window: int = 0,
                 max_length: int = 0, lexical_norm: float = 0.0) -> None:
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
        if lexical_norm > 0 and not lexical_buckets:
            raise XmcError(f"options.lexical_norm={lexical_norm:g} sets the length of each document's bag of word "
                           "pieces, but there is no bag: add --set options.lexical_buckets=4096 or drop "
                           "options.lexical_norm")
        self.lexical_norm = lexical_norm
        self.register_buffer("special_ids", torch.tensor(sorted(self.tokenizer.all_special_ids), dtype=torch.long),
                             persistent=False)
        self.max_length = max_length
        # max_length 0: built without a run's config, so the transformer reads whatever it is given
        self.lexical_window = lexical_window if max_length and lexical_window > max_length else 0
        if not self.lexical_window:
            return
        if not lexical_buckets:
            raise XmcError(f"options.lexical_window={lexical_window} sets how much of each document the bag of "
                           "word pieces reads, but there is no bag: add --set options.lexical_buckets=4096 or drop "
                           "options.lexical_window")
        if not cuts_on_the_right(self.tokenizer):
            raise XmcError("options.lexical_window cuts each document's first max_length tokens out of a longer "
                           "window, which needs a tokenizer that pads and truncates on the right; this one does not, "
                           "so drop options.lexical_window")
        self.register_buffer("truncation_suffix", self._truncation_suffix(), persistent=False)

    def _truncation_suffix(self) -> torch.Tensor:
        """(S,) the special tokens the tokenizer puts after a text's last word piece ([SEP] for BERT), which a text
        cut to max_length also ends with."""
        specials = set(self.tokenizer.all_special_ids)
        ids = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        words = [position for position, token in enumerate(ids) if token not in specials]
        return torch.tensor(ids[words[-1] + 1:] if words else [], dtype=torch.long)

    def tokens_to_read(self, max_length: int) -> int:
        return max(max_length, self.lexical_window)

    def transformer_window(self, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids + mask -> (B, min(T, max_length)) ids + mask: what the tokenizer gives for the same texts at
        max_length. A document longer than that keeps its first tokens and ends with truncation_suffix."""
        if not self.lexical_window or input_ids.shape[1] <= self.max_length:
            return input_ids, attention_mask
        ids = input_ids[:, :self.max_length].clone()
        cut = attention_mask[:, self.max_length:].any(dim=1)                                   # (B,)
        suffix = self.truncation_suffix
        if len(suffix):
            ids[cut, self.max_length - len(suffix):] = suffix
        return ids, attention_mask[:, :self.max_length]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        document_ids, document_mask = input_ids, attention_mask
        input_ids, attention_mask = self.transformer_window(input_ids, attention_mask)
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
        return torch.cat([summary, self.lexical_bag(document_ids, document_mask).to(summary.dtype)], dim=-1)

    def lexical_bag(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids + mask of every token read -> (B, F) float32: 1 + log(count) of the word pieces of each bucket
        (id modulo F), 0 where a bucket has none; padding and special tokens count nothing; with lexical_norm N > 0
        each row then scaled to Euclidean length N (a text with no word piece stays 0). No dropout: unlike the
        summary's correlated coordinates, each bucket is the only place its words are seen."""
        counted = (attention_mask > 0) & ~torch.isin(input_ids, self.special_ids)
        counts = torch.zeros(input_ids.shape[0], self.lexical_buckets, device=input_ids.device).scatter_add_(
            1, input_ids % self.lexical_buckets, counted.float())
        bag = torch.where(counts > 0, 1 + counts.clamp_min(1).log(), 0.0)
        if not self.lexical_norm:
            return bag
        return nn.functional.normalize(bag, dim=1) * self.lexical_norm

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return {"model_name": str(directory), "pretrained_weights": False}


def build_transformer_cls(config, **exported) -> TransformerClsEncoder:
    """Factory: reads model_name, num_layers, dropout, max_length and options.lexical_buckets, lexical_window and
    lexical_norm from the run config; `exported` comes from `export`."""
    return TransformerClsEncoder(
        model_name=exported.get("model_name", config.model_name),
        num_layers=config.num_layers,
        dropout=config.dropout,
        pretrained_weights=exported.get("pretrained_weights", config.pretrained_weights),
        lexical_buckets=LEXICAL_BUCKETS.value_of(config),
        lexical_window=LEXICAL_WINDOW.value_of(config),
        max_length=config.max_length,
        lexical_norm=LEXICAL_NORM.value_of(config),
    )
