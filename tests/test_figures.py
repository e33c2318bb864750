"""Figures: loss against epochs of training (so batch sizes line up), stage starts marked, readable bar labels.

Every figure is drawn on matplotlib's Agg canvas (xmcbench.report never uses pyplot) and returned, so these
tests look at what was drawn: line data, vertical lines, texts, tick label boxes."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from matplotlib.container import BarContainer

from xmcbench import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def training_log(steps_per_epoch: int, stages: list[tuple[str, int]] | None = None) -> list[dict]:
    """A training_log.json "steps" list as the Trainer writes it: per step its global number, its epoch within
    its stage and, with several stages, the stage; the parts of the loss each stage trains."""
    steps, step = [], 0
    for name, epochs in stages or [(None, 3)]:
        parts = {"recall": 0.3} if name in ("recall", "recall-refit") else {"rank": 0.2} if name else \
            {"recall": 0.3, "rank": 0.2}
        for epoch in range(1, epochs + 1):
            for _ in range(steps_per_epoch):
                step += 1
                record = {"step": step, "epoch": epoch, **({"stage": name} if name else {})}
                record.update({"loss": sum(parts.values()) / step ** 0.5,
                               **{part: value / step ** 0.5 for part, value in parts.items()}})
                steps.append(record)
    return steps


def write_run(folder: Path, method: str, seed: int, batch_size: int, steps: list[dict]) -> Path:
    """A finished run directory with what the report reads: config.json, metrics.json, training_log.json."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "method": method, "dataset_name": "tiny", "config": {"seed": seed, "batch_size": batch_size}}))
    (folder / "metrics.json").write_text(json.dumps({"P@1": 80.0, "P@3": 60.0, "P@5": 45.0}))
    (folder / "training_log.json").write_text(json.dumps({"steps": steps}))
    return folder


def curves_of(figure) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The loss lines drawn (legend label -> x, y), without the stage lines."""
    axes = figure.axes[0]
    return {line.get_label(): (np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float))
            for line in axes.get_lines() if not line.get_label().startswith("_")}


def stage_marks(figure) -> tuple[list[float], list[str]]:
    """(x of the vertical stage lines, the stage names written at the top)."""
    axes = figure.axes[0]
    lines = [line.get_xdata()[0] for line in axes.get_lines() if line.get_label().startswith("_")]
    return lines, [text.get_text() for text in axes.texts]


# -- epochs and stages from the log ---------------------------------------------------------------------

def test_loss_epochs_are_steps_over_steps_per_epoch_counted_over_stages():
    steps = training_log(4, [("recall", 2), ("rank", 1)])
    assert report.loss_epochs(steps) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0,
                                                       2.25, 2.5, 2.75, 3.0])
    # two batch sizes, one amount of training: the last step of both ends at epoch 3
    assert report.loss_epochs(training_log(12))[-1] == report.loss_epochs(training_log(3))[-1] == 3.0


def test_stage_starts_are_found_from_the_log():
    steps = training_log(5, [("recall", 3), ("rank", 3), ("recall-refit", 1)])   # lightxml-static's stages
    assert report.stage_starts(steps) == [(0.0, "recall"), (3.0, "rank"), (6.0, "recall-refit")]
    # one epoch per stage: a stage starts where the previous one's only epoch ends
    assert report.stage_starts(training_log(2, [("recall", 1), ("rank", 1)])) == [(0.0, "recall"), (1.0, "rank")]
    assert report.stage_starts(training_log(5)) == []   # one stage: its records name none, nothing to mark
    assert report.stage_starts([]) == [] and report.loss_epochs([]) == []


# -- the report's loss_curves.png ---------------------------------------------------------------------------

def test_methods_with_different_batch_sizes_line_up_in_epochs(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / f"small-{seed}", "small-batches", seed, 16, training_log(steps_per_epoch=40))
        write_run(tmp_path / f"large-{seed}", "large-batches", seed, 64, training_log(steps_per_epoch=10))
    runs = report.load_runs([tmp_path], log=lambda line: None)
    figure = report.plot_loss_curves(runs, tmp_path / "loss_curves.png")
    drawn = curves_of(figure)
    assert set(drawn) == {"small-batches, 2 seed(s)", "large-batches, 2 seed(s)"}
    # both end after 3 epochs, not after 120 and 30 steps; a point per 1/20 epoch, or per step when an epoch
    # has fewer steps
    small, large = drawn["small-batches, 2 seed(s)"], drawn["large-batches, 2 seed(s)"]
    assert small[0][-1] == large[0][-1] == pytest.approx(3.0)
    assert small[0] == pytest.approx(np.arange(1, 61) / 20) and large[0] == pytest.approx(np.arange(1, 31) / 10)
    # each point is the mean loss of its steps: the large batches' 11th step is the first of epoch 2
    assert large[1][10] == pytest.approx(0.5 / 11 ** 0.5) and np.all(np.isfinite(small[1]))
    assert "epoch" in figure.axes[0].get_xlabel()
    assert stage_marks(figure) == ([], [])   # one stage each: no marks
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_MAGIC


def test_stage_starts_are_marked_once_per_start(tmp_path):
    static = [("recall", 3), ("rank", 3), ("recall-refit", 1)]
    write_run(tmp_path / "static", "lightxml-static", 0, 16, training_log(8, static))
    write_run(tmp_path / "static-bs", "lightxml-static-bs", 0, 16, training_log(8, static[:2]))
    write_run(tmp_path / "joint", "lightxml", 0, 16, training_log(8))
    figure = report.plot_loss_curves(report.load_runs([tmp_path], log=lambda line: None), tmp_path / "loss.png")
    lines, names = stage_marks(figure)
    # both static methods start rank at 3 (one grey mark); only lightxml-static refits (a mark in its colour)
    assert sorted(lines) == [3.0, 6.0] and sorted(names) == ["rank", "recall", "recall-refit"]
    colours = {text.get_text(): text.get_color() for text in figure.axes[0].texts}
    static_colour = next(line.get_color() for line in figure.axes[0].get_lines()
                         if line.get_label().startswith("lightxml-static,"))
    assert colours["rank"] == "grey" and colours["recall-refit"] == static_colour


# -- a run's loss.png ---------------------------------------------------------------------------------------

def test_run_loss_shows_each_part_where_its_stage_trains_it(tmp_path):
    steps = training_log(10, [("recall", 2), ("rank", 2)])
    figure = report.plot_run_loss(steps, tmp_path / "loss.png")
    drawn = curves_of(figure)
    # a stage that trains one part has that part as its total: the total is not drawn over it
    assert set(drawn) == {"recall", "rank"}
    x, recall = drawn["recall"]
    assert x[-1] == pytest.approx(4.0)
    assert np.all(np.isfinite(recall[x <= 2])) and np.all(np.isnan(recall[x > 2]))   # a gap, not a line to 4
    assert stage_marks(figure) == ([2.0], ["recall", "rank"])
    joint = curves_of(report.plot_run_loss(training_log(10), tmp_path / "joint.png"))
    assert set(joint) == {"total", "recall", "rank"}
    for name in ("loss.png", "joint.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_a_run_writes_its_loss_plot_with_the_report_function(tmp_path):
    from xmcbench.callbacks import write_training_log

    log = SimpleNamespace(steps=training_log(6, [("recall", 1), ("rank", 1)]), validation=[], selected_epoch=None,
                          stopped_early=None, swa_updates=0)
    write_training_log(tmp_path, log)
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "training_log.json").read_text())["steps"] == log.steps


# -- bar charts ---------------------------------------------------------------------------------------------

LONG_NAMES = ["lightxml", "lightxml-random-neg", "ensemble(lightxml-static-bs+lightxml-static-bs+lightxml-static-bs)",
              "lightxml (epochs=1, head_lr=0.001, options.sampler=static)",
              "weighted-ensemble(lightxml+lightxml-1layer+lightxml-static+lightxml-static-bs+lightxml-random-neg+"
              "xmlcnn+plt+parabel+bonsai+ovr)"]


def precision_rows(names: list[str]) -> list[dict]:
    stats = {column: {"mean": value, "std": 1.0, "n": 3, "values": []}
             for column, value in (("P@1", 80.0), ("P@3", 55.0), ("P@5", 40.0))}
    return [{"dataset": "tiny", "method": name, "stats": stats} for name in names]


def test_wrapped_breaks_long_names_where_they_can_break():
    assert report._wrapped("lightxml") == "lightxml"
    assert report._wrapped("ensemble(lightxml-static+lightxml-static+lightxml-static)") == \
        "ensemble(\nlightxml-static+\nlightxml-static+\nlightxml-static)"
    for name in LONG_NAMES:
        wrapped = report._wrapped(name)
        assert wrapped.replace("\n", "").replace(" ", "") == name.replace(" ", "")   # nothing lost
        for line in wrapped.split("\n"):   # only a piece with nowhere to break is longer
            assert len(line) <= report.LABEL_CHARACTERS or not re.search(r"[+,(\s].", line)


def test_precision_tick_labels_do_not_overlap(tmp_path):
    names = LONG_NAMES * 2   # ten rows, as in the ablation report
    figure = report.plot_precision(precision_rows(names), tmp_path / "precision.png")
    renderer = figure.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in figure.axes[0].get_xticklabels()]
    assert len(boxes) == len(names)
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:]))
    assert all(box.y0 >= 0 for box in boxes)   # inside the figure: tight_layout made room for the lines
    # P@1, P@3 and P@5 bars with an error bar each for the seeds, as before
    bars = [container for container in figure.axes[0].containers if isinstance(container, BarContainer)]
    assert [len(container.errorbar.lines[2][0].get_segments()) for container in bars] == [len(names)] * 3
    assert (tmp_path / "precision.png").read_bytes()[:8] == PNG_MAGIC
    few = report.plot_precision(precision_rows(names[:2]), tmp_path / "few.png")
    assert figure.get_figwidth() > few.get_figwidth()   # the width grows with the number of methods


def test_frequency_bins_legend_wraps_long_names(tmp_path):
    table = {"dataset": "tiny", "k": 5, "bins": ["1", "2-3", ">3"], "labels": [5.0, 3.0, 2.0],
             "label_share": [50.0, 30.0, 20.0], "test_positive_share": [10.0, 30.0, 60.0],
             "rows": [{"method": name, "n_seeds": 3, "mean": [1.0, 5.0, 20.0], "std": [0.1, 0.5, 1.0]}
                      for name in LONG_NAMES]}
    figure = report.plot_frequency_bins([table], tmp_path / "bins.png")
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert max(len(line) for label in labels for line in label.split("\n")) <= report.LEGEND_CHARACTERS + 12
    assert figure.get_figwidth() < 12   # not as wide as the longest name on one line
    assert (tmp_path / "bins.png").read_bytes()[:8] == PNG_MAGIC
