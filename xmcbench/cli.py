"""`xmcbench` command line. Each command parses its options and calls a plain function in
`xmcbench.runner`; user mistakes end in one line on stderr and exit status 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from tabulate import tabulate

from xmcbench import runner
from xmcbench.errors import XmcError
from xmcbench.metrics import format_metrics
from xmcbench.pipeline import TrainingInterrupted
from xmcbench.registry import build_registry

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Benchmark extreme multi-label text classifiers; LightXML is the reference method.")

DatasetOption = typer.Option(None, "--dataset", "-d",
                             help=f"registered dataset name or a folder in the raw-text layout "
                                  f"[default: {runner.DEFAULT_DATASET}]")
SetOption = typer.Option(None, "--set", "-s", help="override a setting, key=value (repeatable)")
ConfigOption = typer.Option(None, "--config", help="TOML or JSON file of settings")
DataDirOption = typer.Option(None, "--data-dir", help="folder holding user-provided datasets "
                                                      "[env: XMCBENCH_DATA_DIR]")


@app.command("run")
def run_command(method: Optional[str] = typer.Argument(None, help="method name, e.g. lightxml"),
                dataset: Optional[str] = DatasetOption,
                set_options: Optional[List[str]] = SetOption,
                config_file: Optional[Path] = ConfigOption,
                output: Optional[Path] = typer.Option(None, "--output", "-o", help="run directory to write"),
                seed: Optional[int] = typer.Option(None, "--seed", help="random seed (same as --set seed=N)"),
                threads: Optional[int] = typer.Option(None, "--threads",
                                                      help="torch CPU threads (same as --set threads=N)"),
                data_dir: Optional[Path] = DataDirOption,
                overwrite: bool = typer.Option(False, "--overwrite", help="replace a finished run in --output"),
                print_config: bool = typer.Option(False, "--print-config",
                                                  help="print the resolved configuration and stop"),
                resume: Optional[Path] = typer.Option(None, "--resume",
                                                      help="continue an interrupted run from its last checkpoint")):
    """Train METHOD on a dataset, predict its test set, score it and write a run directory."""
    registry = build_registry()
    if resume is not None:
        if method or dataset or set_options or config_file or output or seed is not None or threads is not None:
            raise XmcError("--resume takes only the run directory: the run's settings are in its config.json")
        plan = runner.plan_resume(resume)
        output = resume
    elif method is None:
        raise XmcError("name a method (e.g. `xmcbench run lightxml`) or --resume RUN_DIR")
    else:
        options = list(set_options or []) + ([f"threads={threads}"] if threads is not None else [])
        plan = runner.plan_run(registry, method, dataset, config_file, options, seed)
    if print_config:
        typer.echo(json.dumps({"method": plan.method, "dataset": plan.dataset, **plan.config.to_dict()}, indent=2))
        return
    run_dir = runner.run(plan, output, data_dir, overwrite, registry, log=lambda line: typer.echo(line, err=True),
                         resume=resume is not None)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    timings = json.loads((run_dir / "timings.json").read_text())
    typer.echo(format_metrics({k: v for k, v in metrics.items() if isinstance(v, float)}))
    typer.echo(f"train {timings['train_seconds']:.0f} s ({timings['train_ms_per_document']:.1f} ms/document/epoch), "
               f"predict {timings['predict_ms_per_document']:.1f} ms/document; run directory: {run_dir}")


@app.command("config")
def config_command(method: str = typer.Argument(...), dataset: Optional[str] = DatasetOption,
                   set_options: Optional[List[str]] = SetOption, config_file: Optional[Path] = ConfigOption,
                   seed: Optional[int] = typer.Option(None, "--seed")):
    """Print the fully resolved configuration of a run without running it."""
    plan = runner.plan_run(build_registry(), method, dataset, config_file, list(set_options or []), seed)
    typer.echo(json.dumps({"method": plan.method, "dataset": plan.dataset, **plan.config.to_dict()}, indent=2))


@app.command("predict")
def predict_command(run_dir: Path = typer.Argument(..., help="a run directory (or its model/ folder)"),
                    input_file: Optional[Path] = typer.Option(None, "--input", "-i",
                                                              help="texts, one per line [default: stdin]"),
                    top_k: int = typer.Option(5, "--top-k", "-k")):
    """Write the top-k labels and scores of each input text as JSON lines."""
    if input_file is not None:
        from xmcbench.data import read_texts

        texts = read_texts(input_file)
    else:
        texts = sys.stdin.read().splitlines()
    for result in runner.predict_texts(run_dir, texts, top_k):
        typer.echo(json.dumps(result, ensure_ascii=False))


@app.command("evaluate")
def evaluate_command(run_dir: Path = typer.Argument(...), dataset: Optional[str] = typer.Option(None, "--dataset", "-d",
                     help="dataset to score on [default: the one the run trained on]"),
                     data_dir: Optional[Path] = DataDirOption):
    """Score a saved model on a dataset's test split."""
    metrics = runner.evaluate_run(run_dir, dataset, data_dir)
    typer.echo(format_metrics(metrics))


@app.command("plugins")
def plugins_command():
    """List the loaded plugins, their packages and versions, and what each registers."""
    registry = build_registry()
    rows = [[p.name, p.package, p.version, "\n".join(p.registered)] for p in registry.plugins]
    typer.echo(tabulate(rows, headers=["plugin", "package", "version", "registers"], tablefmt="simple"))
    for name, package, error in registry.failed:
        typer.echo(f"not loaded: {name} ({package}): {error}")


@app.command("datasets")
def datasets_command(data_dir: Optional[Path] = DataDirOption):
    """List the registered datasets, their sizes and whether their files are present."""
    from xmcbench.data import data_dir_from_env, resolve_files

    registry = build_registry()
    where = data_dir_from_env(data_dir)
    rows = []
    for name, entry in sorted(registry.datasets.items()):
        spec = entry.value
        try:
            resolve_files(spec, where)
            present = "embedded" if spec.embedded is not None else "yes"
        except XmcError:
            present = "no"
        rows.append([name, spec.num_train, spec.num_test, spec.num_labels, present, spec.description])
    typer.echo(tabulate(rows, headers=["dataset", "train", "test", "labels", "files", "description"],
                        intfmt=",", tablefmt="simple"))


def main() -> None:
    try:
        app()
    except TrainingInterrupted as stop:
        typer.echo(f"xmcbench: {stop}", err=True)
        sys.exit(130)
    except XmcError as error:
        typer.echo(f"xmcbench: error: {error}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("xmcbench: interrupted", err=True)
        sys.exit(130)
