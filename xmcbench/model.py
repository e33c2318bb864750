"""The model: an encoder, a recaller, the levels of a label tree below it, their losses and final scores.

Components only compute; this module decides how their outputs combine. The label tree has the recaller's
nodes at its top, the labels at its bottom and, optionally, finer levels of nodes between them
(config.tree_levels; LightXML has none: its recaller scores the leaf clusters). Every level below the
recaller scores the children of the nodes the level above kept, with a ranker, on candidates a sampler
chooses during training. Training loss L = BCE(recall logits, targets of the recaller's nodes) + the sum over
the levels below of BCE(their logits, their candidates' targets); gradients of every term reach the encoder.
Each level keeps its nodes of highest probability (sigmoid of their logits) and scores their children; a
label's final score combines its probability with its leaf cluster's (config.score_combiner): by default their
product (CascadeXML's scoring, which for LightXML is sigmoid(recall logit of the label's cluster) *
sigmoid(rank logit)). With one label per cluster (flat) the recaller scores every label and there is no level
below it, and its labels are ranked by their logits. Probabilities are ranked in SCORE_DTYPE (below).

A ranker may replace the binary cross-entropy with its own loss (Ranker.loss). A recaller that is a Retriever
(one "cluster" per label, found by nearest-neighbour search over label embeddings) is asked for its top labels
by `search` at prediction time instead of scoring all of them; with a ranker and a sampler it also works as a
shortlist for them, with one label per cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from xmcbench.candidates import expand_clusters, unique_per_row
from xmcbench.config import JOINT_TRAINING, SCORE_COMBINERS, Stage
from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder, LabelClusters, Ranker, Recaller, Retriever, Sampler

# The dtype probabilities are ranked in. In float32 the sigmoid of every logit above about 16.6 is exactly 1, and
# labels tied at 1 would be ranked by their ids: an overconfident head's most frequent labels are those logits.
# float64 rounds to 1 only above about 36.7. Scores are still saved as float32, so near 1 a file's scores may tie
# where its order (the model's) does not.
SCORE_DTYPE = torch.float64


class TreeLevel(nn.Module):
    """A level of nodes between the recaller's and the labels: a ranker scoring its nodes, the sampler that
    picks its training candidates, and how its nodes hang under the level above (`clusters`: items are this
    level's nodes, clusters the parents). `keep`: how many parents the descent keeps before expanding them.
    The mapping follows from the tree's shape (config.tree_levels), so it is not saved with the weights."""

    def __init__(self, ranker: Ranker, sampler: Sampler, clusters: LabelClusters, keep: int) -> None:
        super().__init__()
        self.ranker, self.sampler, self.keep = ranker, sampler, keep
        self.register_buffer("item_group", clusters.label_cluster.clone(), persistent=False)
        self.register_buffer("group_items", clusters.cluster_labels.clone(), persistent=False)

    @property
    def clusters(self) -> LabelClusters:
        return LabelClusters(self.item_group, self.group_items)


@dataclass
class _Scorer:
    """One level below the recaller as the loss and the descent see it."""
    ranker: Ranker
    sampler: Sampler | None
    clusters: LabelClusters      # this level's items under the parents the level above keeps
    keep: int | None             # parents kept by the descent; None: config.top_clusters (the leaf clusters)
    representation: torch.Tensor


class XMCModel(nn.Module):
    """Encoder + recaller (+ the tree levels, the label ranker and sampler unless flat) + the label clusters
    as buffers.

    ranker_encoder: an optional second encoder whose representation only the label ranker reads (the paper's
    BS ablation); by default every level reads the shared encoder's.
    levels: the TreeLevels between the recaller's nodes and the leaf clusters, coarse to fine (none for
    LightXML). The encoder feeds every level the same (B, D) representation, or, when it declares
    `level_dims` (one size per scoring level: recaller, each tree level, labels), level j reads its own
    slice of it.
    score_combiner, ranker_weight: how a label's final score follows from its own probability p and its leaf
    cluster's (or, under a retriever, its own search score's) probability q: "product" p * q, "weighted-sum"
    ranker_weight * p + (1 - ranker_weight) * q (xmcbench.config.SCORE_COMBINERS)."""

    def __init__(self, encoder: Encoder, recaller: Recaller, ranker: Ranker | None, sampler: Sampler | None,
                 clusters: LabelClusters, ranker_encoder: Encoder | None = None,
                 levels: tuple[TreeLevel, ...] = (), score_combiner: str = "product",
                 ranker_weight: float = 0.5) -> None:
        super().__init__()
        self.encoder, self.recaller, self.ranker, self.sampler = encoder, recaller, ranker, sampler
        self.ranker_encoder = ranker_encoder
        self.register_buffer("label_cluster", clusters.label_cluster.clone())
        self.register_buffer("cluster_labels", clusters.cluster_labels.clone())
        # flat: the recaller's scores are the labels' and nothing is below it (a retriever with a ranker is not)
        self.is_flat = clusters.is_flat and ranker is None
        if not clusters.is_flat and (ranker is None or sampler is None):
            raise XmcError("label clusters hold several labels each, so the method needs a ranker and a sampler")
        if (ranker is None) != (sampler is None):
            raise XmcError("a ranker is trained on the candidates a sampler chooses: name both, or neither")
        if levels and isinstance(recaller, Retriever):
            raise XmcError(f"the recaller {type(recaller).__name__} is a retriever over labels, which has no "
                           "clusters to build tree levels on; drop tree_levels")
        self.score_combiner, self.ranker_weight = score_combiner, ranker_weight
        if score_combiner not in SCORE_COMBINERS:
            raise XmcError(f"score_combiner={score_combiner!r} is not one of {', '.join(SCORE_COMBINERS)}")
        if levels:
            self.levels = nn.ModuleList(levels)   # absent when empty, so a LightXML model's names stay its own
        level_dims = getattr(encoder, "level_dims", None)
        if level_dims is not None and (len(level_dims) != 2 + len(levels) or sum(level_dims) != encoder.out_dim):
            raise XmcError(f"the encoder gives {len(level_dims)} level representations (sizes {tuple(level_dims)}) "
                           f"but the model scores {2 + len(levels)} levels (the recaller, {len(levels)} tree levels, "
                           f"the labels), or their sizes do not add up to its out_dim {encoder.out_dim}; set the "
                           "encoder's layers per level to match tree_levels")

    @property
    def tree_levels(self) -> tuple["TreeLevel", ...]:
        return tuple(self.levels) if hasattr(self, "levels") else ()

    @property
    def clusters(self) -> LabelClusters:
        return LabelClusters(self.label_cluster, self.cluster_labels)

    @property
    def is_retriever(self) -> bool:
        return isinstance(self.recaller, Retriever)

    def components(self) -> list[tuple[str, nn.Module, int]]:
        """(name, component, depth) of the components that receive lifecycle events
        (xmcbench.interfaces.LifecycleEvents), top of the tree first: "recaller" (depth 0), "level{d}.ranker" and
        "level{d}.sampler" of the tree levels, "ranker" and "sampler" of the labels. depth: the scoring level
        whose nodes the component's candidates come from (a StageContext's recalled_clusters reads it)."""
        named = [("recaller", self.recaller, 0)]
        for depth, level in enumerate(self.tree_levels):
            named += [(f"level{depth + 1}.ranker", level.ranker, depth), (f"level{depth + 1}.sampler", level.sampler, depth)]
        named += [("ranker", self.ranker, len(self.tree_levels)), ("sampler", self.sampler, len(self.tree_levels))]
        return [(name, part, depth) for name, part, depth in named if part is not None]

    def part_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The parameters of each trainable part (parts()), each parameter under the first part holding it: a
        component that shares the encoder (it received it through its factory) does not own the encoder's
        parameters, so a stage that freezes the encoder freezes them wherever they are used."""
        seen: set[int] = set()
        owned = {}
        for name, part in self.parts().items():
            owned[name] = [parameter for parameter in part.parameters() if id(parameter) not in seen]
            seen.update(id(parameter) for parameter in owned[name])
        return owned

    def parts(self) -> dict[str, nn.Module]:
        """The trainable parts by name (see config.TRAINABLE_PARTS); absent ones are left out. "ranker" is
        every ranker below the recaller: the tree levels' and the labels'."""
        rankers = self.ranker if not self.tree_levels else nn.ModuleList(
            [level.ranker for level in self.tree_levels] + [self.ranker])
        named = {"encoder": self.encoder, "ranker_encoder": self.ranker_encoder, "recaller": self.recaller,
                 "ranker": rankers}
        return {name: part for name, part in named.items() if part is not None}

    def level_inputs(self, representation: torch.Tensor) -> list[torch.Tensor]:
        """(B, D) -> the representation each scoring level reads (recaller, tree levels, labels)."""
        level_dims = getattr(self.encoder, "level_dims", None)
        if level_dims is None:
            return [representation] * (2 + len(self.tree_levels))
        return list(representation.split(list(level_dims), dim=1))

    def _scorers(self, inputs: list[torch.Tensor], label_representation: torch.Tensor | None) -> list[_Scorer]:
        """The levels below the recaller, coarse to fine, the labels last."""
        scorers = [_Scorer(level.ranker, level.sampler, level.clusters, level.keep, inputs[1 + depth])
                   for depth, level in enumerate(self.tree_levels)]
        return scorers + [_Scorer(self.ranker, self.sampler, self.clusters, None,
                                  inputs[-1] if label_representation is None else label_representation)]

    def node_of(self, labels: torch.Tensor, depth: int) -> torch.Tensor:
        """Label ids (any shape, >= 0) -> their ancestor at scoring level `depth` (0: the recaller's nodes;
        len(tree_levels): the leaf clusters)."""
        nodes = self.label_cluster[labels]
        for level in reversed(self.tree_levels[depth:]):
            nodes = level.item_group[nodes]
        return nodes

    def forward(self, *args, **kwargs):
        """The training loss (see training_loss): what DistributedDataParallel calls."""
        return self.training_loss(*args, **kwargs)

    def training_loss(self, input_ids, attention_mask, positives, doc_index,
                      stage: Stage = JOINT_TRAINING[0], weigh=None, frozen_representations=None
                      ) -> tuple[torch.Tensor, dict]:
        """(B, T) ids and mask, positives (B, P) label ids padded with -1, doc_index (B,)
        -> (scalar loss, {"recall": tensor, "rank": tensor}) with the losses `stage` counts; "rank" is the sum
        over the levels below the recaller.

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
        inputs = self.level_inputs(representation)
        # a retriever's recall logits score every label: computed only when the loss or the sampler reads them
        needs_recall_logits = "recall" in stage.losses or not self.is_retriever or (
            "rank" in stage.losses and self.sampler is not None and self.sampler.reads_recall_logits)
        recall_logits = self.recaller(inputs[0]) if needs_recall_logits else None     # (B, K)
        losses, counts = {}, {}
        if "recall" in stage.losses:
            # a scatter, not boolean-mask indexing: no output size that depends on the data, so no wait for
            # the device (padding slots write 0, and amax keeps a positive's 1 wherever both land)
            cluster_targets = torch.zeros(recall_logits.shape, device=recall_logits.device).scatter_reduce_(
                1, self.node_of(positives.clamp_min(0), 0), (positives >= 0).float(), reduce="amax")
            losses["recall"] = self.recaller.loss(recall_logits, cluster_targets)
            counts["recall"] = recall_logits.numel()
        if "rank" in stage.losses and not self.is_flat:
            label_representation = None
            if self.ranker_encoder is not None:
                label_representation = frozen_representations.get("ranker_encoder")
                if label_representation is None:
                    with torch.set_grad_enabled("ranker_encoder" in stage.trains and torch.is_grad_enabled()):
                        label_representation = self.ranker_encoder(input_ids, attention_mask)
                label_representation = self.level_inputs(label_representation)[-1]
            parent_logits = None if recall_logits is None else recall_logits.detach()
            scorers = self._scorers(inputs, label_representation)
            for depth, scorer in enumerate(scorers):
                last = depth == len(scorers) - 1
                level_positives = positives if last else self._distinct_nodes(positives, depth + 1)
                candidates = scorer.sampler(parent_logits, level_positives, scorer.clusters, doc_index)
                logits = scorer.ranker(scorer.representation, candidates.labels)          # (B, C)
                name = "rank" if last else f"rank:{depth + 1}"
                counts[name] = candidates.mask.float().sum()
                losses[name] = scorer.ranker.loss(logits, candidates)
                if not last:   # the next level's sampler reads this level's logits over all its nodes
                    lowest = torch.finfo(torch.float32).min
                    parent_logits = torch.full((len(logits), scorer.clusters.num_labels), lowest,
                                               device=logits.device).scatter_reduce(
                        1, candidates.labels, torch.where(candidates.mask, logits.detach().float(), lowest),
                        reduce="amax")
        if weigh is not None:
            weights = weigh({name: (losses[name].detach(), counts[name]) for name in losses})
            total = sum(losses[name] * weights[name][0] for name in losses)
            reported = {name: weights[name][1] for name in losses}
        else:
            total = 0.0
            for loss in losses.values():
                total = loss if isinstance(total, float) else total + loss
            reported = {name: loss.detach() for name, loss in losses.items()}
        parts = {name: value for name, value in reported.items() if ":" not in name}
        if "rank" in parts:
            for name, value in reported.items():
                if name.startswith("rank:"):
                    parts["rank"] = parts["rank"] + value
        return total, parts

    def _distinct_nodes(self, positives: torch.Tensor, depth: int) -> torch.Tensor:
        """(B, P) label ids padded with -1 -> their ancestors at scoring level `depth`, each once per row,
        padded with -1 (a sampler's positives at that level)."""
        nodes, keep = unique_per_row(self.node_of(positives.clamp_min(0), depth), positives >= 0)
        return torch.where(keep, nodes, -1)

    def _descend(self, input_ids, attention_mask, top_clusters: int, depth: int | None = None):
        """Score the levels from the top down. Each level keeps its nodes of highest probability (its scorer's
        `keep`, top_clusters for the leaf clusters) and scores their children, a child's score being its
        probability times its parent's. Returns (candidates, scores (B, C) with -1 where masked, kept parents)
        of the labels, or with depth = d the (B, top_clusters) best nodes of scoring level d (0: the recaller's)."""
        inputs = self.level_inputs(self.encoder(input_ids, attention_mask))
        probabilities = None   # (B, nodes of the level), -1 unscored; a retriever's top level is searched instead
        if not self.is_retriever:
            probabilities = torch.sigmoid(self.recaller(inputs[0]).to(SCORE_DTYPE))
        label_representation = None
        if self.ranker_encoder is not None and depth is None:
            label_representation = self.level_inputs(self.ranker_encoder(input_ids, attention_mask))[-1]
        scorers = self._scorers(inputs, label_representation)
        for level, scorer in enumerate(scorers):
            keep = top_clusters if level == depth else scorer.keep or top_clusters
            if probabilities is None:
                kept, kept_logits = self.recaller.search(inputs[0], keep)
                kept_probabilities = torch.sigmoid(kept_logits.to(SCORE_DTYPE))
            else:
                kept_probabilities, kept = probabilities.topk(min(keep, probabilities.shape[1]), dim=1)
            if level == depth:
                return kept
            candidates = expand_clusters(kept, kept_probabilities >= 0, scorer.clusters)
            own = torch.sigmoid(scorer.ranker(scorer.representation, candidates.labels).to(SCORE_DTYPE))   # (B, C)
            if level < len(scorers) - 1:
                probabilities = torch.full((len(own), scorer.clusters.num_labels), -1.0, dtype=own.dtype,
                                           device=own.device
                                           ).scatter_reduce(1, candidates.labels,
                                                            torch.where(candidates.mask, own, -1.0), reduce="amax")
        # each candidate's parent probability: candidates come cluster by cluster, in the order of `kept`
        width = scorer.clusters.cluster_labels.shape[1]
        parent = kept_probabilities.repeat_interleave(width, dim=1)                  # (B, C)
        combined = SCORE_COMBINERS[self.score_combiner](own, parent, self.ranker_weight)
        scores = torch.where(candidates.mask, combined, -1.0)
        return candidates, scores, kept

    @torch.no_grad()
    def top_nodes(self, input_ids, attention_mask, depth: int, top: int) -> torch.Tensor:
        """(B, T) ids and mask -> (B, top) the nodes of scoring level `depth` (0: the recaller's) a document
        reaches: by recall logit at the recaller's level, by probability below it (the descent of predict_top,
        whose leaf level keeps `top`)."""
        if depth == 0:
            representation = self.level_inputs(self.encoder(input_ids, attention_mask))[0]
            if self.is_retriever:
                return self.recaller.search(representation, top)[0]
            return self.recaller(representation).float().topk(min(top, self.recaller.num_clusters), dim=1).indices
        return self._descend(input_ids, attention_mask, top, depth)

    @torch.no_grad()
    def predict_top(self, input_ids, attention_mask, top_clusters: int, top_k: int):
        """(B, T) ids and mask -> labels (B, k) long (-1 where a document has fewer than k candidates),
        scores (B, k) SCORE_DTYPE, recalled leaf clusters (B, b) long (None when flat)."""
        if self.is_flat:
            representation = self.level_inputs(self.encoder(input_ids, attention_mask))[0]
            if self.is_retriever:
                labels, logits = self.recaller.search(representation, top_k)
                return _pad_right(labels, torch.sigmoid(logits.to(SCORE_DTYPE)), top_k), None
            logits = self.recaller(representation).float()
            top_logits, labels = logits.topk(min(top_k, logits.shape[1]), dim=1)
            return _pad_right(labels, torch.sigmoid(top_logits.to(SCORE_DTYPE)), top_k), None
        candidates, scores, recalled = self._descend(input_ids, attention_mask, top_clusters)
        scores, slots = scores.topk(min(top_k, scores.shape[1]), dim=1)
        labels = torch.where(scores >= 0, candidates.labels.gather(1, slots), -1)
        return _pad_right(labels, scores, top_k), recalled

    def nodes_at(self, depth: int) -> int:
        """The number of nodes of scoring level `depth` (0: the recaller's; the last: the leaf clusters)."""
        return self.recaller.num_clusters if depth == 0 else self.tree_levels[depth - 1].clusters.num_labels


def _pad_right(labels: torch.Tensor, scores: torch.Tensor, width: int):
    missing = width - labels.shape[1]
    if missing > 0:
        labels = nn.functional.pad(labels, (0, missing), value=-1)
        scores = nn.functional.pad(scores, (0, missing), value=-1.0)
    return labels, scores
