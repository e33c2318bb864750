"""`xmcbench` command line. `run`, `predict` and `evaluate` parse their options and call the Python API
(xmcbench.api: train, load(...).predict, evaluate), so a script can do all they do; the other commands call
plain functions of the run layer (`xmcbench.runs`, `xmcbench.saved`, `xmcbench.scoring`). User mistakes end in
one line on stderr and exit status 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from tabulate import tabulate

import xmcbench
from xmcbench.errors import TrainingInterrupted, XmcError

if TYPE_CHECKING:
    from xmcbench.formats import FormatOptions

# Each command imports what it needs when it runs: torch, transformers and scikit-learn cost seconds of CPU, and
# `--help` or `--version` needs none of them.

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Benchmark extreme multi-label text classifiers; LightXML is the reference method.")


def print_version(value: bool) -> None:
    if value:
        typer.echo(f"xmcbench {xmcbench.__version__}")
        raise typer.Exit()


@app.callback()
def global_options(version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                                help="print the version and exit")) -> None:
    pass


DatasetOption = typer.Option(None, "--dataset", "-d",
                             help="registered dataset name, or a folder or file in a data format "
                                  "(`xmcbench formats`, docs/data-formats.md) "
                                  "[default: the one `xmcbench datasets` marks as default]")
SetOption = typer.Option(None, "--set", "-s", help="override a setting, key=value (repeatable)")
ConfigOption = typer.Option(None, "--config", help="TOML or JSON file of settings")
DataDirOption = typer.Option(None, "--data-dir", help="folder holding user-provided datasets "
                                                      "[env: XMCBENCH_DATA_DIR]")
# How a folder or file given as --dataset is read (xmcbench.formats, docs/data-formats.md).
DataFormatOption = typer.Option(None, "--format", "--data-format",
                                help="data format of the --dataset path (`xmcbench formats` lists them) "
                                     "[default: detected]")
CompareDataFormatOption = typer.Option(None, "--data-format", help="data format of the --dataset path "
                                                                  "(`xmcbench formats`) [default: detected]")
TextColumnOption = typer.Option(None, "--text-column", help="column holding the document text [default: text]")
LabelColumnOption = typer.Option(None, "--label-column", help="column holding the labels [default: labels or label]")
LabelSeparatorOption = typer.Option(None, "--label-separator",
                                    help="character between labels in a label cell [default: '|' if a cell has "
                                         "one, else ',' if a cell has one, else whitespace]")
IdColumnOption = typer.Option(None, "--id-column", help="column of document ids: --test-size keeps each id's rows "
                                                        "on one side")
LabelTextsOption = typer.Option(None, "--label-texts", help="table of label texts for a dataset whose files carry "
                                                            "none: label<TAB>text lines (or .csv / .jsonl with "
                                                            "label and text columns)")
TestSizeOption = typer.Option(None, "--test-size", help="split a single file: the share (e.g. 0.2) or number of "
                                                        "rows that become the test set (seeded)")
FusionOption = typer.Option("sum", "--fusion", help="sum: raw scores summed (the paper's rule, one method family); "
                                                    "weighted: each member's scores normalised by its validation "
                                                    "scores, weights chosen on the validation rows (mixed families), "
                                                    "or the stacked model where it scores better there; "
                                                    "stacked: the same scores, ranked by a logistic regression "
                                                    "fitted on the validation rows; both fill the places after "
                                                    "the first 4 by score over propensity where that scores "
                                                    "better there (tail slots)")


@app.command("run")
def run_command(method: Optional[str] = typer.Argument(None, help="method name, e.g. lightxml"),
                dataset: Optional[str] = DatasetOption,
                set_options: Optional[List[str]] = SetOption,
                config_file: Optional[Path] = ConfigOption,
                output: Optional[Path] = typer.Option(None, "--output", "-o", help="run directory to write"),
                seed: Optional[int] = typer.Option(None, "--seed", help="random seed (same as --set seed=N)"),
                threads: Optional[int] = typer.Option(None, "--threads",
                                                      help="torch CPU threads (same as --set threads=N; with "
                                                           "--resume, this process's only)"),
                data_dir: Optional[Path] = DataDirOption,
                overwrite: bool = typer.Option(False, "--overwrite", help="replace a finished run in --output"),
                print_config: bool = typer.Option(False, "--print-config",
                                                  help="print the resolved configuration and stop"),
                resume: Optional[Path] = typer.Option(None, "--resume",
                                                      help="continue an interrupted run from its last checkpoint"),
                data_format: Optional[str] = DataFormatOption, text_column: Optional[str] = TextColumnOption,
                label_column: Optional[str] = LabelColumnOption,
                label_separator: Optional[str] = LabelSeparatorOption,
                id_column: Optional[str] = IdColumnOption, test_size: Optional[float] = TestSizeOption,
                label_texts: Optional[Path] = LabelTextsOption):
    """Train METHOD on a dataset, predict its test set, score it and write a run directory."""
    from xmcbench import api
    from xmcbench.distributed import end_other_process, is_main_process
    from xmcbench.formats import FormatOptions
    from xmcbench.metrics import format_metrics

    reading = format_options(data_format, text_column, label_column, label_separator, id_column, test_size,
                             label_texts)
    if resume is not None:
        if method or dataset or set_options or config_file or output or seed is not None \
                or reading != FormatOptions():
            raise XmcError("--resume takes only the run directory (and --threads): the run's settings are in its "
                           "config.json")
    elif method is None:
        raise XmcError("name a method (e.g. `xmcbench run lightxml`) or --resume RUN_DIR")
    threads_setting = {"threads": threads} if threads is not None else {}   # the same as --set threads=N
    arguments = dict(seed=seed, reading=reading, config_file=config_file, data_dir=data_dir,
                     set_options=list(set_options or []), resume=resume, **threads_setting)
    if print_config:
        typer.echo(json.dumps(api.resolved_config(method, dataset, **arguments), indent=2))
        return
    run = api.train(method, dataset, output=output, overwrite=overwrite,
                    log=lambda line: typer.echo(line, err=True), **arguments)
    if not is_main_process():   # the other processes of a torchrun run: process 0 reports
        end_other_process()
    timings = json.loads((run.path / "timings.json").read_text())
    typer.echo(format_metrics({k: v for k, v in run.metrics.items() if isinstance(v, float)}))
    typer.echo(f"train {timings['train_seconds']:.0f} s ({timings['train_ms_per_document']:.1f} ms/document/epoch), "
               f"predict {timings['predict_ms_per_document']:.1f} ms/document; run directory: {run.path}")


@app.command("config")
def config_command(method: str = typer.Argument(...), dataset: Optional[str] = DatasetOption,
                   set_options: Optional[List[str]] = SetOption, config_file: Optional[Path] = ConfigOption,
                   seed: Optional[int] = typer.Option(None, "--seed"), data_dir: Optional[Path] = DataDirOption,
                   data_format: Optional[str] = DataFormatOption, text_column: Optional[str] = TextColumnOption,
                   label_column: Optional[str] = LabelColumnOption,
                   label_separator: Optional[str] = LabelSeparatorOption,
                   id_column: Optional[str] = IdColumnOption, test_size: Optional[float] = TestSizeOption,
                   label_texts: Optional[Path] = LabelTextsOption):
    """Print the fully resolved configuration of a run without running it: every setting, and for a dataset
    without a preset, the settings derived from its statistics with what each follows from."""
    from xmcbench import api

    reading = format_options(data_format, text_column, label_column, label_separator, id_column, test_size,
                             label_texts)
    typer.echo(json.dumps(api.resolved_config(method, dataset, seed=seed, reading=reading, config_file=config_file,
                                              data_dir=data_dir, set_options=list(set_options or [])), indent=2))


def format_options(data_format: str | None, text_column: str | None, label_column: str | None,
                   label_separator: str | None, id_column: str | None, test_size: float | None,
                   label_texts: Path | None = None) -> FormatOptions:
    """The reading options of a --dataset path, as one FormatOptions."""
    from xmcbench.formats import FormatOptions

    return FormatOptions(format_name=data_format, text_column=text_column, label_column=label_column,
                         label_separator=label_separator, id_column=id_column, test_size=test_size,
                         label_texts=None if label_texts is None else str(label_texts))


@app.command("predict")
def predict_command(run_dir: Path = typer.Argument(..., help="a run directory (or its model/ folder), or an "
                                                            "ensemble directory"),
                    input_file: Optional[Path] = typer.Option(None, "--input", "-i",
                                                              help="texts, one per line [default: stdin]"),
                    top_k: int = typer.Option(5, "--top-k", "-k"),
                    ids_file: Optional[Path] = typer.Option(None, "--ids", help="document ids, one per line, aligned "
                                                                                "with the texts: each JSON line "
                                                                                "starts with its \"id\""),
                    threshold: Optional[float] = typer.Option(None, "--threshold",
                                                              help="drop labels scoring below this (scores are the "
                                                                   "method's own: see README, Metrics)"),
                    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads [default: "
                                                                                   "the ones the model trained with]")):
    """Write the top-k labels and scores of each input text as JSON lines."""
    from xmcbench import api
    from xmcbench.data import lines_of_bytes, read_texts

    if input_file is not None:
        texts = read_texts(input_file)
    else:
        texts = lines_of_bytes(sys.stdin.buffer.read(), "stdin")
    ids = None
    if ids_file is not None:
        ids = read_texts(ids_file)
        if len(ids) != len(texts):
            raise XmcError(f"--ids {ids_file} has {len(ids)} lines but there are {len(texts)} texts; give one id per "
                           "text, line by line")
    for index, result in enumerate(api.load(run_dir, threads=threads).predict(texts, top_k, threshold)):
        typer.echo(json.dumps({"id": ids[index], **result} if ids is not None else result, ensure_ascii=False))


@app.command("evaluate")
def evaluate_command(run_dir: Optional[Path] = typer.Argument(None, help="a run or ensemble directory (or give "
                                                                         "--predictions)"),
                     dataset: Optional[str] = typer.Option(None, "--dataset", "-d",
                     help="dataset to score on [default: the one the run trained on]"),
                     data_dir: Optional[Path] = DataDirOption,
                     data_format: Optional[str] = DataFormatOption, text_column: Optional[str] = TextColumnOption,
                     label_column: Optional[str] = LabelColumnOption,
                     label_separator: Optional[str] = LabelSeparatorOption,
                     id_column: Optional[str] = IdColumnOption, test_size: Optional[float] = TestSizeOption,
                     label_texts: Optional[Path] = LabelTextsOption,
                     predictions: Optional[Path] = typer.Option(None, "--predictions",
                                                                help="score this score matrix instead of a run: a "
                                                                     "scipy CSR (test documents x labels) saved "
                                                                     "with scipy.sparse.save_npz, from any system"),
                     labels_file: Optional[Path] = typer.Option(None, "--labels",
                                                                help="with --predictions: the name of each column "
                                                                     "(JSON list or one per line) [default: "
                                                                     "NAME_labels.json beside it, else the "
                                                                     "dataset's label ids]"),
                     name: Optional[str] = typer.Option(None, "--name", help="with --predictions: the system's name "
                                                                             "in reports [default: the file's name]"),
                     output: Optional[Path] = typer.Option(None, "--output", "-o",
                                                           help="with --predictions: also write a run-like folder "
                                                                "that `xmcbench report` reads beside runs"),
                     set_options: Optional[List[str]] = typer.Option(None, "--set", "-s",
                                                                     help="scoring setting, key=value: eval_ks, "
                                                                          "propensity_a, propensity_b")):
    """Score a saved model (or an ensemble of runs) on a dataset's test split, or, with --predictions, the
    scores of any system."""
    from xmcbench import api, ensemble
    from xmcbench.formats import FormatOptions
    from xmcbench.metrics import format_metrics

    reading = format_options(data_format, text_column, label_column, label_separator, id_column, test_size,
                             label_texts)
    set_options = list(set_options or [])
    if (run_dir is None) == (predictions is None):
        raise XmcError("give a run directory or --predictions FILE.npz (with --dataset), one of the two")
    if predictions is None and (labels_file or name or output):
        raise XmcError("--labels, --name and --output go with --predictions")
    if predictions is not None:
        if dataset is None:
            raise XmcError("--predictions needs --dataset: the dataset whose test split the matrix scores")
        metrics = api.evaluate_predictions(predictions, dataset, labels_file=labels_file, reading=reading,
                                           data_dir=data_dir, output=output, name=name, set_options=set_options)
        typer.echo(format_metrics(metrics))
        if output is not None:
            typer.echo(f"run-like directory for `xmcbench report`: {output}")
        return
    if ensemble.is_ensemble(run_dir) and reading != FormatOptions():
        raise XmcError("an ensemble is scored on the dataset its members trained on, read as they read it; drop "
                       "the reading options (--format, --text-column, ...), or evaluate one member run")
    metrics = api.evaluate(run_dir, dataset, reading, data_dir=data_dir, set_options=set_options)
    typer.echo(format_metrics(metrics))


@app.command("rescore")
def rescore_command(run_dirs: List[Path] = typer.Argument(..., help="finished run directories"),
                    data_dir: Optional[Path] = DataDirOption):
    """Score runs' saved test predictions again with this version's metrics (e.g. runs made before the
    propensity definition changed) and rewrite their metrics.json; the model files are not needed."""
    from xmcbench.registry import build_registry
    from xmcbench.saved import rescore_run

    registry = build_registry()
    for run_dir in run_dirs:
        rescore_run(run_dir, data_dir, registry=registry, log=typer.echo)


@app.command("ensemble")
def ensemble_command(run_dirs: List[Path] = typer.Argument(..., help="finished run directories sharing one label "
                                                                    "vocabulary"),
                     output: Optional[Path] = typer.Option(None, "--output", "-o",
                                                           help="ensemble directory to write"),
                     top_k: Optional[int] = typer.Option(None, "--top-k", "-k",
                                                         help="labels taken from each member and kept "
                                                              "[default: the members' top_k]"),
                     data_dir: Optional[Path] = DataDirOption,
                     overwrite: bool = typer.Option(False, "--overwrite", help="replace an ensemble in --output"),
                     fusion: str = FusionOption):
    """Ensemble saved runs: per document, the members' scores fused over the union of their top-k (summed, the
    paper's Table 3, or normalised and weighted, or stacked, on validation rows); writes a directory that
    `predict` and `evaluate` accept."""
    from xmcbench import ensemble
    from xmcbench.metrics import format_metrics

    directory = ensemble.build_ensemble(run_dirs, output, top_k, data_dir, overwrite,
                                        log=lambda line: typer.echo(line, err=True), fusion=fusion)
    metrics = json.loads((directory / "metrics.json").read_text())
    typer.echo(format_metrics({k: v for k, v in metrics.items() if isinstance(v, float)}))
    typer.echo(f"{metrics['members']} members, top-{metrics['top_k']}, {metrics['fusion']} fusion, metrics from "
               f"{metrics['metrics_from']}; ensemble directory: {directory}")


@app.command("plugins")
def plugins_command(options: bool = typer.Option(False, "--options", help="also list the options (--set "
                                                                          "options.NAME=VALUE) each component "
                                                                          "and method declares")):
    """List the loaded plugins, their packages and versions, the hooks they implement and what each
    registers; then, one line each, the plugins that were not loaded and why."""
    from xmcbench.registry import DISABLE_AUTOLOAD_ENV, RejectedName, build_registry

    registry = build_registry()
    if options:
        declared = [(f"{kind} {name}", option) for (kind, name), found in sorted(registry.component_options.items())
                    if name in registry.components[kind] for option in found]
        declared += [(f"method {name}", option) for name in sorted(registry.methods)
                     for option in registry.method(name).options]
        for owner, option in declared:
            typer.echo(f"{owner}: {option.describe()}")
        if not declared:
            typer.echo("no component or method declares options")
        return
    rows = [[p.name, p.package, p.version, "\n".join(p.hooks), "\n".join(p.registered)] for p in registry.plugins]
    if rows:
        typer.echo(tabulate(rows, headers=["plugin", "package", "version", "hooks", "registers"], tablefmt="simple"))
    else:
        typer.echo("no plugin loaded")
    loggers = [[name, entry.origin.split(" (")[0], f"xmcbench[{entry.value.extra}]" if entry.value.extra else "",
                entry.value.description] for name, entry in registry.loggers.items()]
    if loggers:   # what `--set loggers=NAME,...` may name
        typer.echo("\n" + tabulate(loggers, headers=["logger", "plugin", "needs", "description"], tablefmt="simple"))
    executors = [[name, entry.origin.split(" (")[0], f"xmcbench[{entry.value.extra}]" if entry.value.extra else "",
                  entry.value.description] for name, entry in registry.executors.items()]
    if executors:   # what `compare --executor NAME` may name
        typer.echo("\n" + tabulate(executors, headers=["executor", "plugin", "needs", "description"],
                                    tablefmt="simple"))
    indexers = [[name, entry.origin.split(" (")[0], entry.value.description]
                for name, entry in registry.indexers.items()]
    if indexers:   # what `--set indexer=NAME` may name
        typer.echo("\n" + tabulate(indexers, headers=["indexer", "plugin", "description"], tablefmt="simple"))
    metrics = [[name, entry.origin.split(" (")[0], "@k" if entry.value.at_k else "",
                "yes" if entry.value.selectable else "", entry.value.description]
               for name, entry in registry.metrics.items()]
    if metrics:   # what metrics.json holds, and what `--set selection_metric=NAME@K` may name
        typer.echo("\n" + tabulate(metrics, headers=["metric", "plugin", "at k", "selects", "description"],
                                    tablefmt="simple"))
    for failure in registry.failed:
        what = "warning" if isinstance(failure, RejectedName) else "not loaded"   # the rest of that plugin loaded
        typer.echo(f"{what}: {failure.name} ({failure.package}): {failure.error}")
    if registry.skipped:
        typer.echo(f"not loaded ({DISABLE_AUTOLOAD_ENV} is set): "
                   + ", ".join(f"{name} ({package})" for name, package in registry.skipped)
                   + f"; name the ones to load in XMCBENCH_PLUGINS, e.g. {registry.plugins_env_example()}")


@app.command("datasets")
def datasets_command(data_dir: Optional[Path] = DataDirOption):
    """List the registered datasets, their sizes and whether their files are present."""
    from xmcbench.data import data_dir_from_env, label_texts_file, resolve_files
    from xmcbench.registry import build_registry

    registry = build_registry()
    where = data_dir_from_env(data_dir)
    try:
        default = registry.default_dataset()
    except XmcError:   # no plugin marks one: nothing to flag
        default = None
    rows = []
    for name, entry in sorted(registry.datasets.items()):
        spec = entry.value
        try:
            folder = resolve_files(spec, where)
            present = "embedded" if spec.embedded is not None else "yes"
            texts = "yes" if label_texts_file(folder) is not None else "no"
        except XmcError:
            present, texts = "no", "?"
        rows.append([name + (" (default)" if name == default else ""), spec.num_train, spec.num_test,
                     spec.num_labels, present, texts, spec.description])
    typer.echo(tabulate(rows, headers=["dataset", "train", "test", "labels", "files", "label texts", "description"],
                        intfmt=",", tablefmt="simple"))


@app.command("formats")
def formats_command():
    """List the registered data formats a --dataset path may be in, whether each can be written by `convert`,
    and the optional dependencies each needs."""
    from xmcbench.registry import build_registry

    registry = build_registry()
    rows = [[name, "yes" if entry.value.write is not None else "no",
             f"xmcbench[{entry.value.extra}]" if entry.value.extra else "", entry.origin.split(" (")[0],
             entry.value.description] for name, entry in registry.formats.items()]
    typer.echo(tabulate(rows, headers=["format", "writes", "needs", "plugin", "description"], tablefmt="simple")
               if rows else "no data format registered (`xmcbench plugins` says which plugins loaded)")


@app.command("convert")
def convert_command(source: str = typer.Argument(..., help="registered dataset name, or a folder or file in any "
                                                           "readable format"),
                    output: Path = typer.Argument(..., help="new folder to write"),
                    to: str = typer.Option(..., "--to", help="data format to write (`xmcbench formats`)"),
                    data_format: Optional[str] = DataFormatOption, text_column: Optional[str] = TextColumnOption,
                    label_column: Optional[str] = LabelColumnOption,
                    label_separator: Optional[str] = LabelSeparatorOption,
                    id_column: Optional[str] = IdColumnOption, test_size: Optional[float] = TestSizeOption,
                    label_texts: Optional[Path] = LabelTextsOption,
                    data_dir: Optional[Path] = DataDirOption):
    """Read a dataset (with the same reading options as run) and write it in another data format; the folder
    written reads back with the format's defaults."""
    from xmcbench.formats import not_written, open_dataset, write_dataset
    from xmcbench.registry import build_registry

    registry = build_registry()
    registry.format(to)   # an unknown name fails before anything is read
    reading = format_options(data_format, text_column, label_column, label_separator, id_column, test_size,
                             label_texts)
    dataset = open_dataset(registry, source, data_dir, reading)
    folder = write_dataset(registry, dataset, output, to)
    left_out = not_written(registry.format(to), dataset)
    typer.echo(f"{dataset.name}: {dataset.train_labels.shape[0]:,} train / {dataset.test_labels.shape[0]:,} test "
               f"documents, {len(dataset.label_names):,} labels{' with texts' if dataset.label_texts else ''}, "
               f"written as {to} to {folder}"
               + (f"; not written ({to} has no place for them): {', '.join(left_out)}" if left_out else ""))


@app.command("report")
def report_command(paths: List[Path] = typer.Argument(..., help="run directories, or folders searched recursively "
                                                               "for them"),
                   baseline: Optional[str] = typer.Option(None, "--baseline", "-b",
                                                          help="method every other is compared with (paired "
                                                               "t-test over seeds)"),
                   fmt: str = typer.Option("github", "--format", "-f", help="table format: github, latex or json"),
                   output: Optional[Path] = typer.Option(None, "--output", "-o",
                                                         help="folder to write [default: reports/report-TIMESTAMP]"),
                   pool: List[str] = typer.Option([], "--pool",
                                                  help="a setting (e.g. max_length, options.NAME) in which runs of one "
                                                       "method may differ and stay one row, seeds paired across it "
                                                       "(repeatable)")):
    """Compare saved runs: a table of mean ± std over seeds, figures and report.md; reads only run directories."""
    import datetime
    import shlex

    from xmcbench import report

    runs = report.load_runs(paths, log=lambda line: typer.echo(line, err=True), pool=pool)
    if output is None:
        output = Path("reports") / f"report-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    command = shlex.join(["xmcbench", "report", *map(str, paths), *(["--baseline", baseline] if baseline else []),
                          *[part for name in pool for part in ("--pool", name)], "--format", fmt, "--output",
                          str(output)])
    path = report.write_report(runs, output, baseline, fmt, command=command)
    typer.echo(report.render_table(report.summarize(runs, baseline), fmt))
    typer.echo(f"{len(runs)} runs; report: {path}")


@app.command("compare")
def compare_command(methods: List[str] = typer.Argument(..., help="methods to compare, e.g. lightxml lightxml-static"),
                    dataset: Optional[str] = DatasetOption,
                    seeds: List[int] = typer.Option([0], "--seeds", help="seeds of every method (repeat: "
                                                                          "--seeds 0 --seeds 1, or --seeds 0 1 2)"),
                    baseline: Optional[str] = typer.Option(None, "--baseline", "-b",
                                                           help="method the others are tested against"),
                    set_options: Optional[List[str]] = SetOption,
                    config_file: Optional[Path] = ConfigOption,
                    fmt: str = typer.Option("github", "--format", "-f", help="table format: github, latex or json"),
                    output: Path = typer.Option(Path("reports") / "compare", "--output", "-o",
                                                help="folder for the runs (output/runs) and the report"),
                    ensemble: bool = typer.Option(False, "--ensemble", help="also score ensembles, side by side: "
                                                                           "of each method's seeds (--fusion sum), "
                                                                           "or of all methods per seed (weighted, "
                                                                           "stacked)"),
                    fusion: str = FusionOption,
                    data_dir: Optional[Path] = DataDirOption,
                    data_format: Optional[str] = CompareDataFormatOption,
                    text_column: Optional[str] = TextColumnOption, label_column: Optional[str] = LabelColumnOption,
                    label_separator: Optional[str] = LabelSeparatorOption,
                    id_column: Optional[str] = IdColumnOption, test_size: Optional[float] = TestSizeOption,
                    label_texts: Optional[Path] = LabelTextsOption,

                    executor: Optional[str] = typer.Option(None, "--executor", help="where the cells run: local (one "
                                                           "after another here), ray, slurm (`xmcbench plugins` lists "
                                                           "them) [default: local]"),
                    cell_cpus: Optional[int] = typer.Option(None, "--cell-cpus", help="CPUs per cell, also its torch "
                                                            "threads (same as --set threads=N)"),
                    cell_gpus: Optional[float] = typer.Option(None, "--cell-gpus", help="GPUs per cell; a fraction "
                                                              "shares a GPU (ray: 0.125 is eight cells per GPU)"),
                    address: Optional[str] = typer.Option(None, "--address", help="ray: the cluster to use (auto, "
                                                          "HOST:6379, ray://HOST:10001) [default: a Ray started here]"),
                    partition: Optional[str] = typer.Option(None, "--partition", help="slurm: the partition"),
                    time_limit: Optional[int] = typer.Option(None, "--time-limit", help="slurm: each cell's time "
                                                             "limit in minutes"),
                    executor_options: Optional[List[str]] = typer.Option(None, "--executor-option",
                                                                         help="an option of the executor, key=value "
                                                                              "(slurm: any sbatch option, e.g. "
                                                                              "account=abc; repeatable)")):
    """Train every (method, seed) cell without a saved result, reuse the rest, and write a report."""
    import shlex

    from xmcbench.compare import compare
    from xmcbench.executors import ExecutorOptions, LocalExecutor, parse_executor_options, with_cell_threads
    from xmcbench.registry import build_registry

    command = shlex.join(["xmcbench", "compare", *sys.argv[2:]]) if sys.argv[1:2] == ["compare"] else None
    registry = build_registry()
    options = ExecutorOptions(cell_cpus, cell_gpus, address, partition, time_limit,
                              parse_executor_options(executor_options or []))
    # an executor refuses what it cannot do (a missing engine, a flag it would ignore) before anything runs
    runs_cells = registry.executor(executor).factory(options) if executor else LocalExecutor(options)
    path = compare(registry, methods, dataset, seeds, output, with_cell_threads(set_options or [], cell_cpus),
                   config_file, baseline, fmt, ensemble, data_dir, command, log=lambda line: typer.echo(line, err=True),
                   fusion=fusion, reading=format_options(data_format, text_column, label_column, label_separator,
                                                         id_column, test_size, label_texts),
                   executor=runs_cells)
    typer.echo(f"report: {path}")


@app.command("new-plugin")
def new_plugin_command(name: str = typer.Argument(..., help="the plugin's name, e.g. cosine-ranker: the method is "
                                                            "called so, the package xmcbench-NAME"),
                       output: Path = typer.Option(Path("."), "--output", "-o", help="folder to write the package "
                                                                                      "into")):
    """Write a plugin package to start from: one component of each kind, a method, tests that run the
    conformance suite and a tiny run, a pyproject.toml with the entry point; it installs and passes its tests
    as written."""
    from xmcbench.scaffold import write_plugin

    folder = write_plugin(name, output)
    typer.echo(f"wrote {folder}: pip install -e {folder} && python -m pytest -q {folder}")


@app.command("synthetic")
def synthetic_command(shape: str = typer.Argument(..., help="shape to imitate: amazon670k, wiki500k or tiny "
                                                            "(xmcbench.synthetic.SHAPES)"),
                      output: Path = typer.Option(..., "--output", "-o", help="folder to write (new, empty, or "
                                                                               "a previous synthetic dataset)"),
                      train_docs: Optional[int] = typer.Option(None, "--train-docs",
                                                               help="[default: the shape's train size]"),
                      test_docs: Optional[int] = typer.Option(None, "--test-docs",
                                                              help="[default: the shape's test size]"),
                      seed: int = typer.Option(0, "--seed", help="random seed: same seed, same dataset")):
    """Write a synthetic dataset at the shape of a large benchmark (for speed and scale, never accuracy).

    The folder works as `xmcbench run lightxml --dataset DIR`; synthetic data never replaces real data in
    accuracy claims."""
    import shlex

    from xmcbench import synthetic

    spec = synthetic.get_shape(shape)
    command = shlex.join(["xmcbench", "synthetic", shape, "--output", str(output),
                          *(["--train-docs", str(train_docs)] if train_docs is not None else []),
                          *(["--test-docs", str(test_docs)] if test_docs is not None else []), "--seed", str(seed)])
    folder = synthetic.write_dataset(output, spec, train_docs, test_docs, seed, command=command)
    stats = json.loads((folder / "stats.json").read_text())
    typer.echo(f"synthetic {shape}: {stats['n_train']:,} train / {stats['n_test']:,} test documents, "
               f"{stats['n_labels']:,} labels, in {folder} (not for accuracy claims)")


def expand_seeds(argv: list[str]) -> list[str]:
    """`--seeds 0 1 2` -> `--seeds 0 --seeds 1 --seeds 2`: the form our users type, which click reads
    as one seed and two methods."""
    expanded, in_seeds = [], False
    for token in argv:
        if in_seeds and token.lstrip("-").isdigit() and not token.startswith("--"):
            expanded += ["--seeds", token]
            continue
        in_seeds = token == "--seeds"
        if not in_seeds:
            expanded.append(token)
    return expanded


def main() -> None:
    sys.argv[1:] = expand_seeds(sys.argv[1:])
    try:
        app()
    except TrainingInterrupted as stop:
        from xmcbench.distributed import is_main_process

        if is_main_process():   # every process of a torchrun run stops; one says so
            typer.echo(f"xmcbench: {stop}", err=True)
        sys.exit(130)
    except XmcError as error:
        typer.echo(f"xmcbench: error: {error}", err=True)
        sys.exit(2)
    except OSError as error:   # disk full, a read-only or missing folder: the system's reason, in one line
        where = f" ({error.filename})" if error.filename else ""
        typer.echo(f"xmcbench: error: {error.strerror or error}{where}; free space or fix the permissions there "
                   "and run the command again (a run continues with --resume)", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("xmcbench: interrupted", err=True)
        sys.exit(130)
