"""The model: encoder + recaller (+ ranker and sampler unless flat), its training loss and its final scores.

Components only compute; this module decides how their outputs combine. Training loss L = BCE(recall logits,
cluster targets) + BCE(rank logits, candidate targets); gradients of both reach the encoder. Final score =
sigmoid(recall logit of the label's cluster) * sigmoid(rank logit). With one label per cluster (flat) the
recaller scores every label and there is no ranker.
"""

from __future__ import annotations

import torch
from torch import nn

from xmcbench.candidates import expand_clusters
from xmcbench.config import JOINT_TRAINING, Stage
from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder, LabelClusters, Ranker, Recaller, Sampler


class XMCModel(nn.Module):
    """Encoder + recaller (+ ranker and sampler unless flat) + the label clusters as buffers.

    ranker_encoder: an optional second encoder whose representation only the ranker reads (the paper's
    BS ablation); by default the ranker reads the shared encoder's."""

    def __init__(self, encoder: Encoder, recaller: Recaller, ranker: Ranker | None, sampler: Sampler | None,
                 clusters: LabelClusters, ranker_encoder: Encoder | None = None) -> None:
        super().__init__()
        self.encoder, self.recaller, self.ranker, self.sampler = encoder, recaller, ranker, sampler
        self.ranker_encoder = ranker_encoder
        self.register_buffer("label_cluster", clusters.label_cluster.clone())
        self.register_buffer("cluster_labels", clusters.cluster_labels.clone())
        self.is_flat = clusters.is_flat
        if not self.is_flat and (ranker is None or sampler is None):
            raise XmcError("label clusters hold several labels each, so the method needs a ranker and a sampler")

    @property
    def clusters(self) -> LabelClusters:
        return LabelClusters(self.label_cluster, self.cluster_labels)

    def parts(self) -> dict[str, nn.Module]:
        """The trainable parts by name (see config.TRAINABLE_PARTS); absent ones are left out."""
        named = {"encoder": self.encoder, "ranker_encoder": self.ranker_encoder, "recaller": self.recaller,
                 "ranker": self.ranker}
        return {name: part for name, part in named.items() if part is not None}

    def forward(self, *args, **kwargs):
        """The training loss (see training_loss): what DistributedDataParallel calls."""
        return self.training_loss(*args, **kwargs)

    def training_loss(self, input_ids, attention_mask, positives, doc_index,
                      stage: Stage = JOINT_TRAINING[0], weigh=None, frozen_representations=None
                      ) -> tuple[torch.Tensor, dict]:
        """(B, T) ids and mask, positives (B, P) label ids padded with -1, doc_index (B,)
        -> (scalar loss, {"recall": tensor, "rank": tensor}) with the losses `stage` counts.

        frozen_representations: {"encoder": (B, D), "ranker_encoder": (B, D)} for encoders the stage does not
        train, computed once in eval mode (Trainer): what those encoders would return here, without running them.

        weigh: None, or a function {part: (mean loss, number of terms averaged)} -> {part: (weight, reported
        value)} that a distributed trainer uses to turn this process's means into its share of the global
        batch's means; the loss is then the weighted sum and the parts the reported values."""
        frozen_representations = frozen_representations or {}
        representation = frozen_representations.get("encoder")
        if representation is None:
            with torch.set_grad_enabled("encoder" in stage.trains and torch.is_grad_enabled()):
                representation = self.encoder(input_ids, attention_mask)      # (B, D)
        recall_logits = self.recaller(representation)                        # (B, K)
        total, parts, counts = 0.0, {}, {}
        if "recall" in stage.losses:
            # a scatter, not boolean-mask indexing: no output size that depends on the data, so no wait for
            # the device (padding slots write 0, and amax keeps a positive's 1 wherever both land)
            cluster_targets = torch.zeros(recall_logits.shape, device=recall_logits.device).scatter_reduce_(
                1, self.label_cluster[positives.clamp_min(0)], (positives >= 0).float(), reduce="amax")
            recall_loss = self.recaller.loss(recall_logits, cluster_targets)
            total, parts["recall"] = recall_loss, recall_loss.detach()
            counts["recall"] = recall_logits.numel()
        if "rank" in stage.losses and not self.is_flat:
            candidates = self.sampler(recall_logits.detach(), positives, self.clusters, doc_index)
            if self.ranker_encoder is not None:
                representation = frozen_representations.get("ranker_encoder")
                if representation is None:
                    with torch.set_grad_enabled("ranker_encoder" in stage.trains and torch.is_grad_enabled()):
                        representation = self.ranker_encoder(input_ids, attention_mask)
            rank_logits = self.ranker(representation, candidates.labels)      # (B, C)
            # the mean over real candidates as a weighted sum: a boolean-mask selection would make the host
            # wait for the device to learn its size
            per_candidate = nn.functional.binary_cross_entropy_with_logits(
                rank_logits.float(), candidates.targets, reduction="none")
            real = candidates.mask.float()
            counts["rank"] = real.sum()
            rank_loss = (per_candidate * real).sum() / counts["rank"].clamp_min(1.0)
            total, parts["rank"] = total + rank_loss, rank_loss.detach()
        if weigh is not None:
            weights = weigh({name: (parts[name], counts[name]) for name in parts})
            losses = {"recall": recall_loss if "recall" in parts else None,
                      "rank": rank_loss if "rank" in parts else None}
            total = sum(losses[name] * weights[name][0] for name in parts)
            parts = {name: weights[name][1] for name in parts}
        return total, parts

    @torch.no_grad()
    def predict_top(self, input_ids, attention_mask, top_clusters: int, top_k: int):
        """(B, T) ids and mask -> labels (B, k) long (-1 where a document has fewer than k candidates),
        scores (B, k) float, recalled clusters (B, b) long (None when flat)."""
        representation = self.encoder(input_ids, attention_mask)
        recall_scores = torch.sigmoid(self.recaller(representation).float())  # (B, K)
        if self.is_flat:
            scores, labels = recall_scores.topk(min(top_k, recall_scores.shape[1]), dim=1)
            return _pad_right(labels, scores, top_k), None
        cluster_scores, recalled = recall_scores.topk(min(top_clusters, recall_scores.shape[1]), dim=1)
        candidates = expand_clusters(recalled, torch.ones_like(recalled, dtype=torch.bool), self.clusters)
        if self.ranker_encoder is not None:
            representation = self.ranker_encoder(input_ids, attention_mask)
        rank_scores = torch.sigmoid(self.ranker(representation, candidates.labels).float())   # (B, C)
        scores = recall_scores.gather(1, candidates.clusters) * rank_scores
        scores = torch.where(candidates.mask, scores, -1.0)
        scores, slots = scores.topk(min(top_k, scores.shape[1]), dim=1)
        labels = torch.where(scores >= 0, candidates.labels.gather(1, slots), -1)
        return _pad_right(labels, scores, top_k), recalled


def _pad_right(labels: torch.Tensor, scores: torch.Tensor, width: int):
    missing = width - labels.shape[1]
    if missing > 0:
        labels = nn.functional.pad(labels, (0, missing), value=-1)
        scores = nn.functional.pad(scores, (0, missing), value=-1.0)
    return labels, scores
