"""The one pipeline: step order, losses, final scores, device placement and mixed precision.

Components only compute; this module decides when they run, on which device and in which precision.
Training loss L = BCE(recall logits, cluster targets) + BCE(rank logits, candidate targets); gradients of
both reach the encoder. Final score = sigmoid(recall logit of the label's cluster) * sigmoid(rank logit).
With one label per cluster (flat) the recaller scores every label and there is no ranker.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from xmcbench.candidates import expand_clusters
from xmcbench.config import JOINT_TRAINING, Stage, TrainConfig
from xmcbench.distributed import Distributed
from xmcbench.errors import XmcError
from xmcbench.interfaces import Encoder, LabelClusters, Ranker, Recaller, Sampler
from xmcbench.optim import RowAdam
from xmcbench.progress import progress_bar
from xmcbench.tokenization import TokenizedTexts


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


# -- device, precision, randomness ------------------------------------------------------------------

def pick_device(config: TrainConfig, dist: Distributed | None = None) -> torch.device:
    """config.device; in a distributed run "auto" and "cuda" mean this process's GPU (cuda:LOCAL_RANK)."""
    if dist is not None and dist.enabled and torch.cuda.is_available() and config.device in ("auto", "cuda"):
        return torch.device("cuda", dist.local_rank)
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise XmcError(f"device={config.device!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise XmcError("device=cuda but torch sees no CUDA device; use --set device=cpu")
    return device


def set_threads(config: TrainConfig) -> int:
    """Torch's CPU threads: config.threads, else one per core available to this process."""
    threads = config.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device, config: TrainConfig):
    if device.type == "cuda" and config.amp:
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


# -- batches ----------------------------------------------------------------------------------------

def padded_positives(labels: sp.csr_matrix, rows: np.ndarray) -> torch.Tensor:
    """Rows of a (N, L) 0/1 csr -> (B, P) long label ids padded with -1, P = most labels in the batch."""
    block = labels[rows]
    counts = np.diff(block.indptr)
    positives = np.full((len(rows), max(int(counts.max(initial=0)), 1)), -1, dtype=np.int64)
    slot = np.arange(block.nnz) - np.repeat(block.indptr[:-1], counts)
    positives[np.repeat(np.arange(len(rows)), counts), slot] = block.indices
    return torch.from_numpy(positives)


def epoch_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, bucketing: bool,
                  bucket_batches: int = 50) -> list[np.ndarray]:
    """A shuffled epoch. With bucketing, each window of `bucket_batches` batches is sorted by length before
    it is cut, so a batch pads to a similar length; the batch order is then shuffled."""
    order = rng.permutation(len(lengths))
    if bucketing:
        window = batch_size * bucket_batches
        order = np.concatenate([chunk[np.argsort(lengths[chunk], kind="stable")]
                                for chunk in np.array_split(order, max(1, -(-len(order) // window)))])
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if bucketing:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host tensors onto `device`. To a GPU through pinned memory without waiting: a copy from ordinary
    memory would wait until the GPU has finished everything queued before it."""
    if device.type != "cuda":
        return tuple(tensor.to(device) for tensor in tensors)
    return tuple(tensor.pin_memory().to(device, non_blocking=True) for tensor in tensors)


# -- training ---------------------------------------------------------------------------------------

# Steps between two reads of the training losses from the device (each read waits for a GPU to catch up).
LOSS_READ_EVERY = 32
# A stage's frozen encoder runs once over the training set and its representations are kept, up to this size
# (float32; 24,629 documents x 1,920 dimensions is 0.19 GB); beyond it, the frozen encoder runs every step.
FROZEN_REPRESENTATION_BYTES = 4 * 2**30

@dataclass
class TrainingLog:
    steps: list[dict] = field(default_factory=list)           # per step: step, epoch, loss, recall, rank
    validation: list[dict] = field(default_factory=list)      # per epoch when a validation split exists
    selected_epoch: int | None = None
    stopped_early: int | None = None   # the epoch after which early stopping ended training
    swa_updates: int = 0


def build_optimizers(model: XMCModel, config: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay except on biases and LayerNorm; encoders at config.lr, the rest at
    config.head_lr (when set). Sparse embeddings get RowAdam (SparseAdam's semantics, much faster), which
    updates only the rows a step touched (and so carries no weight decay)."""
    head_lr = config.head_lr or config.lr
    sparse_ids = {id(parameter) for parameter in sparse_parameters(model).values()}
    groups: dict[tuple[float, float], list] = {}
    sparse = []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if id(parameter) in sparse_ids:
            sparse.append(parameter)
            continue
        no_decay = parameter.ndim < 2 or "LayerNorm" in name or "layer_norm" in name or name.endswith(".bias")
        lr = config.lr if name.split(".")[0] in ("encoder", "ranker_encoder") else head_lr
        groups.setdefault((lr, 0.0 if no_decay else config.weight_decay), []).append(parameter)
    optimizers: list[torch.optim.Optimizer] = []
    if groups:
        param_groups = [{"params": params, "lr": lr, "weight_decay": decay} for (lr, decay), params in groups.items()]
        try:
            # The fused kernel updates all parameters in one pass; on a 2-core CPU it made the AdamW step
            # over MiniLM + BERT-sized tensors about 4x faster than the default loop (benchmarks/).
            optimizers.append(torch.optim.AdamW(param_groups, lr=config.lr, fused=True))
        except (RuntimeError, TypeError, ValueError):   # a torch or device without the fused kernel
            optimizers.append(torch.optim.AdamW(param_groups, lr=config.lr))
    if sparse:
        optimizers.append(RowAdam(sparse, lr=head_lr))
    return optimizers


def sparse_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters whose gradient is sparse (embeddings built with sparse=True), by qualified name."""
    sparse_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.sparse}
    return {name: parameter for name, parameter in model.named_parameters() if id(parameter) in sparse_ids}


class TrainingInterrupted(XmcError):
    """Ctrl-C during training: a checkpoint was written first."""


class Trainer:
    """Owns the training loop and everything needed to continue it exactly after a stop: stage and
    position in the data order, model, optimizers, scaler, SWA average, sampler state, RNG states, log
    and best state.

    labels: (N, L) 0/1 csr of the training documents, rows aligned with `tokens`.
    stages: the method's training stages, run in order (one joint stage by default). Each stage gets
        fresh optimizers over the parts it trains and its own SWA average, folded into the model at its end.
    validate(model) -> a score to maximise, called on the model to use after each epoch of the last stage.
    checkpoint_dir: where checkpoints go (every config.checkpoint_every_steps steps, every
        config.checkpoint_every_epochs epochs, on Ctrl-C and at the end); None: no checkpoints. Only rank 0
        of a distributed run writes them.
    dist: this process's place in a torchrun run (see xmcbench.distributed): each global batch is shared
        among the processes and the model wrapped in DistributedDataParallel; a single process by default.
    """

    def __init__(self, model: XMCModel, tokens: TokenizedTexts, labels: sp.csr_matrix, config: TrainConfig,
                 device: torch.device, validate: Callable[[nn.Module], float] | None = None,
                 checkpoint_dir=None, stages: tuple[Stage, ...] = JOINT_TRAINING,
                 dist: Distributed | None = None) -> None:
        self.model, self.tokens, self.labels, self.config, self.device = model, tokens, labels, config, device
        self.validate, self.checkpoint_dir, self.stages = validate, checkpoint_dir, stages
        self.dist = dist or Distributed()
        self.forward_model: nn.Module = model   # the model, or its DistributedDataParallel wrapper
        if model.is_flat and any("rank" in stage.losses and "recall" not in stage.losses for stage in stages):
            raise XmcError("this method trains a ranker in a stage of its own, which needs label clusters: "
                           "set cluster_size above 1 (e.g. --set cluster_size=8)")
        model.to(device)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.frozen: list[nn.Module] = []
        self.frozen_representations: dict[str, torch.Tensor] = {}   # see _configure
        self.scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda" and config.amp)
        self.swa_model = None   # the stage's running average, created at its first SWA update (a model copy)
        self.rng = np.random.default_rng(config.seed)
        self.epoch_rng_state: dict | None = None   # the data-order RNG as it was when this epoch began
        self.log = TrainingLog()
        self.best_score, self.best_state = -float("inf"), None
        self.stage_index, self.stage_started = 0, False
        self.epoch = self.batch_in_epoch = self.step = 0
        self.stop_requested = False
        self.unread_losses: list[tuple[dict, list[str], torch.Tensor]] = []   # see train_step
        self.epoch_loss = [0.0, 0]   # the current epoch's loss sum and steps, as read so far
        self.train_seconds = 0.0   # training time so far, across interruptions
        self.documents_trained = 0   # documents of all steps so far (over epochs and stages), across interruptions
        self._started = time.perf_counter()

    @property
    def stage(self) -> Stage:
        return self.stages[self.stage_index]

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sampler = self.model.sampler
        return {
            "position": {"stage": self.stage_index, "stage_started": self.stage_started, "epoch": self.epoch,
                         "batch_in_epoch": self.batch_in_epoch, "step": self.step,
                         "documents_trained": self.documents_trained,
                         "train_seconds": self.train_seconds + time.perf_counter() - self._started},
            "model": self.model.state_dict(),
            "sampler": sampler.training_state() if sampler is not None else {},
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "scaler": self.scaler.state_dict(),
            "swa": self.swa_model.state_dict() if self.swa_model is not None else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy_global": _numpy_global_state(), "data_order": self.epoch_rng_state,
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            "log": {"steps": self.log.steps, "validation": self.log.validation,
                    "selected_epoch": self.log.selected_epoch, "stopped_early": self.log.stopped_early,
                    "swa_updates": self.log.swa_updates},
            "best": {"score": self.best_score if self.best_state is not None else None, "state": self.best_state},
        }

    def load_state_dict(self, state: dict) -> None:
        position = state["position"]
        self.stage_index, self.stage_started = position["stage"], position["stage_started"]
        self.epoch, self.batch_in_epoch, self.step = position["epoch"], position["batch_in_epoch"], position["step"]
        self.train_seconds = position["train_seconds"]
        self.documents_trained = position.get("documents_trained", 0)   # absent from older checkpoints
        self.model.load_state_dict(state["model"])
        if self.model.sampler is not None:
            self.model.sampler.load_training_state(state["sampler"])
        if self.stage_started:
            self._configure(self.stage)
            for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
                optimizer.load_state_dict(optimizer_state)
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        if state["swa"] is not None:
            self.swa_model = torch.optim.swa_utils.AveragedModel(self.model)
            self.swa_model.load_state_dict(state["swa"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        name, keys, numpy_position, has_gauss, cached = rng["numpy_global"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), numpy_position, has_gauss, cached))
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.epoch_rng_state = rng["data_order"]
        self.log = TrainingLog(**state["log"])
        if state["best"]["state"] is not None:
            self.best_score, self.best_state = state["best"]["score"], state["best"]["state"]

    def save_checkpoint(self) -> None:
        self.read_losses()
        if self.checkpoint_dir is not None and self.dist.is_main:
            from xmcbench.checkpoint import save_checkpoint

            save_checkpoint(self.checkpoint_dir, self.state_dict(), self.step)

    # -- stages --------------------------------------------------------------------------------------
    def _configure(self, stage: Stage) -> None:
        """Freeze what the stage does not train and build optimizers over the rest. The representations of
        frozen encoders are computed once here (they run without dropout, so they do not change within the
        stage), unless they would not fit in FROZEN_REPRESENTATION_BYTES."""
        self.frozen = []
        for name, part in self.model.parts().items():
            part.requires_grad_(name in stage.trains)
            if name not in stage.trains:
                self.frozen.append(part)
        self.optimizers = build_optimizers(self.model, self.config)
        self.forward_model = self._wrap_distributed()
        self.frozen_representations = {}
        for name in ("encoder", "ranker_encoder"):
            encoder = self.model.parts().get(name)
            if encoder is not None and name not in stage.trains and \
                    len(self.tokens) * encoder.out_dim * 4 <= FROZEN_REPRESENTATION_BYTES:
                self.frozen_representations[name] = torch.from_numpy(self._map_documents(
                    lambda ids, mask, encoder=encoder: encoder(ids, mask), (encoder.out_dim,), np.float32, 0.0))
        self._train_mode()

    def _wrap_distributed(self) -> nn.Module:
        """DistributedDataParallel over the parameters this stage trains (wrapped anew per stage, since it
        registers only those). Sparse embeddings are left to average_sparse_gradient; buffers (the label
        clusters) never change, so they are not re-broadcast every step; a transformer's pooler is unused."""
        if not self.dist.enabled:
            return self.model
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self.model, list(sparse_parameters(self.model)))
        import inspect

        no_buffer_sync = ({"forward_sync_buffers": False}   # newer torch deprecates broadcast_buffers
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
        return DistributedDataParallel(self.model, device_ids=[self.device] if self.device.type == "cuda" else None,
                                       find_unused_parameters=True, **no_buffer_sync)

    def _train_mode(self) -> None:
        """Training mode, except frozen parts, which run without dropout."""
        self.model.train()
        for part in self.frozen:
            part.eval()

    def _begin_stage(self, stage: Stage) -> None:
        if stage.start == "copy-encoder-to-ranker-encoder":
            if self.model.ranker_encoder is None:
                raise XmcError(f"stage {stage.name!r} copies the encoder into the ranker's own encoder, but the "
                               "model has none: set separate_ranker_encoder=true")
            self.model.ranker_encoder.load_state_dict(self.model.encoder.state_dict())
        self._configure(stage)
        self.swa_model = None
        if self.model.sampler is not None:
            from xmcbench.interfaces import StageContext

            self.model.sampler.start_stage(StageContext(stage, len(self.tokens), self._recalled_clusters))
            self._train_mode()
        self.stage_started = True

    def prepare(self) -> None:
        """Begin the current stage unless it has begun (frozen parts, optimizers, sampler): what fit() does
        first; call it before timing single train_step calls."""
        if not self.stage_started:
            self._begin_stage(self.stage)

    def _end_stage(self) -> None:
        """Fold the stage's SWA average into the model, so the next stage (or the result) starts from it."""
        if self.swa_model is not None:
            self.model.load_state_dict(self.swa_model.module.state_dict())
            self.swa_model = None
        self.stage_index, self.stage_started, self.epoch, self.batch_in_epoch = self.stage_index + 1, False, 0, 0

    def _recalled_clusters(self, top: int) -> torch.Tensor:
        """(N, top) long: every training document's top clusters under the current encoder and recaller."""
        top = min(top, self.model.recaller.num_clusters)
        return torch.from_numpy(self._map_documents(
            lambda ids, mask: self.model.recaller(self.model.encoder(ids, mask)).float().topk(top, dim=1).indices,
            (top,), np.int64, 0))

    @torch.no_grad()
    def _map_documents(self, function, shape: tuple, dtype, fill) -> np.ndarray:
        """(N, *shape) array of function(input_ids, attention_mask) -> (B, *shape) over every training
        document, in eval mode and batches of similar length; in a distributed run each process computes a
        share of every length and all receive the whole."""
        self.model.eval()
        order = np.argsort(self.tokens.lengths, kind="stable")
        mine = order[self.dist.rank::self.dist.world_size]
        values = np.zeros((len(mine), *shape), dtype=dtype)
        for start in range(0, len(mine), self.config.eval_batch_size):
            rows = mine[start:start + self.config.eval_batch_size]
            with autocast(self.device, self.config):
                result = function(*to_device(self.device, *self.tokens.batch(rows)))
            values[start:start + len(rows)] = result.float().cpu().numpy() if dtype == np.float32 else \
                result.cpu().numpy()
        self._train_mode()
        return self.dist.gather_rows(mine, values, len(order), fill=fill)

    # -- the loop ------------------------------------------------------------------------------------
    def fit(self) -> tuple[nn.Module, TrainingLog]:
        """Train (or continue) through every stage; return the model to use (SWA-averaged where SWA ran,
        or the best epoch under `validate`) in eval mode, and the log. train_seconds then holds the
        training time of every session of this run."""
        self._started = time.perf_counter()
        with _stop_on_interrupt(self):
            while self.stage_index < len(self.stages):
                stage = self.stage
                self.prepare()
                while self.epoch < getattr(self.config, stage.epochs_key):
                    if self.converged():
                        self.log.stopped_early = self.epoch
                        break
                    self.run_epoch(stage)
                self._end_stage()
            self.save_checkpoint()
        self.train_seconds += time.perf_counter() - self._started
        final = self.model
        if self.best_state is not None:
            final.load_state_dict(self.best_state)
        final.eval()
        return final, self.log

    def converged(self) -> bool:
        """Early stopping: `patience` epochs of the last stage have passed without a better validation score.
        Read from the log, so a resumed run stops where an uninterrupted one would."""
        if not self.config.patience or self.log.selected_epoch is None or self.stage_index != len(self.stages) - 1:
            return False
        return self.epoch - self.log.selected_epoch >= self.config.patience

    def run_epoch(self, stage: Stage) -> None:
        config = self.config
        epochs = getattr(config, stage.epochs_key)
        if self.batch_in_epoch == 0:
            self.epoch_rng_state = copy.deepcopy(self.rng.bit_generator.state)
        else:   # continuing a checkpoint: replay this epoch's data order, then skip what was done
            self.rng.bit_generator.state = copy.deepcopy(self.epoch_rng_state)
        batches = epoch_batches(self.tokens.lengths, config.batch_size, self.rng, config.length_bucketing)
        done_before = self.batch_in_epoch
        self.epoch_loss = [sum(record["loss"] for record in self.log.steps[len(self.log.steps) - done_before:]),
                           done_before]
        label = f"{stage.name} " if len(self.stages) > 1 else ""
        with progress_bar(f"{label}epoch {self.epoch + 1}/{epochs}", total=len(self.tokens), unit="documents",
                          completed=sum(len(rows) for rows in batches[:done_before])) as advance:
            for rows in batches[done_before:]:
                self.train_step(rows, stage)
                advance(len(rows), step=f"{self.batch_in_epoch}/{len(batches)}", mean_loss=self.mean_epoch_loss)
                if config.checkpoint_every_steps and self.step % config.checkpoint_every_steps == 0:
                    self.save_checkpoint()
                if self.stop_requested:
                    self.save_checkpoint()
                    raise TrainingInterrupted(f"interrupted at step {self.step} ({label}epoch {self.epoch + 1}); "
                                              "a checkpoint was written")
        self.read_losses()
        last_stage = self.stage_index == len(self.stages) - 1
        if self.validate is not None and last_stage:
            candidate = self.model_to_use()
            score = self.validate(candidate)
            self._train_mode()
            self.log.validation.append({"epoch": self.epoch + 1, "score": score})
            if score > self.best_score:
                self.best_score, self.log.selected_epoch = score, self.epoch + 1
                self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in candidate.state_dict().items()}
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if config.checkpoint_every_epochs and self.epoch % config.checkpoint_every_epochs == 0 \
                and not (last_stage and self.epoch == epochs):
            self.save_checkpoint()

    def train_step(self, rows: np.ndarray, stage: Stage = JOINT_TRAINING[0]) -> None:
        """One optimizer step on the training documents `rows`. Its losses stay on the device until
        read_losses (every LOSS_READ_EVERY steps, at the end of an epoch and before a checkpoint): reading
        them every step would make the host wait for a GPU at every step."""
        config, device, model = self.config, self.device, self.model
        weigh, batch_documents = None, len(rows)
        if self.dist.enabled:
            shared = self.dist.shard(rows)
            # Every process must take part in every step; one left without documents (a last batch smaller
            # than the number of processes) runs a placeholder document whose loss weighs nothing.
            weigh = self._weigh_for_global_batch(has_documents=len(shared) > 0)
            rows = shared if len(shared) else rows[:1]
        input_ids, attention_mask = self.tokens.batch(rows)
        positives = padded_positives(self.labels, rows)
        index = torch.from_numpy(rows)
        frozen = dict(zip(self.frozen_representations, to_device(
            device, *(representations[index] for representations in self.frozen_representations.values()))))
        with autocast(device, config):
            loss, parts = self.forward_model(*to_device(device, input_ids, attention_mask, positives, index), stage,
                                             weigh=weigh, frozen_representations=frozen)
        reported = sum(parts.values()) if weigh is not None else loss.detach()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.dist.enabled:
            for parameter in sparse_parameters(model).values():
                if parameter.requires_grad:
                    self.dist.average_sparse_gradient(parameter)
        for optimizer in self.optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        self.step += 1
        self.batch_in_epoch += 1
        self.documents_trained += batch_documents
        record = {"step": self.step, "epoch": self.epoch + 1, **({"stage": stage.name} if len(self.stages) > 1 else {})}
        self.unread_losses.append((record, ["loss", *parts], torch.stack([reported, *parts.values()]).detach()))
        if len(self.unread_losses) >= LOSS_READ_EVERY:
            self.read_losses()
        if config.swa and self.epoch >= config.swa_start_epoch and self.step % config.swa_every_steps == 0:
            if self.swa_model is None:
                self.swa_model = torch.optim.swa_utils.AveragedModel(model)
            self.swa_model.update_parameters(model)
            self.log.swa_updates += 1

    def mean_epoch_loss(self) -> float | None:
        """The current epoch's mean training loss so far (reads the pending losses: for progress lines)."""
        self.read_losses()
        total, steps = self.epoch_loss
        return total / steps if steps else None

    def read_losses(self) -> None:
        """Move the losses of the steps since the last read into the log, in one transfer from the device;
        stop at the first non-finite one. Nothing is checkpointed before its losses are read, so the last
        checkpoint always precedes a divergence."""
        if not self.unread_losses:
            return
        values = torch.cat([stacked.float() for _, _, stacked in self.unread_losses]).cpu().tolist()
        position = 0
        for record, names, _ in self.unread_losses:
            record.update(zip(names, values[position:position + len(names)]))
            position += len(names)
            if not math.isfinite(record["loss"]):
                self.unread_losses = []
                kept = f"; the last good checkpoint is in {self.checkpoint_dir}" if self.checkpoint_dir else ""
                raise XmcError(f"training diverged: the loss is {record['loss']} at step {record['step']} "
                               f"(epoch {record['epoch']}){kept}; lower lr or disable amp (--set amp=false)")
            self.log.steps.append(record)
            if record["epoch"] == self.epoch + 1:
                self.epoch_loss = [self.epoch_loss[0] + record["loss"], self.epoch_loss[1] + 1]
        self.unread_losses = []

    def _weigh_for_global_batch(self, has_documents: bool):
        """The `weigh` of XMCModel.training_loss for a distributed step: one all-reduce of every process's
        (loss sum, term count) per part, plus the stop flag. Process r's part weighs
        world_size * count_r / global_count, so DistributedDataParallel's gradient average equals the gradient
        of the global batch's mean; the reported values are the global means, identical on every process."""
        def weigh(parts: dict) -> dict:
            names = sorted(parts)
            counts = {name: float(parts[name][1]) * has_documents for name in names}
            local = [[float(parts[name][0]) * counts[name], counts[name]] for name in names]
            totals = self.dist.all_reduce_sum(torch.tensor(local + [[float(self.stop_requested), 0.0]],
                                                           dtype=torch.float64))
            self.stop_requested = bool(totals[-1, 0] > 0)   # every process stops after the same step
            return {name: (self.dist.world_size * counts[name] / float(totals[i, 1]),
                           (totals[i, 0] / totals[i, 1]).float())
                    for i, name in enumerate(names)}
        return weigh

    def model_to_use(self) -> XMCModel:
        return self.swa_model.module if self.swa_model is not None else self.model


def _numpy_global_state() -> list:
    name, keys, position, has_gauss, cached = np.random.get_state()
    return [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached]


@contextlib.contextmanager
def _stop_on_interrupt(trainer: Trainer):
    """The first Ctrl-C asks the trainer to stop after its current step (and checkpoint); a second one
    interrupts at once."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum, frame):
        trainer.stop_requested = True
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- prediction -------------------------------------------------------------------------------------

@dataclass
class Predictions:
    labels: np.ndarray            # (N, k) int64, best first, -1 for empty slots
    scores: np.ndarray            # (N, k) float32
    recalled: np.ndarray | None   # (N, b) int64 recalled cluster ids, None when flat


@torch.no_grad()
def predict(model: XMCModel, tokens: TokenizedTexts, config: TrainConfig, device: torch.device,
            description: str = "predicting", dist: Distributed | None = None) -> Predictions:
    """Top-k labels of every document. Documents are batched by length so padding stays minimal. In a
    distributed run each process predicts every world_size-th document of the length order and every
    process receives the full result."""
    dist = dist or Distributed()
    was_training = model.training
    model.eval()
    model.to(device)
    order = np.argsort(tokens.lengths, kind="stable")
    mine = order[dist.rank::dist.world_size]
    labels = np.full((len(mine), config.top_k), -1, dtype=np.int64)
    scores = np.full((len(mine), config.top_k), -1.0, dtype=np.float32)
    recalled = None if model.is_flat else np.zeros((len(mine), min(config.top_clusters, model.recaller.num_clusters)),
                                                   dtype=np.int64)
    with progress_bar(description, total=len(mine), unit="documents") as advance:
        for start in range(0, len(mine), config.eval_batch_size):
            rows = mine[start:start + config.eval_batch_size]
            where = slice(start, start + len(rows))
            input_ids, attention_mask = tokens.batch(rows)
            with autocast(device, config):
                (top_labels, top_scores), top_clusters = model.predict_top(
                    input_ids.to(device), attention_mask.to(device), config.top_clusters, config.top_k)
            labels[where] = top_labels.cpu().numpy()
            scores[where] = top_scores.float().cpu().numpy()
            if top_clusters is not None:
                recalled[where] = top_clusters.cpu().numpy()
            advance(len(rows))
    model.train(was_training)
    return Predictions(dist.gather_rows(mine, labels, len(tokens), fill=-1),
                       dist.gather_rows(mine, scores, len(tokens), fill=-1.0),
                       None if recalled is None else dist.gather_rows(mine, recalled, len(tokens), fill=0))


def recalled_truth(truth: sp.csr_matrix, recalled: np.ndarray, label_cluster: np.ndarray) -> sp.csr_matrix:
    """The true labels (N, L_total) whose cluster is among each document's recalled clusters (N, b);
    labels unseen in training (ids >= len(label_cluster)) are never recalled."""
    truth = truth.tocoo()
    known = truth.col < len(label_cluster)
    hit = np.zeros(truth.nnz, dtype=bool)
    cluster = label_cluster[truth.col[known]]
    hit[known] = (recalled[truth.row[known]] == cluster[:, None]).any(axis=1)
    return sp.csr_matrix((np.ones(hit.sum(), dtype=np.float32), (truth.row[hit], truth.col[hit])), shape=truth.shape)
