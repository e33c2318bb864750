"""The cascade method end to end on a tiny tree (8 labels in 4 leaf clusters under 2 top nodes), its
components against the conformance suite, its presets and the rule that derives a tree for other datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from xmcbench import api
from xmcbench.indexing import num_clusters_for
from xmcbench.registry import build_registry
from xmcbench.testing import check_component, make_tiny_transformer, tiny_config, write_tiny_dataset
from xmcbench_cascade.encoder import build_transformer_levels, derived_level_layers, parse_level_layers
from xmcbench_cascade.methods import PRESETS, tree_for
from xmcbench_cascade.ranker import build_node_linear
from xmcbench.indexing import resolve_num_clusters
from xmcbench.runs.plan import plan_run

TREE = ["num_clusters=4", "tree_levels=2", "level_top=1", "top_clusters=2"]
SETTINGS = ["pretrained_weights=false", "max_length=16", "threads=1", "batch_size=8", "epochs=2", "lr=1e-3",
            "validation_size=8", "swa_every_steps=2", "swa_start_epoch=0", "checkpoint_every_steps=2", *TREE]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_transformer(tmp_path_factory.mktemp("tiny-bert"), num_layers=3)


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_tiny_dataset(tmp_path / "data")


def settings(tiny_model, *more):
    return [f"model_name={tiny_model}", *SETTINGS, *more]


def test_the_components_pass_the_conformance_suite(tiny_model):
    config = tiny_config(tiny_model, tree_levels=(2,), num_clusters=4)
    check_component("encoder", build_transformer_levels, config)
    check_component("ranker", build_node_linear, config)


def test_layers_per_level_follow_cascadexml_on_any_depth():
    assert derived_level_layers(4, 12) == ((5, 6), (8,), (10,), (12,))   # src/CascadeXML.py:75-80
    assert derived_level_layers(3, 12) == ((7, 8), (10,), (12,))
    assert derived_level_layers(4, 6) == ((2, 3), (4,), (5,), (6,))       # all-MiniLM-L6-v2
    assert parse_level_layers("5-6,8,10,12", 4, 12) == ((5, 6), (8,), (10,), (12,))
    with pytest.raises(Exception, match="must name 4 groups"):
        parse_level_layers("5-6,8,10", 4, 12)


def test_the_derived_tree_reproduces_the_published_one_at_wiki500k_and_scales_down():
    assert tree_for(501_070) == (65536, (1024, 8192), (128, 256), 512)   # README.md:30 of xmc-aalto/cascadexml
    assert PRESETS["wiki500k"]["tree_levels"] == (1024, 8192) and PRESETS["wiki500k"]["top_clusters"] == 512
    leaves, levels, keep, top = tree_for(20_813)   # debian-builddeps
    assert leaves == 4096 and levels == (64, 512) and keep == (16, 128) and top == 256
    assert tree_for(100) == (16, (), (), 4)   # too few labels for a level above the leaves: LightXML's shape


def test_a_dataset_without_preset_gets_the_derived_tree(tiny_model, dataset):
    plan = plan_run(build_registry(), "cascade", str(dataset), set_options=[f"model_name={tiny_model}"])
    labels = plan.statistics.labels   # leaf clusters of about 8 labels: one, on this tiny set
    assert resolve_num_clusters(plan.config, labels) == tree_for(labels)[0] == 1
    assert plan.config.tree_levels == ()
    assert "tree_levels" in plan.derived and plan.config.encoder == "transformer-levels"
    # the paper's head_lr 1e-3 goes with its presets' 15 epochs; the derived epochs come with the derived rate
    assert "head_lr" in plan.derived and plan.config.head_lr == plan.derived["head_lr"].value == 1e-2
    assert all(preset["head_lr"] == 1e-3 and preset["epochs"] == 15 for preset in PRESETS.values())


def test_a_cluster_size_the_user_sets_wins_over_the_derived_tree(tiny_model, dataset):
    # README's resolution order: --set wins over anything derived from the dataset, num_clusters included
    plan = plan_run(build_registry(), "cascade", str(dataset),
                           set_options=[f"model_name={tiny_model}", "cluster_size=2"])
    labels = plan.statistics.labels
    assert plan.config.cluster_size == 2 and "num_clusters" not in plan.derived
    assert resolve_num_clusters(plan.config, labels) == num_clusters_for(labels, 2) > tree_for(labels)[0]


@pytest.mark.slow
def test_run_predict_evaluate_and_ensemble_like_any_method(tiny_model, dataset, tmp_path):
    runs = [api.train("cascade", str(dataset), output=tmp_path / f"seed{seed}", seed=seed, log=None,
                      set_options=settings(tiny_model)) for seed in (0, 1)]
    log = json.loads((runs[0].path / "training_log.json").read_text())
    assert {"recall", "rank"} <= set(log["steps"][0]) and log["swa_updates"] > 0
    config = json.loads((runs[0].path / "config.json").read_text())["config"]
    assert config["tree_levels"] == [2] and config["level_top"] == [1]
    predictor = api.load(runs[0].path)
    (found,) = predictor.predict(["python interpreter module"], 3)
    assert len(found["labels"]) == 3 and found["scores"] == sorted(found["scores"], reverse=True)
    assert api.evaluate(runs[0].path)["P@1"] == pytest.approx(runs[0].metrics["P@1"])
    from xmcbench.ensemble import build_ensemble

    ensemble = build_ensemble([run.path for run in runs], tmp_path / "ensemble")
    assert "P@1" in api.evaluate(ensemble)


DRIVER = textwrap.dedent("""
    import os, signal, sys
    from xmcbench import training
    from xmcbench.cli import main
    at_step = int(sys.argv[1])
    original_step = training.Trainer.train_step

    def train_step(self, rows, stage):
        original_step(self, rows, stage)
        if self.step == at_step:
            os.kill(os.getpid(), signal.SIGINT)

    training.Trainer.train_step = train_step
    sys.argv = ["xmcbench"] + sys.argv[2:]
    main()
""")


@pytest.mark.slow
def test_resume_continues_exactly(tiny_model, dataset, tmp_path):
    def args(output):
        return ["run", "cascade", "--dataset", str(dataset), "--output", str(output)] + \
            [part for setting in settings(tiny_model) for part in ("--set", setting)]

    environment = {**os.environ}
    whole = subprocess.run([sys.executable, "-m", "xmcbench", *args(tmp_path / "whole")], capture_output=True,
                           text=True, env=environment)
    assert whole.returncode == 0, whole.stderr
    stopped = subprocess.run([sys.executable, "-c", DRIVER, "3", *args(tmp_path / "stopped")], capture_output=True,
                             text=True, env=environment)
    assert stopped.returncode != 0 and "xmcbench run --resume" in stopped.stderr, stopped.stderr
    resumed = subprocess.run([sys.executable, "-m", "xmcbench", "run", "--resume", str(tmp_path / "stopped")],
                             capture_output=True, text=True, env=environment)
    assert resumed.returncode == 0, resumed.stderr
    first, second = (load_file(str(tmp_path / name / "model" / "weights.safetensors")) for name in ("whole", "stopped"))
    assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)
