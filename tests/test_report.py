"""Reports are pure functions of saved run directories: statistics, paired tests, tables, figures, CLI.

The fixture runs (tests/fixtures/report/results) are two methods x three seeds with the hand-chosen numbers
below, a 5-step training log each, a model's own encoder/config.json inside one run (must not count as a
run) and one interrupted run (config.json, no metrics.json)."""

import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from xmcbench import report
from xmcbench.cli import app
from xmcbench.errors import XmcError

FIXTURES = Path(__file__).parent / "fixtures" / "report" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COLUMNS = ["P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "PSP@1", "PSP@3", "PSP@5", "coverage"]
METRICS = {   # method -> seed -> values of COLUMNS, as written in the fixtures
    "lightxml": [[80.0, 60.0, 45.0, 80.0, 70.0, 72.0, 40.0, 42.0, 44.0, 90.0],
                 [81.0, 61.0, 45.5, 81.0, 71.0, 72.5, 41.0, 43.0, 45.0, 91.0],
                 [82.5, 61.5, 46.5, 82.5, 72.0, 73.5, 42.0, 44.5, 46.0, 92.0]],
    "lightxml-static": [[78.0, 59.0, 44.0, 78.0, 69.0, 71.0, 38.5, 41.0, 43.0, 88.0],
                        [79.5, 59.5, 44.5, 79.5, 69.5, 71.5, 39.0, 42.5, 44.0, 90.5],
                        [80.0, 61.0, 45.0, 80.0, 71.5, 72.0, 41.5, 43.0, 45.0, 89.0]],
}
TRAIN_SECONDS = {"lightxml": [600.0, 620.0, 610.0], "lightxml-static": [500.0, 520.0, 505.0]}
PREDICT_MS = {"lightxml": [2.0, 2.1, 1.9], "lightxml-static": [2.2, 2.0, 2.1]}


def column(method, name):
    return [seed_values[COLUMNS.index(name)] for seed_values in METRICS[method]]


@pytest.fixture
def results(tmp_path):
    """A copy of the fixture results, with fake weight files of known sizes (lightxml is the smaller)."""
    folder = tmp_path / "results"
    shutil.copytree(FIXTURES, folder)
    for method, size in (("lightxml", 100 * 1024), ("lightxml-static", 200 * 1024)):
        for seed in range(3):
            (folder / method / f"seed{seed}" / "model").mkdir(exist_ok=True)
            (folder / method / f"seed{seed}" / "model" / "weights.safetensors").write_bytes(b"\0" * size)
    return folder


@pytest.fixture
def runs(results):
    return report.load_runs([results], log=lambda line: None)


def by_method(rows):
    return {row["method"]: row for row in rows}


def test_load_runs_finds_runs_recursively_and_skips_unfinished(results):
    messages = []
    runs = report.load_runs([results], log=messages.append)
    assert sorted((r.method, r.seed) for r in runs) == [(m, s) for m in ("lightxml", "lightxml-static")
                                                        for s in range(3)]
    assert len(messages) == 1 and "skipped 1 unfinished run" in messages[0] and "lightxml-seed3" in messages[0]
    run = next(r for r in runs if r.method == "lightxml" and r.seed == 1)
    assert run.dataset == "debian-debtags-mini" and run.model_bytes == 100 * 1024
    assert [run.metrics[c] for c in COLUMNS] == METRICS["lightxml"][1]
    assert "test_documents" not in run.metrics
    assert len(run.losses) == 5 and run.losses[0]["step"] == 1
    assert run.timings["train_seconds"] == 620.0 and run.environment["processor"] == "x86_64"
    # a run directory named directly, and the same run twice, give it once
    again = report.load_runs([results / "lightxml" / "seed1", results / "lightxml" / "seed1"])
    assert [r.path for r in again] == [results / "lightxml" / "seed1"]


@pytest.mark.parametrize("make_path, message", [
    (lambda root: root / "missing", "does not exist"),
    (lambda root: root / "empty", "holds no xmcbench runs"),
    (lambda root: root / "results" / "interrupted", "only 1 unfinished run"),
    (lambda root: root / "results" / "lightxml" / "seed0" / "metrics.json", "is not a run directory"),
])
def test_load_runs_rejects_a_bad_path_in_one_line(results, make_path, message):
    (results.parent / "empty").mkdir()
    with pytest.raises(XmcError) as error:
        report.load_runs([results / "lightxml", make_path(results.parent)])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_means_and_sample_stds_over_seeds(runs):
    rows = report.summarize(runs)
    assert [r["method"] for r in rows] == ["lightxml", "lightxml-static"]
    for method, row in by_method(rows).items():
        assert row["n_seeds"] == 3 and row["seeds"] == [0, 1, 2] and row["vs_baseline"] is None
        assert "nDCG@1" not in row["stats"]   # always equal to P@1: no column of its own
        for name in COLUMNS:
            if name == "nDCG@1":
                continue
            assert row["stats"][name]["mean"] == pytest.approx(statistics.mean(column(method, name)))
            assert row["stats"][name]["std"] == pytest.approx(statistics.stdev(column(method, name)))
        assert row["stats"]["train_seconds"]["mean"] == pytest.approx(statistics.mean(TRAIN_SECONDS[method]))
        assert row["stats"]["predict_ms_per_document"]["std"] == pytest.approx(statistics.stdev(PREDICT_MS[method]))
    assert rows[0]["stats"]["model_mb"]["mean"] == pytest.approx(100 / 1024)
    assert "peak_gpu_mb" not in rows[0]["stats"]
    single = report.summarize([r for r in runs if r.seed == 0])
    assert single[0]["stats"]["P@1"] == {"mean": 80.0, "std": None, "n": 1, "values": [80.0]}
    assert "80.00 ± —" in report.render_table(single, "github")


def test_paired_t_test_matches_scipy_and_pairs_by_seed(runs):
    rows = by_method(report.summarize(list(reversed(runs)), baseline="lightxml"))
    assert rows["lightxml"]["is_baseline"] and rows["lightxml"]["vs_baseline"] is None
    versus = rows["lightxml-static"]["vs_baseline"]
    for name in ("P@1", "P@3", "nDCG@3", "PSP@1"):
        expected = stats.ttest_rel(column("lightxml-static", name), column("lightxml", name)).pvalue
        assert versus[name]["p_value"] == pytest.approx(expected, rel=1e-12)
        assert versus[name]["diff"] == pytest.approx(np.mean(column("lightxml-static", name))
                                                     - np.mean(column("lightxml", name)))
        assert versus[name]["n_pairs"] == 3
    expected = stats.ttest_rel(TRAIN_SECONDS["lightxml-static"], TRAIN_SECONDS["lightxml"]).pvalue
    assert versus["train_seconds"]["p_value"] == pytest.approx(expected)
    # PSP@5 differs by exactly 1.0 on every seed: no variance, so no test
    assert versus["PSP@5"]["diff"] == pytest.approx(-1.0) and versus["PSP@5"]["p_value"] is None
    # fewer than three paired seeds: the difference alone, no p-value (see also the 2-seed test at the end)
    few = by_method(report.summarize([r for r in runs if r.method == "lightxml" or r.seed == 2], "lightxml"))
    assert few["lightxml-static"]["vs_baseline"]["P@1"]["n_pairs"] == 1
    assert few["lightxml-static"]["vs_baseline"]["P@1"]["p_value"] is None
    assert "80.00 ± — (-1.17) |" in report.render_table(list(few.values()), "github")


def test_unknown_baseline_is_one_line(runs):
    with pytest.raises(XmcError, match="did you mean 'lightxml'"):
        report.summarize(runs, baseline="lightxm")


def test_best_value_per_column_including_lower_is_better(runs):
    rows = by_method(report.summarize(runs))
    assert set(COLUMNS) - {"nDCG@1"} <= set(rows["lightxml"]["best"])   # every metric is higher for lightxml
    assert "predict_ms_per_document" in rows["lightxml"]["best"]     # 2.0 < 2.1 ms: lower is better
    assert "model_mb" in rows["lightxml"]["best"] and "peak_rss_mb" in rows["lightxml"]["best"]
    assert rows["lightxml-static"]["best"] == ["train_seconds"]      # 508 s < 610 s


def test_three_formats_render(runs):
    rows = report.summarize(runs, baseline="lightxml")
    github = report.render_table(rows, "github")
    assert "**81.17 ± 1.26**" in github and "| lightxml (baseline)" in github
    assert "**508.3 ± 10.4** (-101.7, p<0.001)" in github and "(+0.10, p=0.423)" in github and "(-1.00, n/a)" in github
    latex = report.render_table(rows, "latex")
    assert r"\begin{tabular}" in latex and r"\textbf{81.17 $\pm$ 1.26}" in latex
    parsed = json.loads(report.render_table(rows, "json"))
    assert parsed["rows"][0]["stats"]["P@1"]["mean"] == pytest.approx(81.1666666)
    assert "train_seconds" in parsed["rows"][1]["best"] and "train_seconds" in parsed["lower_is_better"]
    assert "ttest_rel" in parsed["paired_test"]
    with pytest.raises(XmcError, match="unknown report format 'html'"):
        report.render_table(rows, "html")


def test_variants_and_datasets_get_their_own_rows(results):
    extra = results / "other" / "lightxml-seed0"
    shutil.copytree(results / "lightxml" / "seed0", extra)
    config = json.loads((extra / "config.json").read_text())
    config["dataset_name"] = "debian-builddeps"
    (extra / "config.json").write_text(json.dumps(config))
    variant = results / "lightxml-epochs1"
    shutil.copytree(results / "lightxml" / "seed2", variant)
    config = json.loads((variant / "config.json").read_text())
    config["config"]["epochs"] = 1
    (variant / "config.json").write_text(json.dumps(config))
    runs = report.load_runs([results], log=lambda line: None)
    rows = report.summarize(runs, baseline="lightxml (epochs=3)")
    assert [(r["dataset"], r["method"], r["n_seeds"]) for r in rows] == [
        ("debian-debtags-mini", "lightxml (epochs=3)", 3), ("debian-debtags-mini", "lightxml (epochs=1)", 1),
        ("debian-debtags-mini", "lightxml-static", 3), ("debian-builddeps", "lightxml", 1)]
    assert rows[3]["baseline"] is None and rows[3]["best"] == []   # alone on its dataset
    table = report.render_table(rows, "github")
    assert table.index("**debian-debtags-mini**") < table.index("**debian-builddeps**")
    with pytest.raises(XmcError, match="ambiguous"):
        report.summarize(runs, baseline="lightxml")
    text = report.write_report(runs, results.parent / "out").read_text()
    assert "### debian-debtags-mini" in text and "### debian-builddeps" in text


def test_figures_are_png(runs, tmp_path):
    report.plot_loss_curves(runs, tmp_path / "loss.png")
    report.plot_precision(report.summarize(runs), tmp_path / "precision.png")
    for run in runs:
        run.losses = []
    report.plot_loss_curves(runs, tmp_path / "empty.png")   # no training logs: a plot that says so
    for name in ("loss.png", "precision.png", "empty.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_two_runs_with_one_seed_are_refused(results):
    shutil.copytree(results / "lightxml" / "seed0", results / "again")
    with pytest.raises(XmcError, match="with seed 0; pass only one of them"):
        report.summarize(report.load_runs([results], log=lambda line: None))


def test_write_report(runs, tmp_path):
    path = report.write_report(runs, tmp_path / "report", baseline="lightxml", fmt="latex",
                               command="xmcbench report results --baseline lightxml")
    assert path == tmp_path / "report" / "report.md"
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["loss_curves.png", "precision.png", "report.md", "table.tex"]
    for figure in ("loss_curves.png", "precision.png"):
        assert (path.parent / figure).read_bytes()[:8] == PNG_MAGIC
    text = path.read_text()
    assert text.startswith("# xmcbench report") and "xmcbench report results --baseline lightxml" in text
    assert "Seeds: lightxml: 0, 1, 2; lightxml-static: 0, 1, 2" in text
    assert "sentence-transformers/all-MiniLM-L6-v2" in text and "x86_64" in text and "2 CPU threads" in text
    assert "`epochs=3`" in text and "`head_lr=0.001`" in text and "`sampler=static`" in text
    assert "`seed=" not in text
    assert "ttest_rel" in text and "**81.17 ± 1.26**" in text
    assert "![" in text and "](loss_curves.png)" in text and "](precision.png)" in text


def test_report_command_writes_the_files(results, tmp_path):
    output = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", str(results), "--baseline", "lightxml", "--format", "json",
                                      "--output", str(output)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in output.iterdir()) == ["loss_curves.png", "precision.png", "report.md",
                                                        "table.json"]
    assert json.loads((output / "table.json").read_text())["rows"][1]["vs_baseline"]["P@1"]["n_pairs"] == 3
    assert "skipped 1 unfinished run" in result.output and "report.md" in result.output
    assert f"xmcbench report {results} --baseline lightxml --format json" in (output / "report.md").read_text()
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert isinstance(bad.exception, XmcError) and "does not exist" in str(bad.exception)


def add_frequency_bins(results):
    """Give each fixture run frequency bins whose P@5 contributions are known: (seed + 1) in bin "1", the
    rest of its P@5 in ">1000" (lightxml-static: 0 in "1"); no labels in the other bins but "4-10"."""
    names = ["0", "1", "2-3", "4-10", "11-30", "31-100", "101-300", "301-1000", ">1000"]
    labels = [0, 10, 0, 20, 0, 0, 0, 0, 70]
    for method in ("lightxml", "lightxml-static"):
        for seed in range(3):
            path = results / method / f"seed{seed}" / "metrics.json"
            metrics = json.loads(path.read_text())
            tail = float(seed + 1) if method == "lightxml" else 0.0
            contributions = {"1": tail, ">1000": metrics["P@5"] - tail}
            metrics["frequency_bins"] = {"k": 5, "bins": [
                {"bin": name, "min_count": 0, "max_count": 0, "labels": count, "label_share": float(count),
                 "test_positive_share": float(count), "P@5_contribution": contributions.get(name, 0.0)}
                for name, count in zip(names, labels)]}
            path.write_text(json.dumps(metrics))


def test_head_and_tail_table_and_figure(results, tmp_path):
    add_frequency_bins(results)
    runs = report.load_runs([results], log=lambda line: None)
    tables = report.summarize_frequency_bins(runs)
    assert len(tables) == 1
    table = tables[0]
    assert table["k"] == 5 and table["bins"] == ["1", "4-10", ">1000"]   # bins without labels are left out
    assert table["label_share"] == [10.0, 20.0, 70.0]
    rows = {row["method"]: row for row in table["rows"]}
    assert rows["lightxml"]["mean"][0] == pytest.approx(2.0) and rows["lightxml"]["std"][0] == pytest.approx(1.0)
    static_p5 = statistics.mean(column("lightxml-static", "P@5"))
    assert rows["lightxml-static"]["mean"] == pytest.approx([0.0, 0.0, static_p5])
    text = report.render_frequency_bins(table)
    assert "**2.00**" in text and "all (= P@5)" in text
    assert f"{statistics.mean(column('lightxml', 'P@5')):.2f}" in text.splitlines()[-1]
    path = report.write_report(runs, tmp_path / "report")
    assert (path.parent / "frequency_bins.png").read_bytes()[:8] == PNG_MAGIC
    assert "## Head and tail" in path.read_text()
    # a run without bins (made before they were recorded) is left out of the table, not an error
    metrics = json.loads((results / "lightxml" / "seed0" / "metrics.json").read_text())
    metrics.pop("frequency_bins")
    (results / "lightxml" / "seed0" / "metrics.json").write_text(json.dumps(metrics))
    rows = report.summarize_frequency_bins(report.load_runs([results], log=lambda line: None))[0]["rows"]
    assert {row["method"]: row["n_seeds"] for row in rows} == {"lightxml": 2, "lightxml-static": 3}


def test_zero_shot_section(results, tmp_path):
    """lightxml's seeds recorded R@5 10, 20, 30 over 40 unseen labels; lightxml-static recorded 0 (it cannot score
    them) on two seeds and nothing on the third (a run made before the figures existed)."""
    for method in ("lightxml", "lightxml-static"):
        for seed in range(3):
            path = results / method / f"seed{seed}" / "metrics.json"
            metrics = json.loads(path.read_text())
            if method == "lightxml-static" and seed == 2:
                continue
            found = 10.0 * (seed + 1) if method == "lightxml" else 0.0
            metrics["zero_shot"] = {"labels": 40, "documents": 25, "positives": 50, "P@1": found / 2, "R@5": found}
            path.write_text(json.dumps(metrics))
    runs = report.load_runs([results], log=lambda line: None)
    [(dataset, table)] = report.render_zero_shot(runs)
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in table.splitlines()[2:]}
    assert [cell.strip() for cell in table.splitlines()[0].split("|")[5:7]] == ["P@1", "R@5"]
    assert rows["lightxml"] == ["3", "40", "50", "10.00 ± 5.00", "20.00 ± 10.00"]
    assert rows["lightxml-static"] == ["2", "40", "50", "0.00 ± 0.00", "0.00 ± 0.00"]
    assert "## Zero-shot labels" in report.write_report(runs, tmp_path / "report").read_text()
    # no run recorded any: no section
    for path in results.rglob("metrics.json"):
        metrics = json.loads(path.read_text())
        metrics.pop("zero_shot", None)
        path.write_text(json.dumps(metrics))
    assert "## Zero-shot" not in report.write_report(report.load_runs([results], log=lambda line: None),
                                                      tmp_path / "again").read_text()


def test_model_size_falls_back_to_the_size_recorded_when_the_run_finished(results):
    """Runs trained on another machine and copied without their model files, or with part of them, report the size
    they recorded when they finished."""
    seed0 = results / "lightxml" / "seed0"
    (seed0 / "model" / "weights.safetensors").unlink()
    timings = json.loads((seed0 / "timings.json").read_text())
    (seed0 / "timings.json").write_text(json.dumps({**timings, "model_bytes": 3 * 2**20}))
    (results / "lightxml" / "seed1" / "model" / "weights.safetensors").unlink()   # and nothing recorded
    seed2 = results / "lightxml" / "seed2"   # copied in part: what the run recorded wins over what is left
    timings = json.loads((seed2 / "timings.json").read_text())
    (seed2 / "timings.json").write_text(json.dumps({**timings, "model_bytes": 5 * 2**20}))
    sizes = {run.seed: run.values().get("model_mb") for run in report.load_runs([results], log=lambda line: None)
             if run.method == "lightxml"}
    assert sizes == {0: 3.0, 1: None, 2: 5.0}
    (seed2 / "timings.json").write_text(json.dumps(timings))   # a run older than the record: its files
    assert [run.values().get("model_mb") for run in report.load_runs([seed2], log=lambda line: None)] == [100 / 1024]


def add_more_metrics(results):
    """Give every fixture run R@k, PSR@k and PSnDCG@k at k = 1, 3, 5, 10 and P@10, PSP@10 (value: 10 * k plus
    the seed, plus 1 for lightxml), and the propensity record of metrics.json."""
    for method in ("lightxml", "lightxml-static"):
        for seed in range(3):
            path = results / method / f"seed{seed}" / "metrics.json"
            metrics = json.loads(path.read_text())
            bonus = seed + (1 if method == "lightxml" else 0)
            for k in (1, 3, 5, 10):
                for family in ("R", "PSR", "PSnDCG"):
                    metrics[f"{family}@{k}"] = 10.0 * k + bonus
            metrics.update({"P@10": 30.0 + bonus, "PSP@10": 40.0 + bonus, "nDCG@10": 50.0 + bonus,
                            "propensity": {"a": 0.55, "b": 1.5, "train_documents": 4244}})
            path.write_text(json.dumps(metrics))


def test_every_recorded_metric_family_gets_a_column(results, tmp_path):
    add_more_metrics(results)
    runs = report.load_runs([results], log=lambda line: None)
    rows = by_method(report.summarize(runs, baseline="lightxml"))
    stats = rows["lightxml"]["stats"]
    assert stats["PSR@10"]["mean"] == pytest.approx(102.0) and stats["R@3"]["std"] == pytest.approx(1.0)
    assert rows["lightxml-static"]["vs_baseline"]["PSR@5"]["diff"] == pytest.approx(-1.0)
    assert "PSR@10" in rows["lightxml"]["best"] and "nDCG@1" not in stats
    # the main table: P@1/3/5 and PSP@1/3/5 (and coverage, costs); everything else in "more metrics" tables
    main = report.render_table(list(rows.values()), "github").splitlines()[0]
    assert "PSP@5" in main and "P@10" not in main and "nDCG" not in main and "R@1" not in main
    tables = dict(report.more_tables(list(rows.values())))
    assert tables == {
        "nDCG@k and PSnDCG@k": ["nDCG@3", "nDCG@5", "nDCG@10", "PSnDCG@1", "PSnDCG@3", "PSnDCG@5", "PSnDCG@10"],
        "R@k and PSR@k": ["R@1", "R@3", "R@5", "R@10", "PSR@1", "PSR@3", "PSR@5", "PSR@10"],
        "P@k and PSP@k at further k": ["P@10", "PSP@10"]}
    text = report.write_report(runs, tmp_path / "report", baseline="lightxml").read_text()
    assert "More metrics: R@k and PSR@k" in text and " PSR@10 |" in text and " nDCG@1 |" not in text
    assert "A=0.55, B=1.5, 4244 training documents" in text
    assert "More metrics: nDCG@k and PSnDCG@k" in (tmp_path / "report" / "table.md").read_text()
    parsed = json.loads(report.render_table(list(rows.values()), "json"))
    assert "PSR@10" in parsed["columns"] and "nDCG@1" not in parsed["columns"]


def test_runs_written_before_a_setting_existed_are_no_variant(results, tmp_path):
    """A config.json without eval_ks (an older run) groups with one that records its default."""
    path = results / "lightxml" / "seed0" / "config.json"
    config = json.loads(path.read_text())
    config["config"]["eval_ks"] = [1, 3, 5]
    path.write_text(json.dumps(config))
    rows = report.summarize(report.load_runs([results], log=lambda line: None))
    assert [(r["method"], r["n_seeds"]) for r in rows] == [("lightxml", 3), ("lightxml-static", 3)]
    text = report.write_report(report.load_runs([results], log=lambda line: None), tmp_path / "r").read_text()
    assert "eval_ks" not in text and "not recorded (written by an older xmcbench" in text


def test_settings_an_older_whole_method_run_never_read_make_no_variant(results):
    """Up to rule version 3 a whole method's config.json recorded the device's batch size and SWA interval, which
    it never reads: a GPU machine's run and a CPU's are one row. A setting it does read still makes a variant."""
    def make_whole(seed, batch_size, rule_version, validation_size=500):
        path = results / "lightxml-static" / f"seed{seed}" / "config.json"
        config = json.loads(path.read_text())
        config["config"].update(batch_size=batch_size, validation_size=validation_size)
        config["derived"] = {key: {"value": config["config"][key], "source": "", "why": ""}
                             for key in ("batch_size", "validation_size")}
        config["rule_version"] = rule_version
        config.setdefault("resolved", {})["whole_method"] = "tests.WordVotes"
        path.write_text(json.dumps(config))

    def rows():
        return [(r["method"], r["n_seeds"]) for r in report.summarize(report.load_runs([results], log=lambda l: None))]

    make_whole(0, 32, 3)
    make_whole(1, 16, 3)
    make_whole(2, 16, 3)
    assert rows() == [("lightxml", 3), ("lightxml-static", 3)]
    make_whole(2, 16, 3, validation_size=400)   # the split is read: a variant
    assert len(rows()) == 3
    make_whole(2, 16, 3)
    make_whole(0, 32, 4)   # rule version 4 derives no batch size for a whole method: one set explicitly counts
    assert len(rows()) == 3


def test_pooled_settings_keep_a_method_one_row_with_its_seeds_paired(results, tmp_path):
    """Runs of one method planned on two machines derived two lengths: --pool max_length makes them one row, whose
    seeds pair with the baseline's, and Setup says which seed had which value."""
    def set_on(seed, **settings):
        path = results / "lightxml" / f"seed{seed}" / "config.json"
        config = json.loads(path.read_text())
        for key, value in settings.items():
            if key.startswith("options."):
                config["config"].setdefault("options", {})[key[len("options."):]] = value
            else:
                config["config"][key] = value
        path.write_text(json.dumps(config))

    set_on(0, max_length=320)
    assert len(report.summarize(report.load_runs([results], log=lambda line: None))) == 3   # a variant without --pool
    output = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", str(results), "--baseline", "lightxml-static", "--pool", "max_length",
                                      "--format", "json", "--output", str(output)])
    assert result.exit_code == 0, result.output
    rows = json.loads((output / "table.json").read_text())["rows"]
    assert [(row["method"], row["n_seeds"]) for row in rows] == [("lightxml", 3), ("lightxml-static", 3)]
    assert rows[0]["vs_baseline"]["P@1"]["n_pairs"] == 3
    text = (output / "report.md").read_text()
    assert "--pool max_length" in text and "lightxml: `max_length` 320 (seed 0)" in text
    # an option pools the same way; a setting that does not differ is not listed
    set_on(1, **{"options.head_init": "pifa"})
    runs = report.load_runs([results], log=lambda line: None, pool=["max_length", "options.head_init"])
    assert [row["n_seeds"] for row in report.summarize(runs)] == [3, 3]
    with pytest.raises(XmcError, match=r"--pool max_len: not a setting runs record; .*max_length"):
        report.load_runs([results], log=lambda line: None, pool=["max_len"])
    with pytest.raises(XmcError, match="--pool seed"):   # the seed is what a row is made of
        report.load_runs([results], log=lambda line: None, pool=["seed"])


# -- p-values only from at least 3 paired seeds -----------------------------------------------------

def test_two_paired_seeds_give_the_difference_without_a_p_value(runs, tmp_path):
    two = [r for r in runs if r.seed in (0, 1)]
    rows = by_method(report.summarize(two, baseline="lightxml"))
    versus = rows["lightxml-static"]["vs_baseline"]["P@1"]
    assert versus["n_pairs"] == 2 and versus["p_value"] is None   # ttest_rel would give one: not shown
    assert versus["diff"] == pytest.approx(np.mean(column("lightxml-static", "P@1")[:2])
                                           - np.mean(column("lightxml", "P@1")[:2]))
    github = report.render_table(list(rows.values()), "github")
    assert "(-1.75) |" in github and "p=" not in github and "p<" not in github and "n/a" not in github
    assert "p=" not in report.render_table(list(rows.values()), "latex")
    note = "p-values need at least 3 paired seeds; 2 pair up here."
    assert note in json.loads(report.render_table(list(rows.values()), "json"))["paired_test"]
    text = report.write_report(two, tmp_path / "two", baseline="lightxml").read_text()
    assert note in text and "ttest_rel" in text and "p=" not in text
    # three seeds: p-values, and no such sentence
    three = report.write_report(runs, tmp_path / "three", baseline="lightxml").read_text()
    assert "p=0.423" in three and "p-values need" not in three


# -- degenerate runs ----------------------------------------------------------------------------------

def write_predictions(run_dir, first_labels, k=5, as_npz=False):
    """predictions.safetensors (labels (N, k) int64, -1 empty; scores) whose first column is `first_labels`,
    the other columns other labels; as_npz: predictions.npz (CSR scores, the first label scoring highest)."""
    from safetensors.numpy import save_file

    first = np.asarray(first_labels, dtype=np.int64)
    rest = (first[:, None] + 1 + np.arange(k - 1)[None, :]) % 506
    labels = np.concatenate([first[:, None], rest], axis=1)
    labels[first < 0] = -1
    scores = np.tile(np.linspace(0.9, 0.1, k, dtype=np.float32), (len(first), 1))
    if as_npz:
        import scipy.sparse as sp

        rows = np.repeat(np.arange(len(first)), k).reshape(len(first), k)
        kept = labels >= 0
        sp.save_npz(run_dir / "predictions.npz", sp.csr_matrix(
            (scores[kept], (rows[kept], labels[kept])), shape=(len(first), 506)))
    else:
        save_file({"labels": labels, "scores": scores}, str(run_dir / "predictions.safetensors"))


def test_a_run_with_a_constant_first_label_is_flagged(results, tmp_path):
    rng = np.random.default_rng(0)
    for method in ("lightxml", "lightxml-static"):
        for seed in range(3):
            write_predictions(results / method / f"seed{seed}", rng.integers(0, 506, size=200))
    degenerate = results / "lightxml-static" / "seed1"
    (degenerate / "model" / "labels.json").write_text(json.dumps([f"tag{i}" for i in range(506)]))
    write_predictions(degenerate, np.full(200, 17))
    write_predictions(results / "lightxml" / "seed2", np.r_[np.full(195, 3), np.arange(5)], as_npz=True)
    (results / "lightxml" / "seed2" / "predictions.safetensors").unlink()   # an npz alone is read too
    (results / "lightxml" / "seed1" / "predictions.safetensors").unlink()   # no predictions: not checked
    runs = {(r.method, r.seed): r for r in report.load_runs([results], log=lambda line: None)}
    assert runs[("lightxml-static", 1)].top1 == {"documents": 200, "distinct": 1, "share": 1.0, "label": 17}
    assert runs[("lightxml-static", 1)].degenerate
    assert runs[("lightxml", 2)].top1 == {"documents": 200, "distinct": 5, "share": 0.98, "label": 3}
    assert runs[("lightxml", 2)].degenerate
    assert runs[("lightxml", 1)].top1 is None and not runs[("lightxml", 1)].degenerate
    healthy = runs[("lightxml", 0)]
    assert not healthy.degenerate and healthy.top1["distinct"] > 100 and healthy.top1["share"] < 0.05

    rows = by_method(report.summarize(list(runs.values()), baseline="lightxml"))
    assert [(t["seed"], t["distinct"], t["share"], t["degenerate"]) for t in rows["lightxml-static"]["top1"]][1] \
        == (1, 1, 1.0, True)
    assert [t["seed"] for t in rows["lightxml"]["top1"]] == [0, 2]
    parsed = json.loads(report.render_table(list(rows.values()), "json"))
    assert parsed["rows"][1]["top1"][1]["share"] == 1.0 and "90%" in parsed["degenerate_rule"]

    text = report.write_report(list(runs.values()), tmp_path / "report", baseline="lightxml").read_text()
    checks = text[text.index("## Checks"):text.index("## Figures")]
    assert "**Degenerate: lightxml-static, seed 1** (seed1): `tag17` is first for 100.0% of 200 test documents; " \
           "distinct labels ever first: 1." in checks
    assert "**Degenerate: lightxml, seed 2** (seed2): label 3 is first for 98.0% of 200" in checks
    assert "1 run(s) saved no predictions and are not checked" in checks
    assert checks.count("**Degenerate") == 2


@pytest.mark.parametrize("share, distinct, labels, documents, flagged", [
    (1.0, 1, 506, 1206, True),        # every document: the same first label
    (0.92, 40, 506, 1206, True),      # nearly every document
    (0.6, 4, 506, 1206, True),        # most documents, and only a handful of labels are ever first
    (0.36, 11, 506, 1206, False),     # the least varied healthy run of reports/debian-debtags-mini-full
    (0.727, 48, 20813, 6788, False),  # a skewed dataset: healthy plt on reports/debian-builddeps-hybrid
    (0.6, 20, 20813, 6788, True),     # ... but fewer than 0.1% of its 20,813 labels ever first
    (1.0, 1, 506, 10, False),         # too few test documents to tell
])
def test_the_degenerate_rule(share, distinct, labels, documents, flagged):
    top1 = {"documents": documents, "distinct": distinct, "share": share, "label": 0}
    assert report.is_degenerate(top1, labels) is flagged


def test_no_checks_section_without_predictions_and_a_clean_one_with_healthy_runs(results, runs, tmp_path):
    assert "## Checks" not in report.write_report(runs, tmp_path / "none").read_text()
    rng = np.random.default_rng(1)
    for method in ("lightxml", "lightxml-static"):
        for seed in range(3):
            write_predictions(results / method / f"seed{seed}", rng.integers(0, 506, size=100))
    text = report.write_report(report.load_runs([results], log=lambda line: None), tmp_path / "healthy").read_text()
    assert "## Checks" in text and "No run is degenerate" in text and "**Degenerate" not in text


def test_a_weighted_hybrid_whose_seeds_rank_differently_says_both():
    # --fusion weighted keeps its stacked model on some seeds only; the seeds stay one row, and its line says so
    def seed(number, fusion):
        config = {"method": "weighted-ensemble(a+b)", "fusion": {"validation_documents": 40,
                                                                "objective": "the smallest lead", **fusion}}
        return report.RunResult(Path(f"s{number}"), "weighted-ensemble(a+b)", "d", number, config, {}, {}, {}, [], 0)

    weights = {"rule": "weighted", "member_methods": ["a", "b"], "weights": [0.7, 0.3]}
    stacked = {**weights, "rule": "stacked", "stacking": {"alpha": 0.3}}
    group = report._Group("d", "weighted-ensemble(a+b)", "weighted-ensemble(a+b)", [seed(0, weights), seed(1, stacked)])
    line, = report._fusion_lines([group], several_datasets=False)
    assert "weights chosen, or a stacked model fitted, on 40 validation documents" in line
    assert "seed 0: a 0.7, b 0.3" in line and "seed 1: a stacked model" in line
    group.runs = group.runs[1:]
    assert "a stacked model fitted on 40" in report._fusion_lines([group], several_datasets=False)[0]
    # tail slots, where the fit chose them, are named with their alpha; alpha 0 (none chosen) says nothing
    tailed = {**weights, "tail_slots": {"after": 4, "alpha": 0.5}}
    group.runs = [seed(0, tailed), seed(1, {**weights, "tail_slots": {"after": 4, "alpha": 0.0}})]
    line, = report._fusion_lines([group], several_datasets=False)
    assert "seed 0: a 0.7, b 0.3; places after the first 4 by score x (1 / propensity) ^ 0.5" in line
    assert "seed 1: a 0.7, b 0.3" in line and line.count("places after") == 1
