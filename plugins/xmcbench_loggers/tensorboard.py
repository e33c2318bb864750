"""The "tensorboard" logger (`--set loggers=tensorboard`): scalars in `RUN_DIR/tensorboard/`, for
`tensorboard --logdir RUN_DIR/tensorboard` (or a folder of runs).

    train/loss, train/<part>     every step's total loss and each loss part (recall, rank), at the step
    validation/<metric>          the validation score of each epoch (e.g. validation/P@5), at the step reached

A resumed run (`--resume`) appends to the same folder; steps logged after its last checkpoint by the
interrupted session are hidden (SummaryWriter's purge_step), so each step appears once. The folder is
xmcbench.rundir.run_path's: a `tensorboard` that is a symbolic link (to somewhere outside the run) is refused.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from xmcbench.callbacks import TrainingCallback
from xmcbench.errors import XmcError
from xmcbench.rundir import run_path

NAME = "tensorboard"
DESCRIPTION = "TensorBoard scalars (train/loss, train/<part>, validation/<metric>) in RUN_DIR/tensorboard"
EXTRA = "tensorboard"
FOLDER = "tensorboard"
NOT_LOGGED = ("step", "epoch", "stage")   # a record's keys that are not losses


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class TensorBoardLogger(TrainingCallback):
    def __init__(self, folder: Path, summary_writer: type) -> None:
        self.folder = folder
        self._summary_writer = summary_writer
        self.writer = None

    def _open(self, step: int) -> None:
        if self.writer is None:
            # purge_step: a resumed session hides what the interrupted one logged after the checkpoint
            self.writer = self._summary_writer(str(self.folder), purge_step=step + 1 if step > 0 else None)

    def on_train_begin(self, trainer) -> None:
        self._open(int(trainer.step))

    def on_log(self, trainer, records: list[dict]) -> None:
        self._open(int(trainer.step))
        for record in records:
            step = int(record["step"])
            for key, value in record.items():
                if key not in NOT_LOGGED and _is_number(value):
                    self.writer.add_scalar(f"train/{key}", float(value), global_step=step)

    def on_evaluate(self, trainer, record: dict) -> None:
        self._open(int(trainer.step))
        metric = record.get("metric") or "score"
        self.writer.add_scalar(f"validation/{metric}", float(record["score"]), global_step=int(trainer.step))

    def on_epoch_end(self, trainer) -> None:
        if self.writer is not None:
            self.writer.flush()

    def on_train_end(self, trainer) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def build(run_dir: Path, config) -> TensorBoardLogger:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise XmcError("the tensorboard logger needs the tensorboard package: "
                       "pip install 'xmcbench[tensorboard]'") from error
    return TensorBoardLogger(run_path(run_dir, FOLDER), SummaryWriter)
