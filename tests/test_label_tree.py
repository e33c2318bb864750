"""Deeper label trees (TrainConfig.tree_levels): levels of nodes between the recaller's and the leaf clusters,
each scored by a ranker on the children of the nodes the level above kept. LightXML is the case without such
levels; any method's components work at every level (here LightXML's own)."""

from __future__ import annotations

import json

import pytest
import torch

from xmcbench.config import TrainConfig, apply_overrides
from xmcbench.errors import XmcError
from xmcbench.interfaces import LabelClusters, tree_level_clusters
from xmcbench.modelio import build_model
from xmcbench.registry import build_registry
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run

# 8 labels in 4 leaf clusters of 2, under 2 top nodes
CLUSTERS = LabelClusters.from_assignment(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 4)


def tree_config(tiny_model_dir, **more) -> TrainConfig:
    values = {"encoder": "transformer-cls", "recaller": "cluster-linear", "ranker": "bottleneck",
              "sampler": "dynamic", "model_name": str(tiny_model_dir), "pretrained_weights": False,
              "num_layers": 2, "hidden_size": 8, "tree_levels": "2", "level_top": "1", "top_clusters": 2, **more}
    return apply_overrides(TrainConfig(), values, "test")


def test_tree_levels_follow_the_clusterings_binary_tree():
    upper, leaves = tree_level_clusters(8, (2, 4))
    assert upper.label_cluster.tolist() == [0, 0, 1, 1] and leaves.label_cluster.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert leaves.cluster_labels.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("values, message", [
    ({"tree_levels": "8,4"}, "increasing powers of two"), ({"tree_levels": "3"}, "increasing powers of two"),
    ({"tree_levels": "2,4", "level_top": "1"}, "one count per tree level"),
    ({"tree_levels": "1,x"}, "list of positive integers"),
])
def test_bad_tree_settings_are_one_line(values, message):
    with pytest.raises(XmcError, match=message) as error:
        apply_overrides(TrainConfig(), values, "--set").validate("--set")
    assert "\n" not in str(error.value)


def test_the_order_of_counts_is_kept():
    config = apply_overrides(TrainConfig(), {"tree_levels": "2,8", "level_top": "64,64"}, "--set")
    assert config.tree_levels == (2, 8) and config.level_top == (64, 64)


def test_a_tree_needs_more_leaf_clusters_than_its_last_level(tiny_model_dir):
    with pytest.raises(XmcError, match="fewer nodes than the 4 leaf clusters"):
        build_model(build_registry(), tree_config(tiny_model_dir, tree_levels="4", level_top="1"), CLUSTERS)


def test_every_level_trains_and_the_scores_chain_down_the_tree(tiny_model_dir):
    torch.manual_seed(0)
    model = build_model(build_registry(), tree_config(tiny_model_dir), CLUSTERS)
    assert model.recaller.num_clusters == 2 and len(model.tree_levels) == 1
    assert model.tree_levels[0].sampler.top_clusters == 1   # built with the nodes its level keeps
    assert len(list(model.parts()["ranker"].parameters())) == 2 * 3   # two bottleneck rankers: the level's, the labels'
    ids, mask = torch.randint(1000, 2000, (3, 6)), torch.ones(3, 6, dtype=torch.long)
    positives = torch.tensor([[0, 1], [2, -1], [7, 4]])
    loss, parts = model.training_loss(ids, mask, positives, torch.arange(3))
    assert set(parts) == {"recall", "rank"} and torch.isfinite(loss)
    loss.backward()
    for part in (model.encoder, model.recaller, model.tree_levels[0].ranker, model.ranker):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())
    # ancestors of the positives at the leaf-cluster level, each once: labels 0 and 1 share cluster 0
    assert model._distinct_nodes(positives, 1).tolist() == [[0, -1], [1, -1], [2, 3]]

    model.eval()
    (labels, scores), leaves = model.predict_top(ids, mask, top_clusters=2, top_k=4)
    top = model.top_nodes(ids, mask, 0, 1)   # the one top node each document keeps
    assert leaves.shape == (3, 2) and (leaves // 2 == top).all()   # the leaves kept are that node's children
    for row in range(3):
        kept = [label for label in labels[row].tolist() if label >= 0]
        assert kept and all(CLUSTERS.label_cluster[label] in leaves[row] for label in kept)
    with torch.no_grad():   # a label's score is its probability times its leaf cluster's
        representation = model.encoder(ids, mask)
        leaf_logits = model.tree_levels[0].ranker(representation, leaves)
        label = labels[0, 0]
        leaf_probability = torch.sigmoid(leaf_logits[0, (leaves[0] == CLUSTERS.label_cluster[label]).nonzero()[0, 0]])
        label_probability = torch.sigmoid(model.ranker(representation, label.view(1, 1)))[0, 0]
    assert scores[0, 0] == pytest.approx(float(leaf_probability * label_probability), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lightxml", "lightxml-static"])
def test_lightxmls_methods_run_in_a_deeper_tree(method, tiny_model_dir, tiny_dataset, tmp_path):
    """The static sampler draws its fixed candidates from the nodes the level above its own keeps."""
    registry = build_registry()
    plan = plan_run(registry, method, str(tiny_dataset), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "hidden_size=8",
        "max_length=16", "threads=1", "epochs=1", "refit_epochs=1", "num_clusters=4", "tree_levels=2",
        "level_top=2", "top_clusters=3", "validation_size=8"])   # more leaf clusters kept than the recaller has nodes
    run = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    metrics = json.loads((run / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100 and "coverage" in " ".join(metrics)


def test_a_level_top_given_for_derived_levels_waits_for_them(tiny_model_dir, tiny_dataset):
    """A method that derives its tree: the user keeps the derived levels and sets only how many nodes each keeps."""
    import types

    from xmcbench.config import MethodSpec
    from xmcbench.defaults import Derived
    from xmcbench.hookspecs import hookimpl

    lightxml_defaults = build_registry().method("lightxml").defaults

    def derived_tree(statistics, device):
        return {"num_clusters": Derived(4, "test", "test"), "tree_levels": Derived((2,), "test", "test")}

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("deeper", "LightXML with a derived tree",
                                       defaults=lightxml_defaults, derive=derived_tree))

    plugin = types.ModuleType("deeper_plugin")
    plugin.xmcbench_register_methods = xmcbench_register_methods
    registry = build_registry(extra_plugins=[("deeper", plugin)])
    options = [f"model_name={tiny_model_dir}", "pretrained_weights=false", "level_top=1"]
    plan = plan_run(registry, "deeper", str(tiny_dataset), set_options=options)
    assert plan.config.tree_levels == (2,) and plan.config.level_top == (1,)
    with pytest.raises(XmcError, match=r"level_top=1 must give one count per tree level \(0") as error:
        plan_run(registry, "lightxml", str(tiny_dataset), set_options=options)   # derives no levels
    assert "\n" not in str(error.value)


def test_the_core_names_no_method_that_uses_deeper_trees():
    from pathlib import Path

    import xmcbench

    for path in Path(xmcbench.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "xmcbench_cascade" not in text and '"cascade"' not in text and "'cascade'" not in text, path
