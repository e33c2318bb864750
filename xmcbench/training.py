"""The training loop: stages of epochs of optimizer steps, announced to callbacks (xmcbench.callbacks).

The loop owns only what every run needs: the data order, the step (forward, backward, optimizers, mixed
precision, distributed gradient sharing), reading losses off the device, stages (frozen parts, optimizers,
the sampler's start), checkpoints at the end and on Ctrl-C, and the state that lets a stopped run continue
exactly. Weight averaging, model selection with early stopping and checkpoint cadence are callbacks built
from the run's settings; loggers are callbacks the run adds (xmcbench.runs.component).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from xmcbench.batching import epoch_batches, padded_positives
from xmcbench.callbacks import EVENTS, CheckpointCadence, ModelSelection, StochasticWeightAveraging, \
    TrainingCallback
from xmcbench.config import JOINT_TRAINING, Stage, TrainConfig
from xmcbench.device import autocast, to_device
from xmcbench.distributed import Distributed
from xmcbench.errors import TrainingInterrupted, XmcError   # TrainingInterrupted: raised here
from xmcbench.inference import Output, map_documents
from xmcbench.interfaces import EpochContext, LabelInfo, StageContext, overrides
from xmcbench.model import XMCModel
from xmcbench.optim import build_optimizers, sparse_parameters
from xmcbench.progress import progress_bar
from xmcbench.tokenization import TokenizedTexts


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


class Trainer:
    """Trains `model` through `stages` and can continue exactly after a stop: its state_dict holds the stage
    and position in the data order, model, optimizers, scaler, sampler state, RNG states, log and every
    callback's state.

    labels: (N, L) 0/1 csr of the training documents, rows aligned with `tokens`.
    stages: the method's training stages, run in order (one joint stage by default). Each stage gets
        fresh optimizers over the parts it trains.
    validate(model) -> a score to maximise; with it, ModelSelection scores each epoch of the last stage and
        the run ends with the best epoch's weights.
    checkpoint_dir: where checkpoints go (at the cadence of CheckpointCadence, on Ctrl-C and at the end);
        None: no checkpoints. Only rank 0 of a distributed run writes them.
    dist: this process's place in a torchrun run (see xmcbench.distributed): each global batch is shared
        among the processes and the model wrapped in DistributedDataParallel; a single process by default.
    callbacks: more callbacks (loggers), after the built-in ones (weight averaging, model selection,
        checkpoint cadence), which the settings switch on.
    label_info: the run's LabelInfo, which lifecycle events hand to the components (xmcbench.interfaces).
    label_tokens: () -> TokenizedTexts of the label texts (the names of labels without one), for components that
        ask for label embeddings (called at most once, when first needed).
    validation: (TokenizedTexts, (V, L) 0/1 csr) of the validation documents, which lifecycle events offer the
        components (EpochContext.validation_embeddings, validation_labels); None without a validation split.
    """

    def __init__(self, model: XMCModel, tokens: TokenizedTexts, labels: sp.csr_matrix, config: TrainConfig,
                 device: torch.device, validate: Callable[[nn.Module], float] | None = None,
                 checkpoint_dir=None, stages: tuple[Stage, ...] = JOINT_TRAINING,
                 dist: Distributed | None = None, callbacks: tuple[TrainingCallback, ...] = (),
                 label_info: LabelInfo | None = None,
                 label_tokens: Callable[[], TokenizedTexts] | None = None,
                 validation: tuple[TokenizedTexts, sp.csr_matrix] | None = None) -> None:
        self.model, self.tokens, self.labels, self.config, self.device = model, tokens, labels, config, device
        self.validation = validation
        self.label_info, self._label_tokens_of, self._label_tokens = label_info, label_tokens, None
        self.checkpoint_dir, self.stages = checkpoint_dir, stages
        self.dist = dist or Distributed()
        self.forward_model: nn.Module = model   # the model, or its DistributedDataParallel wrapper
        if model.is_flat and any("rank" in stage.losses and "recall" not in stage.losses for stage in stages):
            raise XmcError("this method trains a ranker in a stage of its own, which needs label clusters: "
                           "set cluster_size above 1 (e.g. --set cluster_size=8)")
        model.to(device)
        averaging = StochasticWeightAveraging(model, config) if config.swa else None
        built_in = [averaging, ModelSelection(self._validate_prepared(validate), config, averaging)
                    if validate is not None else None,
                    CheckpointCadence(config) if checkpoint_dir is not None else None]
        self.callbacks = [callback for callback in built_in if callback is not None] + list(callbacks)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.frozen: list[nn.Module] = []
        self.frozen_representations: dict[str, torch.Tensor] = {}   # see _configure
        self.scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda" and config.amp)
        self.rng = np.random.default_rng(config.seed)
        self.epoch_rng_state: dict | None = None   # the data-order RNG as it was when this epoch began
        self.log = TrainingLog()
        self.stage_index, self.stage_started = 0, False
        self.epoch = self.batch_in_epoch = self.step = 0
        self.stop_requested = False   # Ctrl-C: checkpoint and stop after this step
        self.stop_stage = False       # a callback ends the stage before its next epoch (early stopping)
        self.unread_losses: list[tuple[dict, list[str], torch.Tensor]] = []   # see train_step
        self.epoch_loss = [0.0, 0]   # the current epoch's loss sum and steps, as read so far
        self.train_seconds = 0.0   # training time so far, across interruptions
        self.documents_trained = 0   # documents of all steps so far (over epochs and stages), across interruptions
        self._started = time.perf_counter()

    @property
    def stage(self) -> Stage:
        return self.stages[self.stage_index]

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == len(self.stages) - 1

    def position(self) -> str:
        """Where training stands, for a person: "epoch 2 of 3", with the stage where there are several, or "after
        its last epoch" once every stage has ended (a checkpoint saved then resumes straight to prediction)."""
        if self.stage_index >= len(self.stages):
            return "after its last epoch"
        stage = f"stage {self.stage.name}, " if len(self.stages) > 1 else ""
        return f"{stage}epoch {self.epoch + 1} of {self.stage.epochs(self.config)}"

    def emit(self, event: str, *args) -> None:
        """Call `event` (one of xmcbench.callbacks.EVENTS) on every callback, in order."""
        assert event in EVENTS, event
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)

    # -- the loop ------------------------------------------------------------------------------------
    def fit(self) -> tuple[nn.Module, TrainingLog]:
        """Train (or continue) through every stage; return the model to use (what the callbacks leave: the
        SWA average, the best epoch's weights) in eval mode, and the log. train_seconds then holds the
        training time of every session of this run."""
        self._started = time.perf_counter()
        self.emit("on_train_begin")
        with _stop_on_interrupt(self):
            while self.stage_index < len(self.stages):
                stage = self.stage
                self.prepare()
                while self.epoch < stage.epochs(self.config):
                    self.stop_stage = False
                    self.emit("on_epoch_begin")
                    if self.stop_stage:
                        break
                    if self.batch_in_epoch == 0:   # a run resumed inside the epoch has its components' state
                        self.announce("start_epoch", stage, self.epoch)
                    self.run_epoch(stage)
                self._end_stage()
            self.save_checkpoint()
        self.train_seconds += time.perf_counter() - self._started
        self.emit("on_train_end")
        self.model.eval()
        return self.model, self.log

    def run_epoch(self, stage: Stage) -> None:
        if self.batch_in_epoch == 0:
            self.epoch_rng_state = copy.deepcopy(self.rng.bit_generator.state)
        else:   # continuing a checkpoint: replay this epoch's data order, then skip what was done
            self.rng.bit_generator.state = copy.deepcopy(self.epoch_rng_state)
        batches = epoch_batches(self.tokens.lengths, self.config.batch_size, self.rng, self.config.length_bucketing)
        done_before = self.batch_in_epoch
        self.epoch_loss = [sum(record["loss"] for record in self.log.steps[len(self.log.steps) - done_before:]),
                           done_before]
        label = f"{stage.name} " if len(self.stages) > 1 else ""
        with progress_bar(f"{label}epoch {self.epoch + 1}/{stage.epochs(self.config)}", total=len(self.tokens),
                          unit="documents", completed=sum(len(rows) for rows in batches[:done_before])) as advance:
            for rows in batches[done_before:]:
                self.train_step(rows, stage)
                advance(len(rows), step=f"{self.batch_in_epoch}/{len(batches)}", mean_loss=self.mean_epoch_loss)
                if self.stop_requested:
                    self.save_checkpoint()
                    raise TrainingInterrupted(f"interrupted at step {self.step} ({label}epoch {self.epoch + 1}); "
                                              "a checkpoint was written")
        self.read_losses()
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.emit("on_epoch_end")
        self._train_mode()   # a callback may have run inference (validation), which leaves every part training

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
        self.emit("on_step_end")

    # -- stages --------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Begin the current stage unless it has begun (frozen parts, optimizers, sampler): what fit() does
        first; call it before timing single train_step calls."""
        if not self.stage_started:
            self._begin_stage(self.stage)

    def _begin_stage(self, stage: Stage) -> None:
        stage.begin(self.model)
        self._configure(stage)
        for _, component, depth in self.model.components():
            if overrides(component, "start_stage"):
                component.start_stage(StageContext(stage, len(self.tokens),
                                                   lambda top, depth=depth: self._recalled_clusters(top, depth)))
                self._train_mode()
        self.stage_started = True
        self.emit("on_stage_begin", stage)

    def finalize(self) -> None:
        """Announce the end of training to the components (LifecycleEvents.finalize), with the final weights in
        place: what fit() returns is then ready to predict and to be saved. Leaves the model in eval mode."""
        started = time.perf_counter()
        self.announce("finalize", self.stages[-1], None, final=True)
        self.model.eval()
        self.train_seconds += time.perf_counter() - started   # building an index is part of training

    def _validate_prepared(self, validate: Callable[[nn.Module], float]) -> Callable[[nn.Module], float]:
        """`validate`, after the model to score (the SWA average or the model itself) has heard `finalize`: a
        component that builds what prediction reads (a label index) builds it from the weights being scored."""
        def prepared(candidate: nn.Module) -> float:
            self.announce("finalize", self.stage, None, candidate)
            return validate(candidate)
        return prepared

    def announce(self, event: str, stage: Stage, epoch: int | None, model: XMCModel | None = None, *,
                 final: bool = False) -> None:
        """Call lifecycle event `event` ("start_epoch" or "finalize") on every component of `model` (default: the
        model being trained) that implements it, with one EpochContext whose embeddings are computed at most once
        for all of them, by that model (final: EpochContext.final)."""
        model = model if model is not None else self.model
        takers = [(component, depth) for _, component, depth in model.components() if overrides(component, event)]
        if not takers:
            return
        # the progress lines name the moment the user sees, not the hook: finalize runs before each validation too
        moment = (f"epoch {epoch + 1}" if event == "start_epoch" and epoch is not None
                  else "the final model" if final else "the model being validated")
        shared = EpochContext(stage, epoch, len(self.tokens), self.label_info,
                              map_documents=lambda function, dim: torch.from_numpy(self._map_documents(
                                  model, self.tokens, function, Output((dim,), np.float32, 0.0),
                                  f"encoding the training documents for {moment}")),
                              map_labels=lambda function, dim: self._map_labels(model, function, dim,
                                                                                f"encoding the label texts for {moment}"),
                              recalled_clusters=self._recalled_clusters, encoder=model.encoder, final=final,
                              ranker=model.ranker, training_labels=self.labels[:, :model.clusters.num_labels])
        if self.validation is not None:
            tokens, labels = self.validation
            shared.validation_labels = labels[:, :model.clusters.num_labels]
            shared.map_validation = lambda function, dim: torch.from_numpy(self._map_documents(
                model, tokens, function, Output((dim,), np.float32, 0.0),
                f"encoding the validation documents for {moment}"))
        for component, depth in takers:
            context = copy.copy(shared)   # the computed embeddings stay shared (EpochContext.cache)
            context.recalled_clusters = lambda top, depth=depth: self._recalled_clusters(top, depth, model)
            getattr(component, event)(context)
            self._train_mode()

    def _map_labels(self, model: XMCModel, function: Callable, dim: int, description: str) -> torch.Tensor:
        """function(ids, mask) -> (B, dim) over every label's text -> (L, dim) float32 (eval mode, no gradients)."""
        if self._label_tokens is None:
            if self._label_tokens_of is None:
                raise XmcError("a component of this method embeds the labels' texts, which this trainer was not given "
                               "(Trainer(..., label_tokens=...))")
            self._label_tokens = self._label_tokens_of()
        return torch.from_numpy(self._map_documents(model, self._label_tokens, function,
                                                    Output((dim,), np.float32, 0.0), description))

    def _end_stage(self) -> None:
        self.emit("on_stage_end", self.stage)
        self.stage_index, self.stage_started, self.epoch, self.batch_in_epoch = self.stage_index + 1, False, 0, 0

    def _configure(self, stage: Stage) -> None:
        """Freeze what the stage does not train and build optimizers over the rest. The representations of
        frozen encoders are computed once here (they run without dropout, so they do not change within the
        stage), unless they would not fit in FROZEN_REPRESENTATION_BYTES."""
        self.frozen = []
        for name, parameters in self.model.part_parameters().items():
            for parameter in parameters:   # a shared encoder's parameters follow the encoder's part
                parameter.requires_grad_(name in stage.trains)
            if name not in stage.trains:
                self.frozen.append(self.model.parts()[name])
        self.optimizers = build_optimizers(self.model, self.config)
        self.forward_model = self._wrap_distributed()
        self.frozen_representations = {}
        for name in ("encoder", "ranker_encoder"):
            encoder = self.model.parts().get(name)
            if encoder is not None and name not in stage.trains and \
                    len(self.tokens) * encoder.out_dim * 4 <= FROZEN_REPRESENTATION_BYTES:
                self.frozen_representations[name] = torch.from_numpy(self._map_documents(
                    self.model, self.tokens, encoder, Output((encoder.out_dim,), np.float32, 0.0),
                    f"encoding the training documents once for the frozen {name}"))
        self._train_mode()

    def _recalled_clusters(self, top: int, depth: int = 0, model: XMCModel | None = None) -> torch.Tensor:
        """(N, top) long: every training document's top nodes of scoring level `depth` (0: the recaller's)
        under `model` (default: the model being trained)."""
        model = model if model is not None else self.model
        top = min(top, model.nodes_at(depth))
        return torch.from_numpy(self._map_documents(model, self.tokens, lambda ids, mask: model.top_nodes(
            ids, mask, depth, top), Output((top,), np.int64, 0), "recalling the training documents' clusters"))

    def _map_documents(self, model: XMCModel, tokens: TokenizedTexts, function: Callable, output: Output,
                       description: str) -> np.ndarray:
        """function(ids, mask) -> (B, *shape) over `tokens` in eval mode -> (N, *shape), the training mode of the
        model being trained restored (inference.map_documents). description: its progress line's text (a pass
        over 20,000 documents takes minutes on a CPU, between the epochs' own lines)."""
        (values,) = map_documents(model, tokens, lambda ids, mask: (function(ids, mask),), (output,), self.config,
                                  self.device, self.dist, description)
        self._train_mode()
        return values

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

    # -- losses --------------------------------------------------------------------------------------
    def mean_epoch_loss(self) -> float | None:
        """The current epoch's mean training loss so far (reads the pending losses: for progress lines)."""
        self.read_losses()
        total, steps = self.epoch_loss
        return total / steps if steps else None

    def read_losses(self) -> None:
        """Move the losses of the steps since the last read into the log, in one transfer from the device,
        and hand them to the callbacks (on_log); stop at the first non-finite one. Nothing is checkpointed
        before its losses are read, so the last checkpoint always precedes a divergence."""
        if not self.unread_losses:
            return
        values = torch.cat([stacked.float() for _, _, stacked in self.unread_losses]).cpu().tolist()
        position, read = 0, []
        for record, names, _ in self.unread_losses:
            record.update(zip(names, values[position:position + len(names)]))
            position += len(names)
            if not math.isfinite(record["loss"]):
                self.unread_losses = []
                kept = f"; the last good checkpoint is in {self.checkpoint_dir}" if self.checkpoint_dir else ""
                raise XmcError(f"training diverged: the loss is {record['loss']} at step {record['step']} "
                               f"(epoch {record['epoch']}){kept}; lower lr or disable amp (--set amp=false)")
            self.log.steps.append(record)
            read.append(record)
            if record["epoch"] == self.epoch + 1:
                self.epoch_loss = [self.epoch_loss[0] + record["loss"], self.epoch_loss[1] + 1]
        self.unread_losses = []
        self.emit("on_log", read)

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

    # -- state ---------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        self.read_losses()
        if self.checkpoint_dir is not None and self.dist.is_main:
            from xmcbench.checkpoint import save_checkpoint

            save_checkpoint(self.checkpoint_dir, self.state_dict(), self.step)

    def state_dict(self) -> dict:
        sampler = self.model.sampler
        return {
            "position": {"stage": self.stage_index, "stage_started": self.stage_started, "epoch": self.epoch,
                         "batch_in_epoch": self.batch_in_epoch, "step": self.step,
                         "documents_trained": self.documents_trained,
                         "train_seconds": self.train_seconds + time.perf_counter() - self._started},
            "model": self.model.state_dict(),
            "sampler": sampler.training_state() if sampler is not None else {},
            "level_samplers": [level.sampler.training_state() for level in self.model.tree_levels],
            # the recaller's and the rankers' (the samplers' are above, as checkpoints have always held them)
            "component_states": {name: component.training_state() for name, component, _ in self.model.components()
                                 if not name.endswith("sampler") and overrides(component, "training_state")},
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "scaler": self.scaler.state_dict(),
            "callbacks": {type(callback).__qualname__: callback.state_dict() for callback in self.callbacks},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy_global": _numpy_global_state(), "data_order": self.epoch_rng_state,
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            "log": {"steps": self.log.steps, "validation": self.log.validation,
                    "selected_epoch": self.log.selected_epoch, "stopped_early": self.log.stopped_early,
                    "swa_updates": self.log.swa_updates},
        }

    def load_state_dict(self, state: dict) -> None:
        position = state["position"]
        self.stage_index, self.stage_started = position["stage"], position["stage_started"]
        self.epoch, self.batch_in_epoch, self.step = position["epoch"], position["batch_in_epoch"], position["step"]
        self.train_seconds = position["train_seconds"]
        self.documents_trained = position["documents_trained"]
        self.model.load_state_dict(state["model"])
        if self.model.sampler is not None:
            self.model.sampler.load_training_state(state["sampler"])
        for level, sampler_state in zip(self.model.tree_levels, state["level_samplers"]):
            level.sampler.load_training_state(sampler_state)
        saved_states = state.get("component_states", {})   # absent in checkpoints written before it existed
        for name, component, _ in self.model.components():
            if name in saved_states:
                component.load_training_state(saved_states[name])
        if self.stage_started:
            self._configure(self.stage)
            for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
                optimizer.load_state_dict(optimizer_state)
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        for callback in self.callbacks:
            saved = state["callbacks"].get(type(callback).__qualname__)
            if saved is not None:
                callback.load_state_dict(saved)
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        name, keys, numpy_position, has_gauss, cached = rng["numpy_global"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), numpy_position, has_gauss, cached))
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.epoch_rng_state = rng["data_order"]
        self.log = TrainingLog(**state["log"])


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
        # the current step may be minutes away (the encoder pass that starts PIFA rows): say the stop was heard
        print("\nCtrl-C: stopping after the current training step, with a checkpoint (Ctrl-C again stops at once, "
              "without one)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
