"""Top-k predictions saved in a run or ensemble folder, read back through one function that checks them.

A run writes its test predictions (predictions.safetensors, rundir.save_predictions) and, with a validation
split, its validation predictions (validation_predictions.safetensors, rundir.save_validation_predictions);
ensembles, `xmcbench rescore`, the checks of `xmcbench report` and weighted fusion read them back later,
from folders that may have been damaged, edited or received from someone else. read_predictions is the one
reader: a file that does not hold what xmcbench writes is refused in one XmcError line that names the file,
the row and what is wrong, instead of being scored.

What a valid file holds:
    labels  (N, k) integer label ids in [0, num_labels), -1 for an empty slot; a row's empty slots come after
            its labels, and no label appears twice in a row
    scores  (N, k) floating point, finite for every label that is not -1 and non-increasing along a row's
            labels (best first)
    rows    (N,) integer training-set row ids in [0, training rows) (validation predictions only)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xmcbench.errors import DamagedModel, XmcError, joined_line


@dataclass
class SavedPredictions:
    labels: np.ndarray          # (N, k) int64, -1 for empty slots
    scores: np.ndarray          # (N, k) float32
    rows: np.ndarray | None     # (N,) int64 training-set rows (validation predictions), else None


def read_predictions(path: Path, num_labels: int | None, remedy: str, documents: int | None = None,
                     training_rows: int | None = None) -> SavedPredictions:
    """The predictions in `path`, checked (see the module docstring); anything else is an XmcError line ending
    in "; remedy".

    num_labels: the size of the label vocabulary the ids index (None: unknown, only -1 and up is checked);
    documents: the number of rows the file must have (None: any); training_rows: for validation predictions,
    the number of training documents their `rows` index (None: the file has no rows to check)."""
    from safetensors.numpy import load_file

    path = Path(path)
    try:
        saved = load_file(str(path))
    except Exception as error:   # safetensors raises several types for a file that is not one
        raise DamagedModel(f"{path} cannot be read ({joined_line(error)}); {remedy}") from None
    labels, scores, rows = saved.get("labels"), saved.get("scores"), saved.get("rows")

    def refuse(problem: str) -> XmcError:
        return XmcError(f"{path}: {problem}: the predictions were damaged or changed after they were written; "
                        f"{remedy}")

    if labels is None or scores is None or labels.ndim != 2 or scores.shape != labels.shape \
            or labels.dtype.kind not in "iu" or scores.dtype.kind != "f":
        raise refuse("it does not hold integer labels and floating-point scores of one shape (documents, k)")
    if documents is not None and labels.shape[0] != documents:
        raise refuse(f"it has {labels.shape[0]} rows for {documents} documents")
    if training_rows is not None:
        if rows is None or rows.shape != (labels.shape[0],) or rows.dtype.kind not in "iu":
            raise refuse("it lacks the training-set row of each of its documents (rows)")
        if rows.size and (rows.min() < 0 or rows.max() >= training_rows):
            raise refuse(f"a row id is outside the {training_rows} training documents")
    labels = labels.astype(np.int64, copy=False)
    valid = labels >= 0

    def first_row(bad: np.ndarray) -> int | None:
        found = np.flatnonzero(bad.any(axis=1))
        return int(found[0]) if found.size else None

    high = num_labels if num_labels is not None else np.iinfo(np.int64).max
    row = first_row((labels < -1) | (labels >= high))
    if row is not None:
        value = labels[row][(labels[row] < -1) | (labels[row] >= high)][0]
        raise refuse(f"row {row} holds label id {value}, outside the {num_labels} labels (ids 0 to "
                     f"{high - 1}, -1 for an empty slot)")
    row = first_row(valid[:, 1:] & ~valid[:, :-1])
    if row is not None:
        raise refuse(f"row {row} has a label after an empty slot (-1)")
    # each row's empty slots made distinct (-1, -2, ...) so that only real labels can repeat
    distinct = np.where(valid, labels, -1 - np.arange(labels.shape[1])[None, :])
    ordered = np.sort(distinct, axis=1)
    row = first_row(ordered[:, 1:] == ordered[:, :-1])
    if row is not None:
        repeated = ordered[row][1:][ordered[row][1:] == ordered[row][:-1]][0]
        raise refuse(f"row {row} names label {repeated} twice")
    row = first_row(valid & ~np.isfinite(scores))
    if row is not None:
        raise refuse(f"row {row} has a score that is not a finite number")
    row = first_row(valid[:, 1:] & (scores[:, 1:] > scores[:, :-1]))
    if row is not None:
        raise refuse(f"row {row}'s scores are not in descending order (best first)")
    return SavedPredictions(labels, scores.astype(np.float32, copy=False),
                            rows.astype(np.int64, copy=False) if training_rows is not None else None)
