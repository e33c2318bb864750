"""Metric families are a registry kind: xmcbench's own (P, nDCG, PSP, PSnDCG, R, PSR) come from its built-in
plugin, a plugin's family ("Hit@k" here) is computed by metrics.evaluate, ordered by format_metrics, shown by
reports and compare, and may select the epoch."""

import importlib.metadata
import json
import shutil
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse

from tests.test_report import FIXTURES
from xmcbench import compare, report
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.metrics import BUILTIN_FAMILIES, MetricFamily, evaluate, format_metrics, selection_metrics
from xmcbench.registry import build_registry

REPOSITORY = Path(__file__).resolve().parents[1]
BUILTIN_NAMES = ["P", "nDCG", "PSP", "PSnDCG", "R", "PSR"]

# Hand example: 4 documents, 5 labels.
#   doc0 truth {0}, predicted [1, 0, 2] -> a hit at rank 2
#   doc1 truth {2}, predicted [2, 0, 1] -> a hit at rank 1
#   doc2 truth {1}, predicted [0, 2, 3] -> no hit in the top 3
#   doc3 truth {},  predicted [4, 3, 2] -> nothing to hit
# Hit@1 = 1 of 4 documents = 25 %, Hit@3 = 2 of 4 = 50 %.
TRUTH = scipy.sparse.csr_matrix(([1.0, 1.0, 1.0], ([0, 1, 2], [0, 2, 1])), shape=(4, 5))
PREDICTED = np.array([[1, 0, 2], [2, 0, 1], [0, 2, 3], [4, 3, 2]])
INV_PROPENSITY = np.array([1.0, 2.0, 3.0, 4.0, 5.0])


def hit_rate(ranking):
    """The share of documents with a relevant label in the top k, in %."""
    return {f"Hit@{k}": float(100.0 * np.mean(ranking.hits_at[:, j] > 0)) for j, k in enumerate(ranking.ks)}


HIT = MetricFamily("Hit", "documents with a relevant label in the top k, in %", hit_rate, selectable=True)


def plugin_adding(*families: MetricFamily) -> types.ModuleType:
    module = types.ModuleType("plugin_adding_metrics")

    @hookimpl
    def xmcbench_register_metrics(registry):
        for family in families:
            registry.add_metric_family(family)

    module.xmcbench_register_metrics = xmcbench_register_metrics
    return module


@pytest.fixture
def registry():
    """xmcbench's families, registered in-process as its built-in plugin registers them (whether that plugin
    is installed or not: the first test checks it where it is), then a plugin's Hit family."""
    return build_registry(extra_plugins=[("builtin-metrics", plugin_adding(*BUILTIN_FAMILIES)),
                                         ("hits", plugin_adding(HIT))], load_entry_points=False)


def installed_entry_points() -> set[str]:
    return {entry_point.name for entry_point in importlib.metadata.entry_points(group="xmcbench")}


# -- the built-in families -----------------------------------------------------------------------------------

@pytest.mark.skipif("xmcbench-metrics" not in installed_entry_points(),
                    reason="the installed xmcbench metadata predates its xmcbench-metrics entry point: pip install "
                           "-e . again")
def test_the_builtin_families_are_registered_by_the_builtin_plugin():
    registry = build_registry()
    assert not registry.failures_of("xmcbench-metrics"), registry.failures_of("xmcbench-metrics")
    builtin = [family for family in registry.metric_families() if family.name in BUILTIN_NAMES]
    assert [family.name for family in builtin] == BUILTIN_NAMES == [family.name for family in BUILTIN_FAMILIES]
    assert all(mine is theirs for mine, theirs in zip(builtin, BUILTIN_FAMILIES))   # one definition, no copy
    assert all(registry.metrics[name].origin.startswith("xmcbench-metrics (xmcbench ") for name in BUILTIN_NAMES)
    plugin = next(info for info in registry.plugins if info.name == "xmcbench-metrics")
    assert plugin.hooks == ["xmcbench_register_metrics"] and "metric family 'PSR'" in plugin.registered


def test_the_builtin_plugin_is_an_entry_point_of_xmcbench():
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["xmcbench"]["xmcbench-metrics"] == "xmcbench_metrics.plugin"
    assert "xmcbench_metrics" in project["tool"]["setuptools"]["packages"]
    folder = project["tool"]["setuptools"]["package-dir"]["xmcbench_metrics"]
    assert "registry.add_metric_family(family)" in (REPOSITORY / folder / "plugin.py").read_text()


def test_evaluate_without_families_computes_the_builtin_ones_in_their_order():
    default = evaluate(PREDICTED, TRUTH, ks=(3, 1), inv_propensity=INV_PROPENSITY, recalled_truth=TRUTH)
    given = evaluate(PREDICTED, TRUTH, ks=(3, 1), inv_propensity=INV_PROPENSITY, recalled_truth=TRUTH,
                     families=BUILTIN_FAMILIES)
    assert json.dumps(default) == json.dumps(given)
    assert list(default) == [f"{name}@{k}" for name in BUILTIN_NAMES for k in (1, 3)] + ["coverage"]
    assert selection_metrics() == tuple(f"{name}@{k}" for name in ("P", "nDCG", "PSP", "PSnDCG", "R")
                                        for k in (1, 3, 5))


# -- a plugin's family, end to end ---------------------------------------------------------------------------

def test_a_plugins_family_is_computed_ordered_and_may_select(registry):
    assert not registry.failed
    families = registry.metric_families()
    assert families == (*BUILTIN_FAMILIES, HIT) and registry.metrics["Hit"].origin.startswith("hits")
    assert "metric family 'Hit'" in next(info for info in registry.plugins if info.name == "hits").registered

    metrics = evaluate(PREDICTED, TRUTH, ks=(3, 1), inv_propensity=INV_PROPENSITY, recalled_truth=TRUTH,
                       families=families)
    assert metrics["Hit@1"] == 25.0 and metrics["Hit@3"] == 50.0
    expected = [key for family in families for key in family.keys([1, 3])]
    assert list(metrics) == expected + ["coverage"]
    builtin = evaluate(PREDICTED, TRUTH, ks=(3, 1), inv_propensity=INV_PROPENSITY, recalled_truth=TRUTH)
    assert all(metrics[key] == value for key, value in builtin.items())   # the built-ins as without the plugin

    assert format_metrics(metrics, families).split("  ") == [f"{key} {metrics[key]:.2f}" for key in expected] + \
        [f"coverage {metrics['coverage']:.2f}"]
    # without its family, Hit@k is still shown: after the families known and coverage
    assert format_metrics(metrics).endswith("coverage 100.00  Hit@1 25.00  Hit@3 50.00")

    assert selection_metrics(families)[-3:] == ("Hit@1", "Hit@3", "Hit@5")
    assert "Hit@5" not in selection_metrics(BUILTIN_FAMILIES)
    assert "Hit@5" not in selection_metrics([MetricFamily("Hit", "not selectable", hit_rate)])


def write_runs_with_hits(folder: Path, families) -> None:
    """The report fixture's runs, each with the Hit@k of a prediction: lightxml finds more than lightxml-static."""
    shutil.copytree(FIXTURES, folder)
    worse = np.array([[1, 3, 4], [0, 3, 4], [0, 2, 3], [4, 3, 2]])   # Hit@1 = 0, Hit@3 = 0
    for method, predicted in (("lightxml", PREDICTED), ("lightxml-static", worse)):
        scored = evaluate(predicted, TRUTH, ks=(1, 3), families=families)
        for seed in range(3):
            path = folder / method / f"seed{seed}" / "metrics.json"
            recorded = json.loads(path.read_text())
            recorded.update({key: value for key, value in scored.items() if key.startswith("Hit@")})
            path.write_text(json.dumps(recorded))


def test_a_plugins_family_has_columns_in_reports_and_compare(registry, tmp_path, monkeypatch):
    families = registry.metric_families()
    write_runs_with_hits(tmp_path / "results", families)
    runs = report.load_runs([tmp_path / "results"], log=lambda line: None)

    rows = {row["method"]: row for row in report.summarize(runs, families=families)}
    assert rows["lightxml"]["stats"]["Hit@3"]["mean"] == 50.0 and rows["lightxml-static"]["stats"]["Hit@3"]["mean"] == 0
    assert "Hit@3" in rows["lightxml"]["best"] and "Hit@3" not in rows["lightxml-static"]["best"]
    tables = dict(report.more_tables(list(rows.values()), families))
    assert tables["Hit@k"] == ["Hit@1", "Hit@3"]
    assert " Hit@1 |" in report.render_table(list(rows.values()), "github", tables["Hit@k"])
    columns = list(json.loads(report.render_table(list(rows.values()), "json", families=families))["columns"])
    assert columns.index("nDCG@3") < columns.index("Hit@1") < columns.index("coverage")

    # read without the registry (xmcbench report on run folders), the unknown family is still a column, after
    unknown = report.summarize(runs)
    metric_columns = [c for c in unknown[0]["stats"] if c not in report.COST_COLUMNS]
    assert metric_columns[-3:] == ["coverage", "Hit@1", "Hit@3"]
    assert dict(report.more_tables(unknown))["Hit@k"] == ["Hit@1", "Hit@3"]

    # compare writes its report with the registry's families
    def cells(registry, methods, *args, **kwargs):
        return {method: sorted((tmp_path / "results" / method).glob("seed[0-2]")) for method in methods}

    monkeypatch.setattr(compare, "run_cells", cells)
    path = compare.compare(registry, ["lightxml", "lightxml-static"], None, [0, 1, 2], tmp_path / "compared",
                           log=lambda line: None)
    text = path.read_text()
    assert "More metrics: Hit@k" in text and " Hit@3 |" in text
    assert "More metrics: Hit@k" in (tmp_path / "compared" / "table.md").read_text()


def test_a_family_where_lower_is_better_marks_its_lowest_mean_best(tmp_path):
    def misses(ranking):
        return {key.replace("Hit", "Miss"): 100.0 - value for key, value in hit_rate(ranking).items()}

    miss = MetricFamily("Miss", "documents without a relevant label in the top k, in %", misses,
                        higher_is_better=False)
    assert evaluate(PREDICTED, TRUTH, ks=(1, 3), families=[miss]) == {"Miss@1": 75.0, "Miss@3": 50.0}
    shutil.copytree(FIXTURES, tmp_path / "results")
    for method, value in (("lightxml", 10.0), ("lightxml-static", 20.0)):
        for seed in range(3):
            path = tmp_path / "results" / method / f"seed{seed}" / "metrics.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "Miss@1": value}))
    runs = report.load_runs([tmp_path / "results"], log=lambda line: None)
    families = (*BUILTIN_FAMILIES, miss)
    rows = {row["method"]: row for row in report.summarize(runs, families=families)}
    assert "Miss@1" in rows["lightxml"]["best"] and "Miss@1" not in rows["lightxml-static"]["best"]
    rendered = json.loads(report.render_table(list(rows.values()), "json", families=families))
    assert "Miss@1" in rendered["lower_is_better"]
    assert "Miss@1" in {row["method"]: row for row in report.summarize(runs)}["lightxml-static"]["best"]   # unknown


# -- what a family may not do ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family, error", [
    ("P", "registers a metric family that is not an xmcbench.metrics.MetricFamily: 'P'"),
    (MetricFamily("Hit rate", "d", hit_rate), "registers a metric family named 'Hit rate', which contains whitespace"),
    (MetricFamily("Hit-rate", "d", hit_rate), "registers metric family 'Hit-rate': give it a name of letters, "
                                              "digits and '_'"),
    (MetricFamily("coverage", "d", hit_rate, at_k=False), "none of coverage, frequency_bins, zero_shot"),
    (MetricFamily("Hit", "d", "not callable"), "give it compute(ranking) that is callable"),
    (MetricFamily("Hit", " ", hit_rate), "give it a description (one line of text)"),
    (MetricFamily("Hit", "two\nlines", hit_rate), "give it a description (one line of text)"),
    (MetricFamily("MRR", "d", hit_rate, at_k=False, selectable=True), "give it at_k=True to be selectable"),
])
def test_a_bad_metric_family_fails_its_plugin_in_one_line(family, error):
    registry = build_registry(extra_plugins=[("bad", plugin_adding(family))], load_entry_points=False)
    (failure,) = registry.failures_of("bad")
    assert error in failure.error and "\n" not in failure.error
    assert registry.metrics == {}


def test_a_family_registered_twice_is_rejected_alone():
    other, found = MetricFamily("Hit", "another hit rate", hit_rate), MetricFamily("Found", "d", hit_rate)
    registry = build_registry(extra_plugins=[("hits", plugin_adding(HIT)), ("clash", plugin_adding(other, found))],
                              load_entry_points=False)
    (failure,) = registry.failures_of("clash")
    assert "metric family 'Hit' is registered twice: by hits (<in-process>) and by clash (<in-process>)" in \
        failure.error
    assert registry.metric_families() == (HIT, found)


@pytest.mark.parametrize("returned, error", [
    ({"Bad@1": 1.0}, "metric family 'Bad' returned ['Bad@1']; it must return a dict of exactly Bad@1, Bad@3"),
    ([1.0, 2.0], "metric family 'Bad' returned list; it must return a dict of exactly Bad@1, Bad@3"),
    ({"Bad@1": 1.0, "Bad@3": "high"}, "metric family 'Bad' returned 'high' for Bad@3; give a number"),
])
def test_a_family_returning_other_keys_or_values_is_one_line(returned, error):
    bad = MetricFamily("Bad", "returns what it should not", lambda ranking: returned)
    with pytest.raises(XmcError) as raised:
        evaluate(PREDICTED, TRUTH, ks=(1, 3), families=[bad])
    assert str(raised.value) == error


def test_a_family_needing_propensities_is_left_out_without_them():
    weighted = MetricFamily("W", "inverse propensities of the hits", lambda ranking: {
        f"W@{k}": float(ranking.gain_at[:, j].sum()) for j, k in enumerate(ranking.ks)}, needs_propensities=True)
    assert evaluate(PREDICTED, TRUTH, ks=(1, 3), families=[weighted]) == {}
    # hits of labels 2 (doc1, rank 1) and 0 (doc0, rank 2): weights 3 and 1
    assert evaluate(PREDICTED, TRUTH, ks=(1, 3), inv_propensity=INV_PROPENSITY, families=[weighted]) == \
        {"W@1": 3.0, "W@3": 4.0}
    undeclared = MetricFamily("W", "reads propensities without saying so", weighted.compute)
    with pytest.raises(XmcError, match="needs_propensities=True"):
        evaluate(PREDICTED, TRUTH, ks=(1, 3), families=[undeclared])


def test_a_family_without_k_has_one_key_and_its_own_column():
    mrr = MetricFamily("MRR", "mean reciprocal rank of the first hit", lambda ranking: {"MRR": float(np.mean(
        np.where(ranking.hits.any(axis=1), 1.0 / (ranking.hits.argmax(axis=1) + 1), 0.0)))}, at_k=False)
    metrics = evaluate(PREDICTED, TRUTH, ks=(1, 3), families=(*BUILTIN_FAMILIES, mrr))
    assert metrics["MRR"] == pytest.approx((1 / 2 + 1) / 4) and list(metrics)[-1] == "MRR"
    assert format_metrics(metrics, (*BUILTIN_FAMILIES, mrr)).endswith(f"R@3 {metrics['R@3']:.2f}  MRR 0.38")


def test_keys_no_family_knows_are_shown_after_the_known_ones():
    assert format_metrics({"Zed@5": 1.0, "other": 6.0, "Abc@10": 4.0, "coverage": 3.0, "P@1": 2.0, "Abc@2": 5.0}) == \
        "P@1 2.00  coverage 3.00  Abc@2 5.00  Abc@10 4.00  Zed@5 1.00  other 6.00"


@pytest.mark.slow
def test_a_plugins_family_is_written_by_a_run_selects_its_epoch_and_is_scored_again(tiny_model_dir, tiny_dataset,
                                                                                    tmp_path):
    from xmcbench import saved
    from xmcbench.runs import launch
    from xmcbench.runs.plan import plan_run

    registry = build_registry(extra_plugins=[("hits", plugin_adding(HIT))])
    settings = [f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=2",
                "max_length=16", "threads=1", "hidden_size=8", "validation_size=8", "batch_size=8",
                "selection_metric=Hit@5"]
    with pytest.raises(XmcError, match="selection_metric='Hit@7' is not a validation metric; choose one of .*Hit@5"):
        plan_run(registry, "lightxml", str(tiny_dataset), set_options=settings[:-1] + ["selection_metric=Hit@7"])
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=settings)
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [key for key in metrics if key.startswith("Hit@")] == ["Hit@1", "Hit@3", "Hit@5"]
    assert list(metrics).index("Hit@1") > list(metrics).index("PSR@5")   # after xmcbench's own, as registered
    log = json.loads((run_dir / "training_log.json").read_text())
    # the epochs were compared on Hit@5 of the validation rows: a share of 8 documents
    assert len(log["validation"]) == 2 and all(record["score"] * 8 / 100 == pytest.approx(
        round(record["score"] * 8 / 100)) for record in log["validation"])
    assert saved.evaluate(run_dir, registry=registry)["Hit@5"] == pytest.approx(metrics["Hit@5"])
