"""Running a model over every document of a set: one sharded, length-ordered loop (`map_documents`) that
prediction and training's whole-set passes (a frozen encoder's representations, the recalled clusters a
static sampler draws from) share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from xmcbench.config import TrainConfig
from xmcbench.device import autocast, to_device
from xmcbench.distributed import Distributed
from xmcbench.model import XMCModel
from xmcbench.progress import progress_bar
from xmcbench.tokenization import TokenizedTexts


@dataclass(frozen=True)
class Output:
    """One array `map_documents` fills: (N, *shape) of `dtype`, `fill` where no process wrote."""
    shape: tuple[int, ...]
    dtype: type
    fill: float | int


@torch.no_grad()
def map_documents(model: nn.Module, tokens: TokenizedTexts, function: Callable, outputs: tuple[Output, ...],
                  config: TrainConfig, device: torch.device, dist: Distributed | None = None,
                  description: str | None = None) -> tuple[np.ndarray, ...]:
    """function(input_ids (B, T), attention_mask (B, T)) -> one (B, *shape) tensor per output, applied to
    every document in eval mode, in batches of config.eval_batch_size documents of similar length (padding
    stays minimal). In a distributed run each process computes every world_size-th document of the length
    order and every process receives the whole (N, *shape) arrays. The model's train/eval mode is restored.
    description: the progress line's text; None shows none."""
    dist = dist or Distributed()
    was_training = model.training
    model.eval()
    order = np.argsort(tokens.lengths, kind="stable")
    mine = order[dist.rank::dist.world_size]
    values = [np.full((len(mine), *output.shape), output.fill, dtype=output.dtype) for output in outputs]
    shown = progress_bar(description, total=len(mine), unit="documents") if description is not None else \
        contextlib.nullcontext(lambda documents: None)
    with shown as advance:
        for start in range(0, len(mine), config.eval_batch_size):
            rows = mine[start:start + config.eval_batch_size]
            with autocast(device, config):
                results = function(*to_device(device, *tokens.batch(rows)))
            for array, result in zip(values, results):
                array[start:start + len(rows)] = (result.float() if array.dtype == np.float32 else result).cpu().numpy()
            advance(len(rows))
    model.train(was_training)
    return tuple(dist.gather_rows(mine, array, len(order), fill=output.fill) for array, output in zip(values, outputs))


@dataclass
class Predictions:
    labels: np.ndarray            # (N, k) int64, best first, -1 for empty slots
    scores: np.ndarray            # (N, k) float32
    recalled: np.ndarray | None   # (N, b) int64 recalled cluster ids, None when flat


def predict(model: XMCModel, tokens: TokenizedTexts, config: TrainConfig, device: torch.device,
            description: str = "predicting", dist: Distributed | None = None) -> Predictions:
    """Top config.top_k labels of every document (and its recalled clusters unless flat)."""
    model.to(device)
    outputs = [Output((config.top_k,), np.int64, -1), Output((config.top_k,), np.float32, -1.0)]
    if not model.is_flat:
        outputs.append(Output((min(config.top_clusters, model.clusters.num_clusters),), np.int64, 0))   # leaf clusters

    def top(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        (labels, scores), recalled = model.predict_top(input_ids, attention_mask, config.top_clusters, config.top_k)
        return (labels, scores) if recalled is None else (labels, scores, recalled)

    found = map_documents(model, tokens, top, tuple(outputs), config, device, dist, description)
    return Predictions(found[0], found[1], None if model.is_flat else found[2])


def recalled_truth(truth: sp.csr_matrix, recalled: np.ndarray, label_cluster: np.ndarray) -> sp.csr_matrix:
    """The true labels (N, L_total) whose cluster is among each document's recalled clusters (N, b);
    labels unseen in training (ids >= len(label_cluster)) are never recalled."""
    truth = truth.tocoo()
    known = truth.col < len(label_cluster)
    hit = np.zeros(truth.nnz, dtype=bool)
    cluster = label_cluster[truth.col[known]]
    hit[known] = (recalled[truth.row[known]] == cluster[:, None]).any(axis=1)
    return sp.csr_matrix((np.ones(hit.sum(), dtype=np.float32), (truth.row[hit], truth.col[hit])), shape=truth.shape)
