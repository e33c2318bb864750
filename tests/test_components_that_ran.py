"""A flat run (one logit per label) has no ranker and no sampler: it says so at the start — as a warning for a
method whose point is its ranker or negatives (MethodSpec.needs_ranker) — and config.json records what ran; a
method that trains its ranker in a stage of its own is refused before the run folder is touched."""

from __future__ import annotations

import json

import pytest

from xmcbench.errors import XmcError
from xmcbench.registry import build_registry
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run

TINY = ["pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32", "threads=1", "hidden_size=8"]


def tiny_run(registry, method, tiny_model_dir, tiny_dataset, output, *extra):
    plan = plan_run(registry, method, str(tiny_dataset),
                           set_options=[f"model_name={tiny_model_dir}", *TINY, *extra])
    lines: list[str] = []
    run_dir = launch.run(plan, output, registry=registry, log=lines.append)
    return json.loads((run_dir / "config.json").read_text())["resolved"], lines


@pytest.mark.slow
def test_a_flat_run_records_that_no_ranker_ran_and_warns_a_method_that_needs_one(tiny_model_dir, tiny_dataset,
                                                                                   tmp_path):
    registry = build_registry()
    resolved, lines = tiny_run(registry, "lightxml", tiny_model_dir, tiny_dataset, tmp_path / "flat")
    assert resolved["flat"] and resolved["components"] == {
        "encoder": "transformer-cls", "recaller": "cluster-linear", "ranker": "none (flat)", "sampler": "none (flat)"}
    note = [line for line in lines if "are not used" in line]
    assert len(note) == 1 and not note[0].startswith("warning") and "--set cluster_size=8" in note[0]

    _, lines = tiny_run(registry, "lightxml-random-neg", tiny_model_dir, tiny_dataset, tmp_path / "random")
    assert any(line.startswith("warning: flat run") and "'random'" in line for line in lines)

    resolved, lines = tiny_run(registry, "lightxml-random-neg", tiny_model_dir, tiny_dataset, tmp_path / "clustered",
                               "cluster_size=2", "top_clusters=2")
    assert resolved["components"]["ranker"] == "bottleneck" and resolved["components"]["sampler"] == "random"
    assert not any("are not used" in line for line in lines)


def test_a_flat_run_of_a_method_with_a_ranker_stage_is_refused_before_its_folder_exists(tiny_model_dir,
                                                                                        tiny_dataset, tmp_path):
    registry = build_registry()
    plan = plan_run(registry, "lightxml-static", str(tiny_dataset),
                           set_options=[f"model_name={tiny_model_dir}", *TINY])
    with pytest.raises(XmcError) as error:
        launch.run(plan, tmp_path / "static", registry=registry, log=lambda line: None)
    assert "lightxml-static trains a ranker in a stage of its own" in str(error.value)
    assert "--set cluster_size=8" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "static").exists()


@pytest.mark.slow
def test_the_report_says_which_components_ran(tiny_model_dir, tiny_dataset, tmp_path):
    from xmcbench import report

    registry = build_registry()
    tiny_run(registry, "lightxml", tiny_model_dir, tiny_dataset, tmp_path / "runs" / "flat")
    written = report.write_report(report.load_runs([tmp_path / "runs"], log=lambda line: None), tmp_path / "report")
    text = written.read_text()
    assert "- Components that ran (a flat run, one logit per label, has no ranker and no sampler): encoder " \
           "transformer-cls, recaller cluster-linear, ranker none (flat), sampler none (flat)" in text
