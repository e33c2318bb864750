"""Training events, and the callbacks that act on them.

The trainer (`xmcbench.training.Trainer`) runs stages of epochs of steps and announces each event to its
callbacks in order. What happens around the steps is a callback: stochastic weight averaging, model
selection with early stopping, checkpoint cadence (the built-in ones, at the end of this module, which the
run's settings switch on), the run directory's training_log.json (JsonLog, every run), and the loggers a user enables with
`--set loggers=tensorboard,mlflow` (registered by plugins through the `xmcbench_register_loggers` hook).

A callback reads the trainer it is given; these attributes are the public ones:
    trainer.model      the XMCModel being trained (an nn.Module)
    trainer.config     the run's xmcbench.config.TrainConfig
    trainer.stages     the run's stages (xmcbench.config.Stage); trainer.stage is the current one
    trainer.epoch      epochs of the current stage completed (0-based index of the running epoch)
    trainer.step       optimizer steps taken so far, over all stages
    trainer.documents_trained   training documents of all steps so far
    trainer.log        the TrainingLog: steps (one dict per step: step, epoch, [stage,] loss and one entry
                       per loss part), validation ({epoch, score} per epoch), selected_epoch, stopped_early
A logger only reads; it must not change the model, the data order or any random state, so a run with and
without it gives the same weights (`xmcbench.testing.check_logger` checks this).

Events, in the order a run meets them:
    on_train_begin                once per training session (again after --resume)
    on_stage_begin(stage)         a stage starts (not again when a run resumes inside it)
    on_epoch_begin                before each epoch (also one resumed half-way)
    on_step_end                   after each optimizer step; losses may still be on the device
    on_log(records)               per-step records whose losses were just read from the device (every few
                                  dozen steps, at an epoch's end and before a checkpoint), in step order
    on_evaluate(record)           the epoch just trained was scored on the validation rows: {"epoch", "score",
                                  "metric"} (model selection does it as the epoch ends, so a logger gets it
                                  just before its own on_epoch_end)
    on_epoch_end                  after an epoch; trainer.epoch now counts it
    on_stage_end(stage)           a stage ended
    on_train_end                  training ended (after the last checkpoint)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from xmcbench.config import Stage, TrainConfig


class TrainingCallback:
    """Base class: every event does nothing. Subclass it and override the events you need.

    A callback whose behaviour depends on what it saw before (an average, a best score) returns that in
    state_dict(), which goes into every checkpoint, and receives it in load_state_dict() when a run resumes;
    the state must be torch.save-able (tensors, numbers, strings, lists, dicts).
    """

    def on_train_begin(self, trainer) -> None: ...

    def on_stage_begin(self, trainer, stage: "Stage") -> None: ...

    def on_epoch_begin(self, trainer) -> None: ...

    def on_step_end(self, trainer) -> None: ...

    def on_log(self, trainer, records: list[dict]) -> None: ...

    def on_evaluate(self, trainer, record: dict) -> None: ...

    def on_epoch_end(self, trainer) -> None: ...

    def on_stage_end(self, trainer, stage: "Stage") -> None: ...

    def on_train_end(self, trainer) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# A logger plugin registers a factory: factory(run_dir, config) -> TrainingCallback. run_dir is the run
# directory (it exists; write files under it), config the run's TrainConfig. Only the main process of a
# distributed run builds loggers.
LoggerFactory = Callable[[Path, "TrainConfig"], TrainingCallback]

EVENTS = ("on_train_begin", "on_stage_begin", "on_epoch_begin", "on_step_end", "on_log", "on_evaluate",
          "on_epoch_end", "on_stage_end", "on_train_end")


# -- the built-in callbacks: what a run does around its steps, switched on by its settings ----------------

class StochasticWeightAveraging(TrainingCallback):
    """SWA (Izmailov et al., 2018): from epoch config.swa_start_epoch of each stage, every
    config.swa_every_steps steps the weights join a running average; the average is what model selection
    scores, and it replaces the model's weights when the stage ends, so the next stage (or the result) starts
    from it."""

    def __init__(self, model, config: "TrainConfig") -> None:
        self.model, self.start_epoch, self.every_steps = model, config.swa_start_epoch, config.swa_every_steps
        self.average = None   # torch.optim.swa_utils.AveragedModel, created at the stage's first update

    def averaged_model(self):
        """The stage's averaged model, or None before its first update."""
        return None if self.average is None else self.average.module

    def on_stage_begin(self, trainer, stage) -> None:
        self.average = None

    def on_step_end(self, trainer) -> None:
        if trainer.epoch >= self.start_epoch and trainer.step % self.every_steps == 0:
            if self.average is None:
                import torch

                self.average = torch.optim.swa_utils.AveragedModel(self.model)
            self.average.update_parameters(self.model)
            trainer.log.swa_updates += 1

    def on_stage_end(self, trainer, stage) -> None:
        if self.average is not None:
            self.model.load_state_dict(self.average.module.state_dict())
            self.average = None

    def state_dict(self) -> dict[str, Any]:
        return {"average": None if self.average is None else self.average.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["average"] is not None:
            import torch

            self.average = torch.optim.swa_utils.AveragedModel(self.model)
            self.average.load_state_dict(state["average"])


class ModelSelection(TrainingCallback):
    """After each epoch of the last stage, scores the model to use (the SWA average where averaging runs) with
    `validate`; the best epoch's weights are kept and the run ends with them. With config.patience, the stage
    stops once that many epochs have passed without a better score (decided from the log, so a resumed run
    stops where an uninterrupted one would)."""

    def __init__(self, validate: Callable, config: "TrainConfig",
                 averaging: StochasticWeightAveraging | None = None) -> None:
        self.validate, self.metric, self.patience, self.averaging = \
            validate, config.selection_metric, config.patience, averaging
        self.best_score, self.best_state = -float("inf"), None

    def on_epoch_begin(self, trainer) -> None:
        log = trainer.log
        if self.patience and log.selected_epoch is not None and trainer.is_last_stage and \
                trainer.epoch - log.selected_epoch >= self.patience:
            log.stopped_early = trainer.epoch
            trainer.stop_stage = True

    def on_epoch_end(self, trainer) -> None:
        if not trainer.is_last_stage:
            return
        candidate = (self.averaging.averaged_model() if self.averaging is not None else None) or trainer.model
        record = {"epoch": trainer.epoch, "score": self.validate(candidate)}
        trainer.log.validation.append(record)
        if record["score"] > self.best_score:
            self.best_score, trainer.log.selected_epoch = record["score"], trainer.epoch
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in candidate.state_dict().items()}
        trainer.emit("on_evaluate", {**record, "metric": self.metric})

    def on_train_end(self, trainer) -> None:
        if self.best_state is not None:
            trainer.model.load_state_dict(self.best_state)

    def state_dict(self) -> dict[str, Any]:
        return {"score": self.best_score if self.best_state is not None else None, "state": self.best_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["state"] is not None:
            self.best_score, self.best_state = state["score"], state["state"]


class ValidationLog(TrainingCallback):
    """Writes each validation's score to the run's log, e.g. `validation after epoch 2 of 4: P@5 27.70 (best so
    far)`; `log` takes one line."""

    def __init__(self, log: Callable[[str], Any], config: "TrainConfig") -> None:
        self.log, self.config = log, config

    def on_evaluate(self, trainer, record: dict) -> None:
        best = " (best so far)" if trainer.log.selected_epoch == record["epoch"] else ""
        self.log(f"validation after epoch {record['epoch']} of {trainer.stage.epochs(self.config)}: "
                 f"{record['metric']} {record['score']:.2f}{best}")


def still_improving(log, epochs: int) -> bool:
    """Whether a run's validation score was best at its last epoch, with no early stop: the epoch budget, not
    convergence, ended it. log: the Trainer's TrainingLog."""
    return bool(log.validation) and log.stopped_early is None and log.selected_epoch == epochs


class CheckpointCadence(TrainingCallback):
    """A checkpoint every config.checkpoint_every_steps steps and every config.checkpoint_every_epochs epochs
    (0: never), except after the last epoch, which the end of training checkpoints anyway."""

    def __init__(self, config: "TrainConfig") -> None:
        self.config = config

    def on_step_end(self, trainer) -> None:
        every = self.config.checkpoint_every_steps
        if every and trainer.step % every == 0:
            trainer.save_checkpoint()

    def on_epoch_end(self, trainer) -> None:
        every = self.config.checkpoint_every_epochs
        finished = trainer.is_last_stage and trainer.epoch == trainer.stage.epochs(self.config)
        if every and trainer.epoch % every == 0 and not finished:
            trainer.save_checkpoint()


class JsonLog(TrainingCallback):
    """The run directory's `training_log.json` (every step's losses, the validation scores, the selected
    epoch, early stopping, SWA updates) and `loss.png`, written when training ends: every run has them, and
    reports read them. A resumed run's log holds the steps of every session, so the file is complete."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def on_train_end(self, trainer) -> None:
        write_training_log(self.run_dir, trainer.log)


def write_training_log(run_dir: Path, log) -> None:
    """training_log.json, and loss.png drawn by the report's own loss figure for this run's loss parts."""
    from xmcbench.report import plot_run_loss   # matplotlib: imported only when a log is written
    from xmcbench.storage import write_json

    write_json(run_dir / "training_log.json", {"steps": log.steps, "validation": log.validation,
                                               "selected_epoch": log.selected_epoch,
                                               "stopped_early": log.stopped_early, "swa_updates": log.swa_updates})
    plot_run_loss(log.steps, run_dir / "loss.png")
