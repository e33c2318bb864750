"""Comparative reports: pure functions of saved run directories, never of a live model.

    load_runs(paths)            run directories (or folders holding them, searched recursively) -> RunResult
    summarize(runs, baseline)   one row per (dataset, method) with mean, std and paired tests: raw numbers
    render_table(rows, fmt)     the rows as a github / latex table, or JSON; the only place numbers are formatted
    write_report(runs, output)  report.md + table.{md,tex,json} + loss_curves.png + precision.png
                                (+ frequency_bins.png: head vs tail, when the runs recorded frequency bins)
    summarize_frequency_bins    per dataset: each row's contribution to P@5 by bin of training label frequency
    RunResult.top1              per run: distinct top-1 labels and the share of the most frequent one, read from
                                its saved predictions; RunResult.degenerate flags a collapsed model (DEGENERATE_RULE)

Runs of one method on one dataset are its seeds. Runs of one method whose settings differ in anything but
the seed are separate rows ("variants"), labelled by the settings that tell them apart, so an ablation run
with `--set` is never averaged into the method it ablates.

Every name and value a report shows comes from run folders, which may come from anyone, and reports get
committed and rendered: each is escaped for the format it goes into (markdown_text, markdown_code, the LaTeX
escape; JSON by json.dumps) and figures draw text as plain text (no mathtext), so a method called
`<img onerror=...>`, a `|` in a dataset name or a line break in a setting is shown, never interpreted.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from xmcbench.config import TrainConfig
from xmcbench.defaults import WHOLE_METHOD_DERIVED
from xmcbench.errors import XmcError, closest_names_hint
from xmcbench.fusion import shared_bin_weights
from xmcbench.metrics import BUILTIN_FAMILIES, MetricFamily, metric_order, parse_at_k
from xmcbench.rundir import model_bytes
from xmcbench.storage import atomic_write

if TYPE_CHECKING:   # matplotlib is imported where a figure is drawn: reading runs does not need it
    from matplotlib.figure import Figure

__all__ = ["RunResult", "load_runs", "find_run_dirs", "summarize", "render_table", "plot_loss_curves",
           "plot_loss", "plot_run_loss", "loss_epochs", "stage_starts", "LossCurve", "plot_precision",
           "summarize_frequency_bins", "render_frequency_bins", "plot_frequency_bins", "write_report",
           "COLUMNS", "LOWER_IS_BETTER", "FORMATS", "PAIRED_TEST_NOTE", "MIN_PAIRED_SEEDS",
           "DEGENERATE_RULE", "is_degenerate"]

logger = logging.getLogger(__name__)

# A report has a column for each metric its runs recorded (see _is_metric), in xmcbench.metrics.metric_order of
# the families given (a registry's; by default xmcbench's own), except nDCG@1, which always equals P@1.
# The main table: precision and its propensity-scored form at 1, 3 and 5, the figures XMC papers lead with.
# Every other recorded metric goes to a "more metrics" table of its family pair (MORE_TABLES), or of its family.
MAIN_METRICS = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5", "coverage")
MORE_TABLES = (("nDCG@k and PSnDCG@k", ("nDCG", "PSnDCG")), ("R@k and PSR@k", ("R", "PSR")),
               ("P@k and PSP@k at further k", ("P", "PSP")))
COST_COLUMNS = ("train_seconds", "predict_ms_per_document", "model_mb", "peak_rss_mb", "peak_gpu_mb")
COLUMNS = MAIN_METRICS + COST_COLUMNS   # the main table's columns
LOWER_IS_BETTER = frozenset(COST_COLUMNS)
LABELS = {"train_seconds": "train s", "predict_ms_per_document": "predict ms/doc", "model_mb": "model MB",
          "peak_rss_mb": "peak RSS MB", "peak_gpu_mb": "peak GPU MB"}
DECIMALS = {"train_seconds": 1, "predict_ms_per_document": 2, "model_mb": 1, "peak_rss_mb": 0, "peak_gpu_mb": 0}
FORMATS = {"github": "md", "latex": "tex", "json": "json"}
NOT_METRICS = frozenset({"test_documents", "unseen_test_labels"})   # counts that metrics.json also holds
MIN_PAIRED_SEEDS = 3   # a paired t-test over 2 seeds has one degree of freedom: its p-value means little
PAIRED_TEST_NOTE = ("Differences are the method's mean minus the baseline's mean; p-values come from a two-sided "
                    "paired t-test over the seeds both were run with, matched by seed (scipy.stats.ttest_rel), "
                    f"and only when at least {MIN_PAIRED_SEEDS} seeds pair up: with fewer the cell shows the "
                    "difference alone; n/a when the paired differences do not vary.")
# Degenerate runs: a model that ranks (nearly) the same label first for every test document. Flagged when at
# least DEGENERATE_MIN_DOCUMENTS test documents were predicted and either the most frequent top-1 (an empty row
# counts as "no label") is first for >= DEGENERATE_SHARE of them, or it is first for >= DEGENERATE_FEW_SHARE of
# them and fewer than max(DEGENERATE_FEW_LABELS, DEGENERATE_LABEL_FRACTION x the labels) distinct labels are ever
# first. Healthy runs of skewed datasets rank a frequent label first for most documents (the committed reports:
# up to 73% on debian-builddeps with 48 distinct top-1 labels of 20,813, 36% with 11 of 506 on debtags-mini),
# so the share alone, or "fewer than 1% of the labels", would flag them.
DEGENERATE_SHARE = 0.9
DEGENERATE_FEW_SHARE = 0.5
DEGENERATE_FEW_LABELS = 5
DEGENERATE_LABEL_FRACTION = 0.001
DEGENERATE_MIN_DOCUMENTS = 20
DEGENERATE_RULE = (f"a run is flagged when, of at least {DEGENERATE_MIN_DOCUMENTS} test documents, "
                   f"{DEGENERATE_SHARE:.0%} or more get the same first label (an empty prediction counts as one "
                   f"value), or {DEGENERATE_FEW_SHARE:.0%} or more do and fewer than {DEGENERATE_FEW_LABELS} "
                   f"distinct labels (or {DEGENERATE_LABEL_FRACTION:.1%} of the labels, if more) are ever first")
STATS_NOTE = ("Cells are mean ± sample standard deviation (ddof=1) over seeds, — with one seed. The best value "
              "of each column is in bold: highest for metrics, lowest for time, size and memory.")


@dataclass
class RunResult:
    """One finished run, read from its directory."""

    path: Path
    method: str
    dataset: str
    seed: int
    config: dict           # config.json as saved: method, dataset, config (TrainConfig), resolved
    metrics: dict[str, float]
    timings: dict
    environment: dict
    losses: list[dict]     # training_log.json steps: {"step", "epoch", "loss", ...}
    model_bytes: int       # the size timings.json recorded when the run finished, else rundir.model_bytes (0 if neither)
    frequency_bins: dict | None = None   # metrics.json "frequency_bins" (xmcbench.metrics.evaluate), if recorded
    propensity: dict | None = None       # metrics.json "propensity" (scoring.Propensities.record), if recorded
    filtered_pairs: dict | None = None   # metrics.json "filtered_pairs" (scoring.without_filtered_pairs), if any
    zero_shot: dict | None = None        # metrics.json "zero_shot" (xmcbench.metrics.evaluate), if recorded
    pooled: tuple[str, ...] = ()         # settings that make no variant of this run (load_runs' pool)

    @functools.cached_property
    def top1(self) -> dict | None:
        """The first-ranked labels of the run's saved test predictions, read on first use: {"documents",
        "distinct" (labels ranked first for some document), "share" (of documents whose first label is the
        most frequent one; an empty prediction counts as one value, "no label"), "label" (that most frequent
        first label, -1: no label)}. None when the run saved no predictions (or they cannot be read)."""
        return _top1_of(self.path, self.num_labels)

    @property
    def num_labels(self) -> int:
        """The size of the run's label set (config.json "resolved"), 0 if not recorded."""
        value = self.config.get("resolved", {}).get("num_labels") if isinstance(self.config.get("resolved"), dict) \
            else None
        return int(value) if _is_number(value) else 0

    @property
    def degenerate(self) -> bool:
        """Whether the run ranks (nearly) one label first for every test document (DEGENERATE_RULE)."""
        return self.top1 is not None and is_degenerate(self.top1, self.num_labels)

    @property
    def settings(self) -> dict:
        """The run's TrainConfig values (config.json "config")."""
        return self.config.get("config", {})

    def values(self, families: Sequence[MetricFamily] | None = None) -> dict[str, float]:
        """The report's columns that this run has, as plain floats (families: as in summarize)."""
        families = BUILTIN_FAMILIES if families is None else families
        found = {key: value for key, value in self.metrics.items() if _is_metric(key, families)}
        found.update({key: self.timings[key] for key in ("train_seconds", "predict_ms_per_document",
                                                          "peak_rss_mb", "peak_gpu_mb") if key in self.timings})
        if self.model_bytes > 0:
            found["model_mb"] = self.model_bytes / 2**20
        return {key: float(value) for key, value in found.items() if _is_number(value)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _family_name(column: str) -> str:
    """The family a metric column belongs to: "P" for "P@5"; a metric without @k is its own."""
    parsed = parse_at_k(column)
    return parsed[0] if parsed else column


def _is_metric(name: str, families: Sequence[MetricFamily]) -> bool:
    """Whether a number of metrics.json is a metric column: any NAME@K (also of a family not given: a plugin's
    read without its registry), a family's key without @k, coverage; never nDCG@1."""
    return name != "nDCG@1" and (name == "coverage" or parse_at_k(name) is not None
                                 or any(not family.at_k and family.name == name for family in families))


def _lower_is_better(column: str, families: Sequence[MetricFamily]) -> bool:
    """A cost column, or a metric whose family says lower is better; a metric of a family not given is not."""
    return column in LOWER_IS_BETTER or any(family.name == _family_name(column) and not family.higher_is_better
                                            for family in families)


def _all_columns(names, families: Sequence[MetricFamily]) -> list[str]:
    """Metric columns in metric_order(families), then the cost columns, of the names given."""
    names = set(names)
    metrics = sorted((n for n in names if _is_metric(n, families)), key=metric_order(families))
    return metrics + [c for c in COST_COLUMNS if c in names]


# -- loading ----------------------------------------------------------------------------------------

def _is_run_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def find_run_dirs(folder: Path) -> tuple[list[Path], list[Path]]:
    """(finished, unfinished) run directories under `folder`, sorted by path.

    A run directory holds config.json; it is finished when it also holds metrics.json. The search does not
    descend into a run directory, so a model's own encoder/config.json is never taken for a run."""
    folder = Path(folder)
    if _is_run_dir(folder):
        return ([folder], []) if (folder / "metrics.json").is_file() else ([], [folder])
    finished, unfinished = [], []
    for root, directories, files in os.walk(folder):
        root_path = Path(root)
        if "config.json" in files and root_path != folder:
            (finished if "metrics.json" in files else unfinished).append(root_path)
            directories[:] = []
            continue
        directories[:] = sorted(d for d in directories if not d.startswith("."))
    return sorted(finished), sorted(unfinished)


def _read(path: Path, required: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise XmcError(f"{path} is missing")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise XmcError(f"{path} is not valid JSON ({error}); remove the run or rerun it") from None


def read_run(path: Path) -> RunResult:
    """The RunResult of one finished run directory."""
    path = Path(path)
    config = _read(path / "config.json")
    if not isinstance(config, dict) or "method" not in config or not isinstance(config.get("config"), dict):
        raise XmcError(f"{path / 'config.json'} is not an xmcbench run configuration (no method or config)")
    metrics = _read(path / "metrics.json")
    if not isinstance(metrics, dict):
        raise XmcError(f"{path / 'metrics.json'} does not hold a table of metrics")
    log = _read(path / "training_log.json", required=False)
    timings = _read(path / "timings.json", required=False)
    seed = config["config"].get("seed", 0)
    return RunResult(
        path=path, method=str(config["method"]),
        dataset=str(config.get("dataset_name") or metrics.get("dataset") or config.get("dataset", "?")),
        seed=int(seed) if _is_number(seed) else 0, config=config,
        metrics={key: float(value) for key, value in metrics.items()
                 if key not in NOT_METRICS and _is_number(value)},
        timings=timings,
        environment=_read(path / "environment.json", required=False),
        losses=list(log.get("steps", [])) if isinstance(log, dict) else [],
        model_bytes=_recorded_model_bytes(timings) or model_bytes(path),
        frequency_bins=_frequency_bins_of(metrics.get("frequency_bins")),
        propensity=metrics["propensity"] if isinstance(metrics.get("propensity"), dict) else None,
        filtered_pairs=metrics["filtered_pairs"] if isinstance(metrics.get("filtered_pairs"), dict) else None,
        zero_shot=metrics["zero_shot"] if isinstance(metrics.get("zero_shot"), dict) else None)


def _frequency_bins_of(recorded: Any) -> dict | None:
    """metrics.json's frequency bins when they have the expected shape; None otherwise (runs made before
    xmcbench recorded them, or a damaged entry: the head/tail table leaves that run out)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("k"), int) \
            or not isinstance(recorded.get("bins"), list):
        return None
    key = f"P@{recorded['k']}_contribution"
    for entry in recorded["bins"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("bin"), str) or not _is_number(entry.get(key)) \
                or not all(_is_number(entry.get(name)) for name in ("labels", "label_share", "test_positive_share")):
            return None
    return recorded


def _first_labels(path: Path, num_labels: int) -> np.ndarray | None:
    """The first-ranked label of each test document (-1: empty prediction) from predictions.safetensors
    (checked by prediction_files.read_predictions; num_labels: the run's label count, 0 if unknown) or,
    failing that, predictions.npz (each row's highest score); None if neither."""
    tensors = path / "predictions.safetensors"
    if tensors.is_file():
        from xmcbench.prediction_files import read_predictions

        labels = read_predictions(tensors, num_labels or None, "this run is not checked").labels
        return labels[:, 0].copy() if labels.shape[1] else np.full(labels.shape[0], -1, dtype=np.int64)
    matrix_path = path / "predictions.npz"
    if not matrix_path.is_file():
        return None
    import scipy.sparse as sp

    matrix = sp.load_npz(matrix_path).tocsr()
    counts = np.diff(matrix.indptr)
    first = np.full(matrix.shape[0], -1, dtype=np.int64)
    filled = np.flatnonzero(counts)
    if len(filled):
        data = matrix.data[:matrix.indptr[-1]]
        highest = np.maximum.reduceat(data, matrix.indptr[filled])
        row_of_entry = np.repeat(np.arange(len(filled)), counts[filled])
        at_highest = np.flatnonzero(data == highest[row_of_entry])
        _, first_entry = np.unique(row_of_entry[at_highest], return_index=True)
        first[filled] = matrix.indices[at_highest[first_entry]]
    return first


def _top1_of(path: Path, num_labels: int = 0) -> dict | None:
    try:
        first = _first_labels(path, num_labels)
    except XmcError as error:   # damaged or changed predictions must not stop the report: that run goes unchecked
        logger.warning("%s", error)
        return None
    except Exception as error:
        logger.warning("could not read the predictions of %s (%s); it is not checked for degeneracy", path, error)
        return None
    if first is None or len(first) == 0:
        return None
    values, counts = np.unique(first, return_counts=True)
    top = int(np.argmax(counts))
    return {"documents": int(len(first)), "distinct": int(np.count_nonzero(values >= 0)),
            "share": float(counts[top] / len(first)), "label": int(values[top])}


def is_degenerate(top1: dict, num_labels: int = 0) -> bool:
    """DEGENERATE_RULE applied to a RunResult.top1 record and the size of the run's label set."""
    if top1["documents"] < DEGENERATE_MIN_DOCUMENTS:
        return False
    few = max(DEGENERATE_FEW_LABELS, math.ceil(DEGENERATE_LABEL_FRACTION * num_labels))
    return top1["share"] >= DEGENERATE_SHARE or (top1["share"] >= DEGENERATE_FEW_SHARE and top1["distinct"] < few)


def _recorded_model_bytes(timings: Any) -> int:
    """The model size a run recorded when it finished: it outlives the files, which a run copied from another
    machine may lack in part (a whole method's folder without its backend's weights measured 2.7 MB, not 168);
    0 if not recorded (runs older than the record)."""
    recorded = timings.get("model_bytes") if isinstance(timings, dict) else None
    return int(recorded) if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0 else 0


def load_runs(paths: list[Path], log: Callable[[str], None] | None = None,
              pool: Sequence[str] = ()) -> list[RunResult]:
    """The finished runs named by `paths`: run directories, or folders searched recursively for them.

    Unfinished runs (config.json without metrics.json) are skipped and counted in one message to `log`
    (default: this module's logger). A path that is neither a run nor holds any finished run is an XmcError.
    pool: settings (`max_length`, `options.NAME`) in which runs of one method may differ and still be one row,
    their seeds paired across them (e.g. runs planned on two machines, which derived two lengths); the report's
    Setup lists their values."""
    check_pooled_settings(pool)
    log = log or logger.warning
    found: list[Path] = []
    skipped: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise XmcError(f"{path} does not exist; pass run directories or folders holding them")
        if not path.is_dir():
            raise XmcError(f"{path} is not a run directory (a folder with config.json and metrics.json) "
                           "nor a folder holding runs")
        finished, unfinished = find_run_dirs(path)
        if not finished:
            what = f"only {len(unfinished)} unfinished run(s), no metrics.json" if unfinished else "no xmcbench runs"
            raise XmcError(f"{path} holds {what}; pass run directories (config.json and metrics.json) "
                           "or folders holding them")
        found += finished
        skipped += unfinished
    unique = list(dict.fromkeys(p.resolve() for p in found))
    if skipped:
        shown = ", ".join(str(p) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        log(f"skipped {len(skipped)} unfinished run(s) without metrics.json: {shown}")
    by_resolved = {p.resolve(): p for p in found}
    return [replace(read_run(by_resolved[p]), pooled=tuple(pool)) for p in unique]


def check_pooled_settings(names: Sequence[str]) -> None:
    """Each name a setting a run records: a TrainConfig field other than the seed (always pooled) or options.NAME."""
    settings = [name for name in TrainConfig.__dataclass_fields__ if name not in ("seed", "options")]
    for name in names:
        if name not in settings and not (name.startswith("options.") and len(name) > len("options.")):
            raise XmcError(f"--pool {name}: not a setting runs record; name one ({closest_names_hint(name, settings)}) "
                           "or options.NAME")


# -- grouping ---------------------------------------------------------------------------------------

@dataclass
class _Group:
    dataset: str
    method: str
    label: str             # the row's name: the method, or "method (k=v, ...)" for one of its variants
    runs: list[RunResult]


def _default_settings() -> dict:
    """TrainConfig's defaults as config.json writes them (lists, not tuples)."""
    return json.loads(json.dumps(TrainConfig().to_dict()))


def _settings_key(run: RunResult) -> str:
    # a setting missing from an older config.json had its default value: it must not make a variant
    defaults = _default_settings()
    settings = {**defaults, **run.settings}
    settings.update({key: defaults[key] for key in _unread_derived_settings(run) if key in defaults})
    for name in run.pooled:
        if name.startswith("options."):
            settings["options"] = {k: v for k, v in (settings.get("options") or {}).items()
                                   if k != name[len("options."):]}
        else:
            settings.pop(name, None)
    return json.dumps({k: v for k, v in settings.items() if k != "seed"}, sort_keys=True, default=str)


def _unread_derived_settings(run: RunResult) -> list[str]:
    """Derived settings a whole method's run recorded but never read. Up to rule version 3 the core derived the
    training loop's settings (batch size, epochs, SWA interval) for a whole method too, from the device, so its
    runs on a GPU machine and on a CPU looked like two variants of it. Rule version 4 derives none of them."""
    resolved = run.config.get("resolved")
    version = run.config.get("rule_version")
    if not (isinstance(resolved, dict) and resolved.get("whole_method")) or not _is_number(version) or version >= 4:
        return []
    derived = run.config.get("derived")
    return [key for key in derived if key not in WHOLE_METHOD_DERIVED] if isinstance(derived, dict) else []


def _flat_settings(settings: dict) -> dict[str, Any]:
    flat = {k: v for k, v in settings.items() if k != "options"}
    flat.update({f"options.{k}": v for k, v in (settings.get("options") or {}).items()})
    return flat


def _groups(runs: list[RunResult]) -> list[_Group]:
    """Runs grouped by (dataset, method, settings other than the seed), in first-seen order."""
    groups: dict[tuple[str, str, str], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.dataset, run.method, _settings_key(run)), []).append(run)
    variants: dict[tuple[str, str], list[str]] = {}
    for dataset, method, key in groups:
        variants.setdefault((dataset, method), []).append(key)
    result = []
    for (dataset, method, key), members in groups.items():
        label = method
        keys = variants[(dataset, method)]
        if len(keys) > 1:
            mine = _flat_settings(json.loads(key))
            others = [_flat_settings(json.loads(k)) for k in keys if k != key]
            differing = [name for name in mine if any(other.get(name) != mine[name] for other in others)]
            label = f"{method} ({', '.join(f'{name}={mine[name]}' for name in differing)})"
        seen: dict[int, Path] = {}
        for run in members:
            if run.seed in seen:
                raise XmcError(f"{seen[run.seed]} and {run.path} are both {label} on {dataset} with seed "
                               f"{run.seed}; pass only one of them")
            seen[run.seed] = run.path
        result.append(_Group(dataset, method, label, sorted(members, key=lambda r: r.seed)))
    return result


# -- statistics -------------------------------------------------------------------------------------

def _stats(values: list[float]) -> dict:
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), "std": float(array.std(ddof=1)) if len(array) >= 2 else None,
            "n": len(array), "values": [float(v) for v in array]}


def _paired(mine: dict[int, float], base: dict[int, float]) -> dict:
    """Paired t-test of per-seed values (seed -> value) on the seeds both have; p_value None (the difference
    alone) with fewer than MIN_PAIRED_SEEDS of them."""
    from scipy import stats

    seeds = sorted(set(mine) & set(base))
    x = np.array([mine[s] for s in seeds], dtype=np.float64)
    y = np.array([base[s] for s in seeds], dtype=np.float64)
    p_value = None
    if len(seeds) >= MIN_PAIRED_SEEDS:
        differences = x - y
        scale = max(1.0, float(np.abs(x).max()), float(np.abs(y).max()))
        if differences.std(ddof=1) > 1e-9 * scale:   # rounding noise in equal differences is no variance
            p_value = float(stats.ttest_rel(x, y).pvalue)
    return {"diff": float(np.mean(list(mine.values())) - np.mean(list(base.values()))),
            "p_value": p_value, "n_pairs": len(seeds), "paired_seeds": seeds}


def _pick_baseline(groups: list[_Group], baseline: str) -> dict[str, _Group]:
    """dataset -> the baseline group on that dataset; `baseline` is a row label or a method name."""
    chosen: dict[str, _Group] = {}
    for dataset in dict.fromkeys(g.dataset for g in groups):
        here = [g for g in groups if g.dataset == dataset]
        exact = [g for g in here if g.label == baseline]
        by_method = [g for g in here if g.method == baseline]
        if exact:
            chosen[dataset] = exact[0]
        elif len(by_method) == 1:
            chosen[dataset] = by_method[0]
        elif by_method:
            raise XmcError(f"--baseline {baseline} is ambiguous on {dataset}: it has variants "
                           + ", ".join(repr(g.label) for g in by_method) + "; name one of them")
    if not chosen:
        names = list(dict.fromkeys([g.label for g in groups] + [g.method for g in groups]))
        raise XmcError(f"--baseline {baseline} is none of the reported methods: {closest_names_hint(baseline, names)}")
    return chosen


def summarize(runs: list[RunResult], baseline: str | None = None,
              families: Sequence[MetricFamily] | None = None) -> list[dict]:
    """One row per method (per dataset, per settings variant), in first-seen order. Raw numbers only:

    {"dataset", "method" (row label), "base_method", "n_seeds", "seeds",
     "stats": {column: {"mean", "std" (None with one value), "n", "values"}},
     "vs_baseline": {column: {"diff", "p_value" (None: n/a), "n_pairs", "paired_seeds"}} or None,
     "is_baseline", "baseline" (the baseline row's label on this dataset, or None),
     "best": [columns where this row has the best mean among the rows of its dataset],
     "top1": [{"seed", "documents", "distinct", "share", "label", "degenerate"} per seed whose run saved
              predictions (RunResult.top1, DEGENERATE_RULE)]}
    families: the metric families that order the columns and say which way is best (a registry's
    `metric_families()`); None: xmcbench's own (xmcbench.metrics.BUILTIN_FAMILIES). A metric of another family
    is still a column, after theirs.
    """
    if not runs:
        raise XmcError("no runs to report")
    families = BUILTIN_FAMILIES if families is None else families
    groups = _groups(runs)
    baselines = _pick_baseline(groups, baseline) if baseline else {}
    per_seed: dict[int, dict[str, dict[int, float]]] = {}   # id(group) -> column -> seed -> value
    rows = []
    for group in groups:
        columns: dict[str, dict[int, float]] = {}
        for run in group.runs:
            for column, value in run.values(families).items():
                columns.setdefault(column, {})[run.seed] = value
        per_seed[id(group)] = columns
        rows.append({"dataset": group.dataset, "method": group.label, "base_method": group.method,
                     "n_seeds": len(group.runs), "seeds": [r.seed for r in group.runs],
                     "stats": {c: _stats(list(columns[c].values())) for c in _all_columns(columns, families)},
                     "vs_baseline": None, "is_baseline": False,
                     "baseline": baselines[group.dataset].label if group.dataset in baselines else None,
                     "best": [],
                     "top1": [{"seed": r.seed, **r.top1, "degenerate": r.degenerate}
                              for r in group.runs if r.top1 is not None]})
    for group, row in zip(groups, rows):
        base = baselines.get(group.dataset)
        if base is None:
            continue
        if base is group:
            row["is_baseline"] = True
            continue
        mine, theirs = per_seed[id(group)], per_seed[id(base)]
        row["vs_baseline"] = {c: _paired(mine[c], theirs[c]) for c in _all_columns(mine, families) if c in theirs}
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        here = [r for r in rows if r["dataset"] == dataset]
        for column in _all_columns((c for r in here for c in r["stats"]), families):
            means = [(r, r["stats"][column]["mean"]) for r in here if column in r["stats"]]
            if len(means) < 2:
                continue
            pick = min if _lower_is_better(column, families) else max
            best = pick(m for _, m in means)
            for r, m in means:
                if math.isclose(m, best, rel_tol=1e-12, abs_tol=1e-12):
                    r["best"].append(column)
    return rows


# -- rendering --------------------------------------------------------------------------------------

def _columns(rows: list[dict], families: Sequence[MetricFamily]) -> list[str]:
    """Every column some row has: metrics by family and k, then costs."""
    return _all_columns((c for r in rows for c in r["stats"]), families)


def _main_columns(rows: list[dict]) -> list[str]:
    return [c for c in COLUMNS if any(c in r["stats"] for r in rows)]


def more_tables(rows: list[dict], families: Sequence[MetricFamily] | None = None) -> list[tuple[str, list[str]]]:
    """(title, columns) of the "more metrics" tables the rows fill, without the main table's columns: each
    MORE_TABLES family pair at every k recorded, then one table per other family ("Hit@k"), in
    metric_order(families) (families: as in summarize)."""
    families = BUILTIN_FAMILIES if families is None else families
    present = [c for c in _columns(rows, families) if c not in COLUMNS and c not in COST_COLUMNS]
    tables = []
    for title, pair in MORE_TABLES:
        columns = [c for c in present if _family_name(c) in pair]
        if columns:
            tables.append((title, columns))
    paired = {name for _, pair in MORE_TABLES for name in pair}
    for name in dict.fromkeys(_family_name(c) for c in present if _family_name(c) not in paired):
        columns = [c for c in present if _family_name(c) == name]
        tables.append((f"{name}@k" if parse_at_k(columns[0]) else name, columns))
    return tables


def _number(value: float, column: str, signed: bool = False) -> str:
    return f"{value:{'+' if signed else ''}.{DECIMALS.get(column, 2)}f}"


def _p_text(p: float | None) -> str:
    if p is None:
        return "n/a"
    return "p<0.001" if p < 0.001 else f"p={p:.3f}"


# Characters that would start Markdown or HTML inside a line (emphasis, code, links and images, raw HTML and
# entities, strikethrough, table cells, GitHub's $math$), and characters no name should carry: line breaks
# (a new line could start a heading or a block of HTML), other control characters (terminal escapes) and
# invisible or direction-changing ones (text that reads otherwise than it is).
# An underscore between two letters or digits (x86_64, model_name) can neither open nor close emphasis, so it
# stays as it is.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]<>!|~&$]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]+")


def markdown_text(value: Any) -> str:
    """str(value) as inert Markdown (GitHub's, HTML included) for a line or a table cell: unprintable
    characters become a space and every character that could start markup is backslash-escaped, so the text
    renders as itself."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", _UNPRINTABLE.sub(" ", str(value)))


def markdown_code(value: Any) -> str:
    """str(value) as a Markdown code span (for settings and label names in lists, not in table cells): its
    fence is longer than any run of backticks inside, so nothing ends it early; unprintable characters become
    a space."""
    text = _UNPRINTABLE.sub(" ", str(value))
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text[:1] == "`" or text[-1:] == "`" or (text[:1] == " " and text[-1:] == " ") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fenced(text: str) -> str:
    """A fenced code block of `text` whose fence no line of it can close."""
    fence = "`" * max(3, max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    return f"{fence}\n{_UNPRINTABLE.sub(' ', text)}\n{fence}"


def _latex_escape(text: str) -> str:
    replacements = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
    return "".join(replacements.get(ch, ch) for ch in _UNPRINTABLE.sub(" ", str(text)))


def _cell(row: dict, column: str, latex: bool) -> str:
    stat = row["stats"].get(column)
    if stat is None:
        return ""
    pm, dash = (r" $\pm$ ", "---") if latex else (" ± ", "—")
    text = _number(stat["mean"], column) + pm + (_number(stat["std"], column) if stat["std"] is not None else dash)
    if column in row["best"]:
        text = rf"\textbf{{{text}}}" if latex else f"**{text}**"
    versus = (row["vs_baseline"] or {}).get(column)
    if versus is not None and versus["n_pairs"] < MIN_PAIRED_SEEDS:   # too few seeds for a p-value
        text += f" ({_number(versus['diff'], column, signed=True)})"
    elif versus is not None:
        p_text = _p_text(versus["p_value"])
        if latex and versus["p_value"] is not None:
            p_text = f"${p_text}$"
        text += f" ({_number(versus['diff'], column, signed=True)}, {p_text})"
    return text


def _table(rows: list[dict], fmt: str, columns: list[str] | None = None) -> str:
    from tabulate import tabulate

    latex = fmt == "latex"
    columns = _main_columns(rows) if columns is None else columns
    headers = ["method", "seeds"] + [LABELS.get(c, c) for c in columns]
    body = []
    for row in rows:
        name = row["method"] + (" (baseline)" if row["is_baseline"] else "")
        body.append([_latex_escape(name) if latex else markdown_text(name), row["n_seeds"]]
                    + [_cell(row, c, latex) for c in columns])
    return tabulate(body, headers=headers, tablefmt="latex_raw" if latex else "github",
                    colalign=["left"] + ["right"] * (len(headers) - 1), disable_numparse=True)


def paired_test_note(rows: list[dict]) -> str:
    """PAIRED_TEST_NOTE, and why some cells have no p-value when fewer than MIN_PAIRED_SEEDS seeds pair up."""
    few = sorted({v["n_pairs"] for r in rows for v in (r["vs_baseline"] or {}).values()
                  if v["n_pairs"] < MIN_PAIRED_SEEDS})
    if not few:
        return PAIRED_TEST_NOTE
    counts = " or ".join(str(n) for n in few)
    return (PAIRED_TEST_NOTE + f" p-values need at least {MIN_PAIRED_SEEDS} paired seeds; {counts} pair"
            + ("s" if few == [1] else "") + " up here" + (" for some rows" if any(
                v["n_pairs"] >= MIN_PAIRED_SEEDS for r in rows for v in (r["vs_baseline"] or {}).values()) else "")
            + ".")


def render_table(rows: list[dict], fmt: str = "github", columns: list[str] | None = None,
                 families: Sequence[MetricFamily] | None = None) -> str:
    """The rows as a table: "github" (markdown, best in **bold**), "latex" (best in \\textbf{}) or "json"
    (the raw rows with every column, and each row's "best" list). Rows of several datasets give one table
    per dataset. columns: those to show (github, latex); default the main table's (COLUMNS). families: the
    order of JSON's columns and which are lower_is_better, as in summarize."""
    if fmt not in FORMATS:
        raise XmcError(f"unknown report format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "json":
        families = BUILTIN_FAMILIES if families is None else families
        return json.dumps({"columns": {c: LABELS.get(c, c) for c in _columns(rows, families)},
                           "lower_is_better": [c for c in _columns(rows, families) if _lower_is_better(c, families)],
                           "paired_test": paired_test_note(rows) if any(r["vs_baseline"] for r in rows) else None,
                           "degenerate_rule": DEGENERATE_RULE, "rows": rows}, indent=2)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    if len(datasets) == 1:
        return _table(rows, fmt, columns)
    parts = []
    for dataset in datasets:
        heading = f"% {_latex_escape(dataset)}" if fmt == "latex" else f"**{markdown_text(dataset)}**"
        parts.append(heading + "\n\n" + _table([r for r in rows if r["dataset"] == dataset], fmt, columns))
    return "\n\n".join(parts)


# -- figures ----------------------------------------------------------------------------------------

def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _plain_text(draw: Callable) -> Callable:
    """Draw a figure with every text as plain text: names from run folders may hold `$`, which mathtext
    would read as a formula (and fail on)."""
    @functools.wraps(draw)
    def plain(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False}):
            return draw(*args, **kwargs)
    return plain


def _save_png(figure: Figure, path: Path) -> None:
    figure.tight_layout()
    atomic_write(Path(path), lambda temporary: figure.savefig(temporary, format="png", dpi=100))


# Tick labels of bar charts wrap at this many characters; each method's group of bars is as wide as that.
LABEL_CHARACTERS = 18
LEGEND_CHARACTERS = 40   # and method names in a legend beside a figure at this many


def _wrapped(name: str, width: int = LABEL_CHARACTERS) -> str:
    """`name` on lines of at most `width` characters, broken after "+", ",", "(" or a space: ensemble and
    variant names ("ensemble(a+b+c)", "lightxml (epochs=1, lr=0.001)") run to a hundred characters and more.
    A piece longer than `width` (one method's name) keeps a line of its own."""
    lines = [""]
    for piece in re.split(r"(?<=[+,(\s])", name):
        if lines[-1].strip() and len(lines[-1] + piece.rstrip()) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line.strip() for line in lines)


# Loss figures show the mean loss of each twentieth of an epoch: the loss of single steps of a few documents
# is too noisy to tell methods apart, and a fixed share of an epoch treats every batch size alike.
POINTS_PER_EPOCH = 20


def _epochs_of_log(steps: list[dict]):
    """A training log's records in runs of one epoch of one stage: (stage or None, records) per epoch."""
    for (stage, _), records in itertools.groupby(steps, key=lambda record: (record.get("stage"), record.get("epoch"))):
        yield stage, list(records)


def loss_epochs(steps: list[dict]) -> list[float]:
    """Each record of a training log (training_log.json "steps", in order) placed in epochs of training: the
    passes over the training documents done when its step ended, counted over all stages (a second stage
    starts where the first ended), fractional within an epoch: the k-th of an epoch's n steps ends at k/n.

    Exact from the log alone: every step is logged with its epoch within its stage (and the stage, when a
    method has several), and an epoch is a fixed number of steps, ceil(documents / batch_size); so runs with
    different batch sizes, whose steps cover different amounts of data, line up. A finished run's log holds
    every step of every epoch."""
    epochs: list[float] = []
    for done, (_, records) in enumerate(_epochs_of_log(steps)):
        epochs += [done + (k + 1) / len(records) for k in range(len(records))]
    return epochs


def stage_starts(steps: list[dict]) -> list[tuple[float, str]]:
    """(epoch of training at which it starts, as loss_epochs counts them; name) of each stage in a training
    log, in order; [] when the run trained in one stage (its records then name none)."""
    starts: list[tuple[float, str]] = []
    for done, (stage, _) in enumerate(_epochs_of_log(steps)):
        if not starts or starts[-1][1] != stage:
            starts.append((float(done), stage))
    return starts if len(starts) > 1 else []


def _per_point(epochs: list[float], values: list[float]) -> dict[float, float]:
    """The mean of `values` (NaN: not logged at that step) over the steps of each 1/POINTS_PER_EPOCH of an
    epoch, keyed by the epoch at which that part ends; NaN where none of its steps has a value (a gap)."""
    parts: dict[float, list[float]] = {}
    for epoch, value in zip(epochs, values):
        # rounded first, so that an epoch's last step (2 + 239/239) lands in the part ending at 3.0
        parts.setdefault(math.ceil(round(epoch * POINTS_PER_EPOCH, 6)) / POINTS_PER_EPOCH, []).append(value)
    means = {}
    for end, part in parts.items():
        finite = [value for value in part if math.isfinite(value)]
        means[end] = float(np.mean(finite)) if finite else math.nan
    return means


@dataclass
class LossCurve:
    """One line of a loss plot: `loss` at `epochs` of training (NaN: not logged there, a gap in the line),
    a band of ± `std` where given, and the stage starts of the run(s) it shows."""

    label: str
    epochs: np.ndarray
    loss: np.ndarray
    std: np.ndarray | None = None
    stages: list[tuple[float, str]] = field(default_factory=list)


@_plain_text
def plot_loss(curves: list[LossCurve], path: Path, ylabel: str) -> Figure:
    """The one loss figure, of a run (loss.png: its loss parts) or of a report (loss_curves.png: a line per
    method): loss against epochs of training, on a log scale when every value is positive. Each stage after
    the first starts at a dotted vertical line named after it, in the colour of its curve, or grey when it
    is shared by several curves (the parts of one run, or methods with the same stages); a PNG at `path`.
    Like every figure here, it also returns the Figure, to look at what was drawn."""
    labels = [_wrapped(curve.label, LEGEND_CHARACTERS) for curve in curves]   # a long name would widen the figure
    widest_label = max((len(line) for label in labels for line in label.split("\n")), default=0)
    figure = _figure(7 + 0.07 * (widest_label + 6), 4.5)   # the legend sits beside the axes
    axes = figure.add_subplot()
    colours: dict[tuple[float, str], list] = {}   # stage start -> the colours of the curves that have it
    positive = True
    for curve, label in zip(curves, labels):
        line, = axes.plot(curve.epochs, curve.loss, linewidth=1, label=label)
        low = curve.loss
        if curve.std is not None and np.any(curve.std > 0):
            low = curve.loss - curve.std
            axes.fill_between(curve.epochs, low, curve.loss + curve.std, color=line.get_color(), alpha=0.2,
                              linewidth=0)
        positive &= bool(np.all(low[np.isfinite(low)] > 0))
        for start in curve.stages:
            colours.setdefault(start, []).append(line.get_color())
    for (epoch, name), shared in colours.items():
        colour = shared[0] if len(set(shared)) == 1 else "grey"
        if epoch > 0:
            axes.axvline(epoch, color=colour, linestyle=":", linewidth=1.2)
        # x in data, y in axes coordinates: the name sits at the top whatever the loss scale, right of its line
        axes.annotate(name, (epoch, 1.0), xycoords=axes.get_xaxis_transform(), xytext=(2, -4),
                      textcoords="offset points", color=colour, fontsize="small", rotation=90, ha="left",
                      va="top")
    axes.set_xlabel("epochs of training (passes over the training documents; all stages)")
    axes.set_ylabel(ylabel)
    if curves:
        axes.set_xlim(left=0)
        if positive:
            axes.set_yscale("log")
        # beside the axes: inside, it would cover the curves or the stage names
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        axes.text(0.5, 0.5, "no training log in these runs", ha="center", va="center", transform=axes.transAxes)
    _save_png(figure, path)
    return figure


def plot_run_loss(steps: list[dict], path: Path) -> Figure:
    """A run's loss.png from its training log: the total loss and its parts (recall, rank) against epochs,
    mean per 1/POINTS_PER_EPOCH epoch. A multi-stage method logs a part only in the stages that train it:
    its line has gaps elsewhere."""
    epochs, curves = loss_epochs(steps), []
    for key, label in (("loss", "total"), ("recall", "recall"), ("rank", "rank")):
        values = []
        for record in steps:
            # where a stage trains one part, the total is that part: drawn once, as the part
            alone = key == "loss" and sum(_is_number(record.get(part)) for part in ("recall", "rank")) == 1
            values.append(float(record[key]) if _is_number(record.get(key)) and not alone else math.nan)
        points = _per_point(epochs, values)
        if any(math.isfinite(value) for value in points.values()):
            curves.append(LossCurve(label, np.array(list(points)), np.array(list(points.values())),
                                    stages=stage_starts(steps)))
    return plot_loss(curves, path, f"training loss (BCE), mean per 1/{POINTS_PER_EPOCH} epoch")


def plot_loss_curves(runs: list[RunResult], path: Path) -> Figure:
    """Every method's training loss against epochs of training (loss_epochs), mean per 1/POINTS_PER_EPOCH
    epoch, then over its seeds (band: ± std over the seeds, where 2+ have the point), on one plot, with the
    starts of its stages; a PNG at `path`."""
    groups = _groups(runs)
    several_datasets = len({g.dataset for g in groups}) > 1
    curves = []
    for group in groups:
        # The seeds of a row share its settings, hence its steps per epoch: their points fall on the same x.
        by_point: dict[float, list[float]] = {}
        stages: list[tuple[float, str]] = []
        for run in group.runs:
            losses = [float(r["loss"]) if _is_number(r.get("loss")) else math.nan for r in run.losses]
            for end, value in _per_point(loss_epochs(run.losses), losses).items():
                if math.isfinite(value):
                    by_point.setdefault(end, []).append(value)
            stages += stage_starts(run.losses)
        if not by_point:
            continue
        epochs = np.array(sorted(by_point))
        mean = np.array([np.mean(by_point[e]) for e in epochs])
        std = np.array([np.std(by_point[e], ddof=1) if len(by_point[e]) > 1 else 0.0 for e in epochs])
        label = group.label + (f" ({group.dataset})" if several_datasets else "")
        curves.append(LossCurve(f"{label}, {len(group.runs)} seed(s)", epochs, mean, std,
                                list(dict.fromkeys(stages))))
    return plot_loss(curves, path, f"training loss, mean per 1/{POINTS_PER_EPOCH} epoch\nand over seeds (± std)")


@_plain_text
def plot_precision(rows: list[dict], path: Path) -> Figure:
    """P@1/3/5 per method as grouped bars, error bars = std over seeds; a PNG at `path`."""
    several_datasets = len({r["dataset"] for r in rows}) > 1
    names = [_wrapped(r["method"]) + (f"\n{r['dataset']}" if several_datasets else "") for r in rows]
    lines = [line for name in names for line in name.split("\n")]
    # each method's bars are as wide as the widest line of a label (a piece with nowhere to break can be wider
    # than LABEL_CHARACTERS): 0.065 inch per character at this size; the height grows with the lines of one
    per_method = max(1.3, 0.065 * max(len(line) for line in lines) + 0.2)
    figure = _figure(max(6.0, per_method * len(rows) + 1.5), 4.5 + 0.15 * max(name.count("\n") + 1 for name in names))
    axes = figure.add_subplot()
    positions = np.arange(len(rows))
    width = 0.8 / 3
    for i, column in enumerate(("P@1", "P@3", "P@5")):
        means = [r["stats"][column]["mean"] if column in r["stats"] else np.nan for r in rows]
        errors = [(r["stats"][column]["std"] or 0.0) if column in r["stats"] else 0.0 for r in rows]
        axes.bar(positions + (i - 1) * width, means, width, yerr=errors, capsize=3, label=column)
    axes.set_xticks(positions, names, fontsize="small")
    axes.set_ylabel("precision (%), mean ± std over seeds")
    axes.yaxis.grid(True, alpha=0.3)   # to read a bar's height across the figure
    axes.set_axisbelow(True)
    # above the axes, in one row: inside, it would cover the tallest bars
    axes.legend(fontsize="small", loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=3, frameon=False)
    _save_png(figure, path)
    return figure


# -- head vs tail: contributions by training label frequency --------------------------------------

def summarize_frequency_bins(runs: list[RunResult]) -> list[dict]:
    """Per dataset, each row's (method or variant, as in summarize) contribution to P@k by bin of training
    label frequency, mean and std over its seeds. Bins that hold no label in any run are left out, and so
    are runs without recorded bins. One dict per dataset that has some:

    {"dataset", "k", "bins": [names], "labels": [mean labels per bin], "label_share": [%],
     "test_positive_share": [%], "rows": [{"method", "n_seeds", "mean": [per bin], "std": [per bin] or None}]}
    """
    tables = []
    groups = [g for g in _groups(runs) if any(r.frequency_bins for r in g.runs)]
    for dataset in dict.fromkeys(g.dataset for g in groups):
        here = [g for g in groups if g.dataset == dataset]
        recorded = [r.frequency_bins for g in here for r in g.runs if r.frequency_bins]
        k = recorded[0]["k"]
        names = [entry["bin"] for entry in recorded[0]["bins"]]

        def comparable(bins: dict | None) -> bool:   # cut at the same k into the same bins
            return bins is not None and bins["k"] == k and [entry["bin"] for entry in bins["bins"]] == names

        def mean_of(key: str) -> np.ndarray:
            return np.mean([[entry[key] for entry in b["bins"]] for b in recorded if comparable(b)], axis=0)

        labels = mean_of("labels")
        keep = [i for i, count in enumerate(labels) if count > 0]
        rows = []
        for group in here:
            values = np.array([[entry[f"P@{k}_contribution"] for entry in r.frequency_bins["bins"]]
                               for r in group.runs if comparable(r.frequency_bins)])   # (seeds, bins)
            if not len(values):
                continue
            std = values.std(axis=0, ddof=1) if len(values) > 1 else None
            rows.append({"method": group.label, "n_seeds": len(values),
                         "mean": [float(values[:, i].mean()) for i in keep],
                         "std": [float(std[i]) for i in keep] if std is not None else None})
        tables.append({"dataset": dataset, "k": k, "bins": [names[i] for i in keep],
                       "labels": [float(labels[i]) for i in keep],
                       "label_share": [float(v) for v in mean_of("label_share")[keep]],
                       "test_positive_share": [float(v) for v in mean_of("test_positive_share")[keep]],
                       "rows": rows})
    return tables


def render_frequency_bins(table: dict) -> str:
    """One dataset's head/tail table (summarize_frequency_bins) in markdown: a row per bin, a column per
    method (mean contribution to P@k over seeds, the best of each bin in bold), and a last row that adds
    them up to P@k."""
    from tabulate import tabulate

    k = table["k"]
    headers = ["training documents per label", "labels (%)", "test positives (%)",
               *[markdown_text(row["method"]) for row in table["rows"]]]
    body = []
    for i, name in enumerate(table["bins"]):
        values = [r["mean"][i] for r in table["rows"]]
        best = max(values)
        cells = [f"**{v:.2f}**" if len(values) > 1 and best > 0 and math.isclose(v, best, abs_tol=1e-12) else f"{v:.2f}"
                 for v in values]
        body.append([markdown_text(name), f"{table['label_share'][i]:.1f}", f"{table['test_positive_share'][i]:.1f}",
                     *cells])
    body.append([f"all (= P@{k})", "100.0", "100.0", *[f"{sum(r['mean']):.2f}" for r in table["rows"]]])
    return tabulate(body, headers=headers, tablefmt="github", colalign=["left"] + ["right"] * (len(headers) - 1),
                    disable_numparse=True)


def render_zero_shot(runs: list[RunResult]) -> list[tuple[str, str]]:
    """Per dataset whose runs recorded zero-shot figures: (dataset, a markdown table with a row per method or
    variant (as in summarize): its test labels without a training document, their positives, and P@k and R@k
    counting only those labels, mean ± std over seeds). A method that cannot score such labels has 0 there; a
    run that recorded no figures (made before they existed) is a dash."""
    from tabulate import tabulate

    tables = []
    groups = _groups(runs)
    for dataset in dict.fromkeys(g.dataset for g in groups if any(r.zero_shot for r in g.runs)):
        here = [g for g in groups if g.dataset == dataset]
        columns = sorted({key for g in here for r in g.runs if r.zero_shot for key in r.zero_shot
                          if _family_name(key) in ("P", "R")}, key=metric_order())
        body = []
        for group in here:
            recorded = [r.zero_shot for r in group.runs if r.zero_shot]
            if not recorded:
                body.append([markdown_text(group.label), "0", "—", "—", *["—"] * len(columns)])
                continue

            def cell(key: str) -> str:
                values = [float(z.get(key, 0.0)) for z in recorded]
                return f"{np.mean(values):.2f}" + (f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else "")

            def count(key: str) -> str:   # seeds may hold out other labels: their mean
                return f"{np.mean([float(z.get(key, 0)) for z in recorded]):.0f}"

            body.append([markdown_text(group.label), str(len(recorded)), count("labels"), count("positives"),
                         *[cell(key) for key in columns]])
        headers = ["method", "seeds", "labels", "test positives", *columns]
        tables.append((dataset, tabulate(body, headers=headers, tablefmt="github", disable_numparse=True,
                                         colalign=["left"] + ["right"] * (len(headers) - 1))))
    return tables


@_plain_text
def plot_frequency_bins(tables: list[dict], path: Path) -> Figure:
    """Contribution to P@k per bin of training label frequency as grouped bars, one colour per method,
    error bars = std over seeds; one panel per dataset; a PNG at `path`."""
    from matplotlib import colormaps

    widest = max(len(t["bins"]) * len(t["rows"]) for t in tables)
    methods = list(dict.fromkeys(row["method"] for table in tables for row in table["rows"]))
    names = {method: _wrapped(method, LEGEND_CHARACTERS) for method in methods}   # a long name would widen the figure
    widest_name = max(len(line) for name in names.values() for line in name.split("\n"))
    legend_inches = 0.07 * (widest_name + 12)   # the legend sits beside the bars
    figure = _figure(max(6.0, 0.13 * widest + 2) + legend_inches, 4.5 * len(tables))
    palette = colormaps["tab10" if len(methods) <= 10 else "tab20"]
    colour = {method: palette(i % palette.N) for i, method in enumerate(methods)}   # one per method in every panel
    for index, table in enumerate(tables):
        axes = figure.add_subplot(len(tables), 1, index + 1)
        positions = np.arange(len(table["bins"]))
        width = 0.8 / len(table["rows"])
        for j, row in enumerate(table["rows"]):
            axes.bar(positions + (j - (len(table["rows"]) - 1) / 2) * width, row["mean"], width, yerr=row["std"],
                     capsize=2, color=colour[row["method"]],
                     label=f"{names[row['method']]} ({row['n_seeds']} seed{'s' if row['n_seeds'] > 1 else ''})")
        # the share of test positives under each bin says how much of P@k the bin could give at most
        ticks = [f"{name}\n{share:.0f} % of test\npositives" for name, share in
                 zip(table["bins"], table["test_positive_share"])]
        axes.set_xticks(positions, ticks, fontsize="small")
        axes.set_xlabel("training documents per label")
        axes.set_ylabel(f"contribution to P@{table['k']} (%)")
        if len(tables) > 1:
            axes.set_title(table["dataset"], fontsize="medium")
        # beside the axes, not over the bars: the tall bars are the head bins at one end
        axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _save_png(figure, path)
    return figure


def _label_name(run: RunResult, label: int) -> str:
    """A label id as its name (model/labels.json, else predictions_labels.json), or the id itself."""
    if label < 0:
        return "no label (empty prediction)"
    for names_path in (run.path / "model" / "labels.json", run.path / "predictions_labels.json"):
        try:
            names = json.loads(names_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(names, list) and label < len(names):
            return markdown_code(names[label])
    return f"label {label}"


def _check_lines(runs: list[RunResult], groups: list[_Group], several_datasets: bool) -> list[str]:
    """The "Checks" section: runs whose predictions are degenerate (DEGENERATE_RULE); [] if no run saved any."""
    checked = [r for r in runs if r.top1 is not None]
    if not checked:
        return []
    label_of = {id(run): group.label for group in groups for run in group.runs}
    lines = ["## Checks", "",
             "Degenerate models, from each run's saved test predictions: " + DEGENERATE_RULE + "."
             + (f" {len(runs) - len(checked)} run(s) saved no predictions and are not checked." if
                len(checked) < len(runs) else ""), ""]
    flagged = [r for r in checked if r.degenerate]
    for run in flagged:
        where = f" on {markdown_text(run.dataset)}" if several_datasets else ""
        lines.append(f"- **Degenerate: {markdown_text(label_of[id(run)])}{where}, seed {run.seed}** "
                     f"({markdown_text(run.path.name)}): "
                     f"{_label_name(run, run.top1['label'])} is first for {run.top1['share']:.1%} of "
                     f"{run.top1['documents']} test documents; distinct labels ever first: {run.top1['distinct']}.")
    if not flagged:
        lines.append(f"- No run is degenerate: the most frequent first label is first for at most "
                     f"{max(r.top1['share'] for r in checked):.1%} of a run's test documents, and at least "
                     f"{min(r.top1['distinct'] for r in checked)} distinct labels are first in every run.")
    return lines + [""]


def _fusion_lines(groups: list[_Group], several_datasets: bool) -> list[str]:
    """One line per ensemble row: its fusion rule and, for weighted fusion, the weights chosen per seed."""
    lines = []
    for group in groups:
        fusions = [(r.seed, r.config["fusion"]) for r in group.runs if isinstance(r.config.get("fusion"), dict)]
        if not fusions:
            continue
        name = markdown_text(group.label + (f" on {group.dataset}" if several_datasets else ""))
        first = fusions[0][1]
        if first.get("rule") not in ("weighted", "stacked"):
            lines.append(f"- {name}: raw scores summed over the union of the members' top-k (the paper's rule)")
            continue
        per_seed = []
        for seed, fusion in fusions:
            methods = fusion.get("member_methods") or []

            def listed(weights):
                return ", ".join(f"{markdown_text(method)} {weight:g}" if _is_number(weight) else
                                 f"{markdown_text(method)} {markdown_text(weight)}"
                                 for method, weight in zip(methods, weights or []))

            weights = listed(fusion.get("weights"))
            bins, bin_weights, stacking = fusion.get("bins"), fusion.get("bin_weights"), fusion.get("stacking")
            if isinstance(stacking, dict) and _is_number(stacking.get("alpha")):
                weights = ("a stacked model (a logistic regression on the members' normalised scores and the labels' "
                           f"training documents), ranking by its log-odds + {stacking['alpha']:g} x "
                           "log(1 / propensity)")
            elif isinstance(bin_weights, list) and isinstance(bins, list) and len(bins) == len(bin_weights):
                weights = "per bin of training documents, " + "; ".join(
                    f"{markdown_text(name)}: {listed(row)}" for name, row in shared_bin_weights(bins, bin_weights))
            tail = fusion.get("tail_slots")
            if isinstance(tail, dict) and _is_number(tail.get("alpha")) and tail["alpha"] > 0 \
                    and _is_number(tail.get("after")):
                weights += (f"; places after the first {tail['after']:g} by score x (1 / propensity) ^ "
                            f"{tail['alpha']:g}")
            chosen = fusion.get("validation") or {}
            alone = fusion.get("validation_members_alone") or []
            shown = [chosen, *alone]
            if alone and all(isinstance(figures, dict) and _is_number(figures.get("P@1"))
                             and _is_number(figures.get("PSP@5")) for figures in shown):
                pairs = [f"{figures['P@1']:.2f} / {figures['PSP@5']:.2f}" for figures in shown]
                weights += f" (validation P@1 / PSP@5 {pairs[0]}; members alone " + ", ".join(pairs[1:]) + ")"
            per_seed.append(f"seed {seed}: {weights}")
        rules = {fusion.get("rule") for _, fusion in fusions}
        fitted = ("a stacked model fitted" if rules == {"stacked"} else "weights chosen" if rules == {"weighted"}
                  else "weights chosen, or a stacked model fitted,")
        lines.append(f"- {name}: each member's scores normalised by its own validation scores (their empirical "
                     f"distribution), {fitted} "
                     f"on {markdown_text(first.get('validation_documents', '?'))} "
                     f"validation documents by {markdown_text(first.get('objective', '?'))}, never on test; "
                     + "; ".join(per_seed))
    return lines


# -- the report -------------------------------------------------------------------------------------

def _distinct(values) -> list:
    return list(dict.fromkeys(json.dumps(v, sort_keys=True, default=str) for v in values))


def _describe(groups: list[_Group], value: Callable[[RunResult], Any]) -> str:
    """One value if every run agrees, else the value per row; as Markdown text (markdown_text)."""
    per_group = {g.label + (f" on {g.dataset}" if len({x.dataset for x in groups}) > 1 else ""):
                 _distinct(value(r) for r in g.runs) for g in groups}
    everything = _distinct(json.loads(v) for vs in per_group.values() for v in vs)
    if len(everything) == 1:
        return markdown_text(json.loads(everything[0]))
    return "; ".join(f"{markdown_text(name)}: " + " / ".join(markdown_text(json.loads(v)) for v in values)
                     for name, values in per_group.items())


def _components(run: RunResult) -> str:
    """The components a run used, from config.json's resolved.components ("" for runs that predate it)."""
    resolved = run.config.get("resolved", {})
    recorded = resolved.get("components")
    if not isinstance(recorded, dict):
        return "none (a whole method)" if resolved.get("whole_method") else ""
    return ", ".join(f"{kind} {recorded.get(kind)}" for kind in ("encoder", "recaller", "ranker", "sampler"))


def _pooled_lines(groups: list[_Group], several_datasets: bool) -> list[str]:
    """Per row and pooled setting whose value varies within the row: each value and its seeds."""
    lines = []
    defaults = _flat_settings(_default_settings())
    for group in groups:
        for name in group.runs[0].pooled:
            seeds: dict[str, list[int]] = {}
            for run in group.runs:
                value = _flat_settings(run.settings).get(name, defaults.get(name))
                seeds.setdefault(json.dumps(value, default=str), []).append(run.seed)
            if len(seeds) > 1:
                values = ", ".join(f"{json.loads(value)} (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))})"
                                   for value, s in seeds.items())
                lines.append(f"  - {markdown_text(group.label)}{f' on {markdown_text(group.dataset)}' if several_datasets else ''}"
                             f": {markdown_code(name)} {markdown_text(values)}")
    return lines


def _non_default(run: RunResult) -> list[str]:
    defaults = _flat_settings(_default_settings())
    mine = _flat_settings(run.settings)
    return [f"{key}={mine[key]}" for key in mine if key != "seed" and (key not in defaults or defaults[key] != mine[key])]


def _propensity(run: RunResult) -> str:
    """The propensity model behind a run's PSP@k, PSnDCG@k and PSR@k, as metrics.json recorded it."""
    recorded = run.propensity or {}
    if not all(_is_number(recorded.get(key)) for key in ("a", "b", "train_documents")):
        return ("not recorded (written by an older xmcbench, whose runs took the label frequencies from their own "
                "training rows)")
    return f"A={recorded['a']:g}, B={recorded['b']:g}, {int(recorded['train_documents'])} training documents"


def _filtered(run: RunResult) -> str:
    """How many filtered (document, label) pairs a run's scoring removed, as metrics.json recorded it."""
    recorded = run.filtered_pairs or {}
    if not _is_number(recorded.get("listed")):
        return "none (no filter)"
    return f"{int(recorded['listed']):,} pairs listed, {int(recorded.get('removed', 0)):,} removed from the predictions"


def _hardware(run: RunResult) -> str:
    env, resolved = run.environment, run.config.get("resolved", {})
    torch_version = env.get("versions", {}).get("torch", "?")
    return (f"{env.get('platform') or 'platform not recorded'}, processor {env.get('processor') or 'not reported'}, "
            f"GPU {env.get('cuda') or 'none'}, device {resolved.get('device', '?')}, "
            f"torch {torch_version} with {resolved.get('threads', '?')} CPU threads")


def _more_heading(title: str, fmt: str) -> str:
    return f"% More metrics: {title}" if fmt == "latex" else f"More metrics: {title}"


def write_report(runs: list[RunResult], output: Path, baseline: str | None = None, fmt: str = "github",
                 command: str | None = None, families: Sequence[MetricFamily] | None = None) -> Path:
    """Write report.md, table.{md|tex|json}, loss_curves.png, precision.png and, when the runs recorded
    frequency bins, frequency_bins.png into `output`; return the path of report.md. `command` (the command
    line that produced the report) is printed at the top. families: the metric families, as in summarize."""
    if fmt not in FORMATS:
        raise XmcError(f"unknown report format {fmt!r}: choose one of {', '.join(FORMATS)}")
    output = Path(output)
    if output.is_file():
        raise XmcError(f"{output} is a file; --output must be a folder")
    rows = summarize(runs, baseline, families)
    groups = _groups(runs)
    output.mkdir(parents=True, exist_ok=True)
    table_path = output / f"table.{FORMATS[fmt]}"
    table = render_table(rows, fmt, families=families)
    if fmt != "json":   # JSON holds every column already; the other formats add the "more metrics" tables
        table += "".join(f"\n\n{_more_heading(title, fmt)}\n\n" + render_table(rows, fmt, columns)
                         for title, columns in more_tables(rows, families))
    atomic_write(table_path, lambda temporary: temporary.write_text(table + "\n", encoding="utf-8"))
    plot_loss_curves(runs, output / "loss_curves.png")
    plot_precision(rows, output / "precision.png")
    bin_tables = summarize_frequency_bins(runs)
    if bin_tables:
        plot_frequency_bins(bin_tables, output / "frequency_bins.png")

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    lines = ["# xmcbench report", ""]
    if command:
        lines += ["Produced by:", "", _fenced(command), ""]
    lines += [f"{len(runs)} finished runs of {len(rows)} method(s) on {len(datasets)} dataset(s).", ""]
    lines += ["## Setup", ""]
    for dataset in datasets:
        here = [r for r in runs if r.dataset == dataset]
        versions = ", ".join(dict.fromkeys(str(r.config.get("dataset_version", "?")) for r in here))
        labels = ", ".join(dict.fromkeys(str(r.config.get("resolved", {}).get("num_labels", "?")) for r in here))
        lines.append(f"- Dataset: **{markdown_text(dataset)}** (version {markdown_text(versions)}; "
                     f"{markdown_text(labels)} training labels)")
    lines.append(f"- Encoder: {_describe(groups, lambda r: r.settings.get('model_name', '?'))}")
    lines.append(f"- Hardware: {_describe(groups, _hardware)}")
    lines.append(f"- Propensities of PSP@k, PSnDCG@k and PSR@k (Jain et al. 2016, label frequencies of the whole "
                 f"training set): {_describe(groups, _propensity)}")
    if any(r.filtered_pairs for r in runs):
        lines.append(f"- Filtered pairs (the dataset's filter_labels files; taken out of the predictions before "
                     f"scoring, as the Extreme Classification Repository's evaluation does): "
                     f"{_describe(groups, _filtered)}")
    lines.append("- Seeds: " + "; ".join(
        f"{markdown_text(g.label)}{f' on {markdown_text(g.dataset)}' if len(datasets) > 1 else ''}: "
        f"{', '.join(str(r.seed) for r in g.runs)}" for g in groups))
    if any(_components(r) for g in groups for r in g.runs):
        lines.append("- Components that ran (a flat run, one logit per label, has no ranker and no sampler): "
                     + _describe(groups, _components))
    pooled = _pooled_lines(groups, len(datasets) > 1)
    if pooled:
        lines += ["- Pooled (`--pool`: runs of a row differ in these settings; its seeds are paired across them):",
                  *pooled]
    lines += ["- Settings that differ from the `TrainConfig` defaults:"]
    for group in groups:
        changed = _distinct(_non_default(r) for r in group.runs)
        text = "; ".join(", ".join(markdown_code(s) for s in json.loads(c)) or "none" for c in changed)
        lines.append(f"  - {markdown_text(group.label)}"
                     f"{f' on {markdown_text(group.dataset)}' if len(datasets) > 1 else ''}: {text}")
    lines += ["", "## Results", ""]
    for dataset in datasets:
        here = [r for r in rows if r["dataset"] == dataset]
        lines += [f"### {markdown_text(dataset)}", ""]
        lines += [render_table(here, "github"), ""]
        for title, columns in more_tables(here, families):
            lines += [f"More metrics: {title}", "", render_table(here, "github", columns), ""]
        if baseline and here[0]["baseline"] is None:
            lines += [f"No {markdown_text(baseline)} runs on {markdown_text(dataset)}: no baseline comparison "
                      "here.", ""]
    lines += [STATS_NOTE, ""]
    if baseline:
        lines += [f"Baseline: {markdown_text(baseline)}. Each cell of another method adds (difference, p-value). "
                  + paired_test_note(rows), ""]
    lines += [f"The table is also in [{table_path.name}]({table_path.name}).", ""]
    lines += _check_lines(runs, groups, len(datasets) > 1)
    fusion_lines = _fusion_lines(groups, len(datasets) > 1)
    if fusion_lines:
        lines += ["## Ensembles", "", *fusion_lines, ""]
    if bin_tables:
        k = bin_tables[0]["k"]
        lines += ["## Head and tail", "",
                  f"Contribution to P@{k} of the labels in each bin of training frequency (training documents per "
                  f"label): the correct predictions in the top {k} whose label is in the bin, divided by {k} × the "
                  f"test documents, in %, mean over seeds; the bins of a method add up to its P@{k}. Beside them, "
                  "each bin's share of the labels and of the test positives (label, document pairs); bin 0 holds "
                  "the labels no training document has, mostly test-only labels that no model can predict. Best of "
                  "each bin in bold.", ""]
        for table in bin_tables:
            if len(bin_tables) > 1:
                lines += [f"### {markdown_text(table['dataset'])}", ""]
            lines += [render_frequency_bins(table), ""]
    zero_shot_tables = render_zero_shot(runs)
    if zero_shot_tables:
        lines += ["## Zero-shot labels", "",
                  "Test positives whose label no training document of the model carried (labels held out with "
                  "`zero_shot_labels`, labels outside the training rows, test-only labels): P@k and R@k counting "
                  "only those labels, in %, mean ± std over seeds. Only a method that reads label texts can find "
                  "them; the others have 0.", ""]
        for dataset, table in zero_shot_tables:
            if len(zero_shot_tables) > 1:
                lines += [f"### {markdown_text(dataset)}", ""]
            lines += [table, ""]
    lines += ["## Figures", "",
              "![Training loss against epochs of training, mean over seeds; dotted lines: stage starts](loss_curves.png)",
              "",
              "![P@1, P@3 and P@5 per method, mean ± std over seeds](precision.png)", ""]
    if bin_tables:
        lines += [f"![Contribution to P@{bin_tables[0]['k']} by training label frequency, per method, mean ± std "
                  "over seeds](frequency_bins.png)", ""]
    report = output / "report.md"
    text = "\n".join(lines)
    atomic_write(report, lambda temporary: temporary.write_text(text, encoding="utf-8"))
    return report
