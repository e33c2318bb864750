"""`xmcbench compare`: cells trained once, reused by hash, reported side by side; the hash changes with the
code, the options and the option files behind a result, and finds the runs saved before it did."""

import json
import types

import pytest
from typer.testing import CliRunner

from tests.test_registry import install_plugin, site, unique_package  # noqa: F401  (site: a fixture)
from tests.test_whole_methods import WordVotes
from xmcbench import compare
from xmcbench.cli import app, expand_seeds
from xmcbench.config import MethodSpec, Option, TrainConfig
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import build_registry
from xmcbench.storage import read_json, write_json
from xmcbench.testing import write_tiny_dataset
from xmcbench.runs import launch
from xmcbench.formats import open_dataset
from xmcbench.runs.plan import Plan, plan_run


def compare_args(model_dir, dataset, output, *extra):
    settings = [f"model_name={model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32",
                "threads=1", "cluster_size=2", "top_clusters=2", "hidden_size=8"]
    args = ["compare", "lightxml", "lightxml-random-neg", "--dataset", str(dataset), "--output", str(output),
            "--seeds", "0", "--seeds", "1", "--baseline", "lightxml", *extra]
    for setting in settings:
        args += ["--set", setting]
    return args


@pytest.mark.slow
def test_compare_trains_each_cell_once_and_reports(tiny_model_dir, tiny_dataset, tmp_path, monkeypatch):
    cli = CliRunner()
    output = tmp_path / "report"
    result = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble"))
    assert result.exit_code == 0, result.output
    assert len(list((output / "runs").iterdir())) == 4
    assert len(list((output / "ensembles").iterdir())) == 2
    run = next((output / "runs").iterdir())   # a component method's run records the code and options behind it
    provenance = json.loads((run / "config.json").read_text())["provenance"]
    assert set(provenance["components"]) == {"encoder", "recaller", "ranker", "sampler"}
    assert provenance["components"]["encoder"]["plugin"] == "lightxml" and "source_sha256" in provenance["method"]
    assert json.loads((run / "environment.json").read_text())["provenance"]["method"] == provenance["method"]
    report = (output / "report.md").read_text()
    assert "lightxml-random-neg" in report and "ensemble(" in report and "loss_curves.png" in report
    assert (output / "precision.png").exists()

    def no_training(*args, **kwargs):
        raise AssertionError("a cached cell was trained again")

    monkeypatch.setattr(launch, "run", no_training)
    again = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble"))
    assert again.exit_code == 0, again.output
    assert again.output.count("reusing") == 4

    monkeypatch.undo()
    changed = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--set", "head_lr=0.002"))
    assert changed.exit_code == 0, changed.output
    assert len(list((output / "runs").iterdir())) == 8, "another setting is another result"

    rebuilt = cli.invoke(app, ["report", str(output / "runs"), "--format", "json", "--output", str(tmp_path / "j")])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads((tmp_path / "j" / "table.json").read_text())


def test_seeds_can_be_typed_as_a_list():
    assert expand_seeds(["compare", "a", "--seeds", "0", "1", "2", "-b", "a"]) == \
        ["compare", "a", "--seeds", "0", "--seeds", "1", "--seeds", "2", "-b", "a"]


@pytest.mark.slow
def test_compare_weighted_ensemble_fuses_the_methods_seed_by_seed(tiny_model_dir, tiny_dataset, tmp_path):
    cli = CliRunner()
    output = tmp_path / "report"
    refused = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble", "--fusion", "weighted"))
    assert refused.exit_code != 0 and "validation_size=0" in str(refused.exception)
    assert "\n" not in str(refused.exception) and not (output / "runs").exists()   # refused before training

    result = cli.invoke(app, compare_args(tiny_model_dir, tiny_dataset, output, "--ensemble", "--fusion", "weighted",
                                          "--set", "validation_size=8"))
    assert result.exit_code == 0, result.output
    ensembles = sorted(p.name for p in (output / "ensembles").iterdir())
    assert len(ensembles) == 2 and all(name.startswith("weighted-lightxml+lightxml-random-neg-seed")
                                       for name in ensembles)
    report = (output / "report.md").read_text()
    assert "| weighted-ensemble(lightxml+lightxml-random-neg) |       2 |" in report
    assert "## Ensembles" in report and "seed 0: lightxml" in report and "seed 1: lightxml" in report
    assert "## Head and tail" in report and (output / "frequency_bins.png").exists()

    one = cli.invoke(app, ["compare", "lightxml", "--ensemble", "--fusion", "weighted", "--dataset", str(tiny_dataset),
                           "--output", str(output)])
    assert one.exit_code != 0 and "name at least two methods" in str(one.exception)


# -- a result key that cannot go stale: code, option defaults and option files ---------------------------------
# A toy whole method (word votes: fitting is instant) with a declared option and a path option.

def votes_plugin(weight_default: float = 1.0, name: str = "votes-opt"):
    """An in-process plugin: its code (this file) stays the same whatever default it is given."""
    options = (Option("weight", float, weight_default, "how much a vote counts"),
               Option("stopwords", "path", None, "a file of words that do not vote"))

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec(name, "word votes with options", whole_method=WordVotes, options=options))

    return types.SimpleNamespace(xmcbench_register_methods=xmcbench_register_methods)


@pytest.fixture
def dataset_dir(tmp_path):
    return write_tiny_dataset(tmp_path / "tiny", train=40, test=12)


def cells(registry, dataset_dir, output, method="votes-opt", *settings):
    """run_cells for one seed; returns (its run directory, the log lines)."""
    lines = []
    found = compare.run_cells(registry, [method], str(dataset_dir), [0], list(settings), None, output,
                              log=lines.append)
    return found[method][0], lines


def trained(lines) -> bool:
    """Whether the cell was trained or reused: its own first line (the grid's progress lines aside)."""
    cell = [line for line in lines if not line.startswith("grid: ")]
    assert "training into" in cell[0] or ("reusing" in cell[0] and len(cell) == 1), lines
    return "training into" in cell[0]


def test_an_option_default_that_changes_trains_again(dataset_dir, tmp_path):
    first = build_registry(extra_plugins=[("votes", votes_plugin(1.0))], load_entry_points=False)
    run_dir, lines = cells(first, dataset_dir, tmp_path / "runs")
    assert trained(lines) and not trained(cells(first, dataset_dir, tmp_path / "runs")[1])
    recorded = read_json(run_dir / "config.json")
    assert recorded["config"]["options"] == {} and recorded["provenance"]["options"] == {"weight": 1.0,
                                                                                          "stopwords": None}
    changed = build_registry(extra_plugins=[("votes", votes_plugin(2.0))], load_entry_points=False)
    other, lines = cells(changed, dataset_dir, tmp_path / "runs")
    assert trained(lines) and other != run_dir
    assert read_json(other / "config.json")["provenance"]["options"]["weight"] == 2.0


def test_an_option_file_that_changes_trains_again(dataset_dir, tmp_path):
    registry = build_registry(extra_plugins=[("votes", votes_plugin())], load_entry_points=False)
    stopwords = tmp_path / "stopwords.txt"
    stopwords.write_text("package\n")
    setting = f"options.stopwords={stopwords}"
    run_dir, lines = cells(registry, dataset_dir, tmp_path / "runs", "votes-opt", setting)
    assert trained(lines) and not trained(cells(registry, dataset_dir, tmp_path / "runs", "votes-opt", setting)[1])
    files = read_json(run_dir / "config.json")["provenance"]["option_files"]
    assert files["stopwords"]["path"] == str(stopwords.resolve()) and len(files["stopwords"]["sha256"]) == 64
    stopwords.write_text("package\nthe\n")
    again, lines = cells(registry, dataset_dir, tmp_path / "runs", "votes-opt", setting)
    assert trained(lines) and again != run_dir


INSTALLED_VOTES = '''
from tests.test_whole_methods import WordVotes
from xmcbench.config import MethodSpec
from xmcbench.hookspecs import hookimpl


@hookimpl
def xmcbench_register_methods(registry):
    registry.add_method(MethodSpec("votes-installed", "word votes from an installed plugin", whole_method=WordVotes))
'''


def test_a_plugins_code_or_version_that_changes_trains_again(site, dataset_dir, tmp_path, monkeypatch):  # noqa: F811
    package = unique_package(site)
    monkeypatch.setenv("XMCBENCH_PLUGINS", package)
    folder = install_plugin(site, package, INSTALLED_VOTES, version="1.0", editable=True)   # in development
    output = tmp_path / "runs"
    first, lines = cells(build_registry(), dataset_dir, output, "votes-installed")
    assert trained(lines) and not trained(cells(build_registry(), dataset_dir, output, "votes-installed")[1])
    (folder / "plugin.py").write_text(INSTALLED_VOTES + "\n# the recipe changed\n")
    edited, lines = cells(build_registry(), dataset_dir, output, "votes-installed")
    assert trained(lines) and edited != first
    environment = read_json(edited / "environment.json")["provenance"]["method"]
    assert environment["version"] == "1.0" and environment["source_sha256"] != \
        read_json(first / "environment.json")["provenance"]["method"]["source_sha256"]

    # installed from a wheel: the version identifies the code, and a new version trains again
    install_plugin(site, package, INSTALLED_VOTES, version="1.0")
    (site / f"{package}-1.0.dist-info" / "direct_url.json").unlink()
    released, lines = cells(build_registry(), dataset_dir, output, "votes-installed")
    assert trained(lines) and "source_sha256" not in read_json(released / "config.json")["provenance"]["method"]
    (site / f"{package}-1.0.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\n"
                                                                 "Version: 1.1\n")
    upgraded, lines = cells(build_registry(), dataset_dir, output, "votes-installed")
    assert trained(lines) and upgraded != released


def test_a_run_saved_before_keys_held_the_code_is_still_reused(dataset_dir, tmp_path, monkeypatch):
    """A run saved by xmcbench before result keys held the provenance sits under its old key, with no provenance
    in config.json: compare reuses it (and records the provenance it takes it for), until that changes."""
    registry = build_registry(extra_plugins=[("votes", votes_plugin(1.0))], load_entry_points=False)
    output = tmp_path / "runs"
    plan = plan_run(registry, "votes-opt", str(dataset_dir), seed=0)
    dataset = open_dataset(registry, str(dataset_dir))
    old = output / f"votes-opt-seed0-{compare.legacy_result_key(registry, plan, dataset.version)}"
    launch.run(plan, old, registry=registry, log=lambda line: None)
    saved = read_json(old / "config.json")
    del saved["provenance"]   # as the code before provenance wrote it
    write_json(old / "config.json", saved)

    def no_training(*args, **kwargs):
        raise AssertionError("a run saved before keys held the code was trained again")

    monkeypatch.setattr(launch, "run", no_training)
    found, lines = cells(registry, dataset_dir, output)
    assert found == old and lines == [f"votes-opt seed 0: reusing {old} (saved before result keys held the code and "
                                      "option files; taken as made by the code installed now)"]
    adopted = read_json(old / "config.json")["provenance"]
    assert adopted["options"] == {"weight": 1.0, "stopwords": None} and compare.ADOPTED in adopted
    assert cells(registry, dataset_dir, output)[0] == old   # and again, now by the provenance it recorded
    assert sorted(path.name for path in output.iterdir()) == [old.name]

    monkeypatch.undo()   # a default that changes after the adoption trains again: the old run cannot go stale
    changed = build_registry(extra_plugins=[("votes", votes_plugin(2.0))], load_entry_points=False)
    other, lines = cells(changed, dataset_dir, output)
    assert trained(lines) and other != old


# The key xmcbench's compare gave this plan before keys held the provenance, computed by that code. If this test
# fails, runs saved before no longer find their results: a setting added to TrainConfig since belongs in
# compare.LATER_SETTINGS (hashed only when not at its default), or RESULT_NEUTRAL_SETTINGS.
LEGACY_KEY = "cee65812c7006724"


def test_the_key_of_a_run_saved_before_keys_held_the_code_is_what_it_was():
    registry = build_registry(extra_plugins=[("votes", votes_plugin(1.0))], load_entry_points=False)
    plan = Plan("votes-opt", "tiny", TrainConfig(seed=0))
    assert compare.legacy_result_key(registry, plan, "v1") == LEGACY_KEY
    assert compare.result_key(registry, plan, "v1") != LEGACY_KEY
