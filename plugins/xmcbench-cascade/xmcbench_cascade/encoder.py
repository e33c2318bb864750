"""`transformer-levels`: one Hugging Face encoder that gives each level of the label tree its own text
representation, the summary-token states of its own layers, concatenated (CascadeXML, Kharbanda et al.,
NeurIPS 2022: coarse levels read earlier layers, the labels the last one)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder
from xmcbench.tokenization import load_transformer
from xmcbench_cascade.options import OPTIONS



def derived_level_layers(num_levels: int, num_hidden_layers: int) -> tuple[tuple[int, ...], ...]:
    """CascadeXML's pattern on any depth: the labels read the last layer, each coarser level `step` layers
    earlier (2 on a 12-layer BERT, 1 on a 6-layer MiniLM), the coarsest that layer and the one below it.
    On BERT-base: 4 levels -> (5, 6), (8,), (10,), (12,); 3 levels -> (7, 8), (10,), (12,)."""
    step = max(1, num_hidden_layers // 6)
    finest_first = [num_hidden_layers - step * depth for depth in range(num_levels)]
    if finest_first[-1] < 1:
        raise XmcError(f"a {num_hidden_layers}-layer encoder is too shallow for {num_levels} levels; set "
                       "options.level_layers or use fewer tree_levels")
    layers = [(layer,) for layer in reversed(finest_first)]
    if layers[0][0] > 1:
        layers[0] = (layers[0][0] - 1, layers[0][0])
    return tuple(layers)


def parse_level_layers(text: str, num_levels: int, num_hidden_layers: int) -> tuple[tuple[int, ...], ...]:
    """"5-6,8,10,12" -> ((5, 6), (8,), (10,), (12,)), checked against the levels and the encoder's depth."""
    try:
        groups = []
        for item in text.replace(" ", "").split(","):
            first, _, last = item.partition("-")
            groups.append(tuple(range(int(first), int(last or first) + 1)))
    except ValueError:
        groups = None
    if not groups or len(groups) != num_levels or not all(groups) or \
            any(not 1 <= layer <= num_hidden_layers for group in groups for layer in group):
        raise XmcError(f"options.level_layers={text!r} must name {num_levels} groups of layers between 1 and "
                       f"{num_hidden_layers}, one per scoring level (the recaller, each tree level, the labels), "
                       "e.g. 5-6,8,10,12")
    return tuple(groups)


def parse_level_dropout(text: str, num_levels: int, default: float) -> tuple[float, ...]:
    if not text:
        return (default,) * num_levels
    try:
        values = tuple(float(item) for item in text.split(","))
    except ValueError:
        values = ()
    if len(values) != num_levels or not all(0.0 <= value < 1.0 for value in values):
        raise XmcError(f"options.level_dropout={text!r} must give {num_levels} dropout rates in [0, 1), one per "
                       "scoring level, e.g. 0.2,0.25,0.35,0.5")
    return values


class TransformerLevelsEncoder(Encoder):
    """(B, T) ids + mask -> (B, sum of level_dims): for each scoring level, coarse to fine, the summary-token
    states of its layers concatenated, with its own dropout. level_dims[j] = len(layers[j]) * hidden."""

    def __init__(self, model_name: str, level_layers: str, level_dropout: str, dropout: float, num_levels: int,
                 pretrained_weights: bool = True) -> None:
        super().__init__()
        self.transformer, model_config, self.tokenizer, self.loaded_dtype = load_transformer(model_name,
                                                                                             pretrained_weights)
        if self.tokenizer.padding_side == "left" or model_config.model_type == "xlnet":
            raise XmcError(f"transformer-levels reads the first token's state ([CLS]), which {model_name!r} does not "
                           "put first; use a BERT-style encoder (BERT, RoBERTa, MiniLM), as CascadeXML does")
        depth = model_config.num_hidden_layers
        self.layers = parse_level_layers(level_layers, num_levels, depth) if level_layers else \
            derived_level_layers(num_levels, depth)
        self.level_dims = tuple(len(group) * model_config.hidden_size for group in self.layers)
        self.out_dim = sum(self.level_dims)
        self.dropouts = nn.ModuleList(nn.Dropout(rate)
                                      for rate in parse_level_dropout(level_dropout, num_levels, dropout))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden_states = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                         output_hidden_states=True).hidden_states   # embeddings, layer 1, ...
        summary = [states[:, 0] for states in hidden_states]   # the first token: [CLS] of BERT-style models
        return torch.cat([dropout(torch.cat([summary[layer] for layer in group], dim=-1))
                          for group, dropout in zip(self.layers, self.dropouts)], dim=-1)

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        layers = ",".join("-".join(map(str, (group[0], group[-1]) if len(group) > 1 else group))
                          for group in self.layers)
        return {"model_name": str(directory), "pretrained_weights": False, "level_layers": layers}


def build_transformer_levels(config, **exported) -> TransformerLevelsEncoder:
    """Factory: model_name, dropout, tree_levels (the number of scoring levels is len(tree_levels) + 2) and the
    options above; `exported` comes from `export` (the layers a saved model was trained with)."""
    options = {option.name: option.value_of(config) for option in OPTIONS}
    return TransformerLevelsEncoder(
        model_name=exported.get("model_name", config.model_name),
        level_layers=exported.get("level_layers", options["level_layers"]),
        level_dropout=options["level_dropout"],
        dropout=config.dropout,
        num_levels=len(config.tree_levels) + 2,
        pretrained_weights=exported.get("pretrained_weights", config.pretrained_weights),
    )
