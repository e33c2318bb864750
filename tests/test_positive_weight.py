"""`cluster-linear` with options.positive_weight=propensity: the recall loss weighs each label's positives by its
inverse propensity, only where a run is flat; the default recaller is the plain one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from xmcbench.config import Stage, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.interfaces import EpochContext, LabelInfo
from xmcbench.registry import build_registry
from xmcbench.testing import write_tiny_dataset
from xmcbench_lightxml.recaller import ClusterLinearRecaller, PropensityWeightedRecaller, build_cluster_linear
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run


def label_info(inverse):
    size = len(inverse)
    return LabelInfo(tuple(f"l{i}" for i in range(size)), None, np.ones(size, dtype=np.int64), np.asarray(inverse))


def test_the_default_recaller_is_the_plain_one():
    recaller = build_cluster_linear(TrainConfig(), 4, 3)
    assert type(recaller) is ClusterLinearRecaller and "positive_weights" not in recaller.state_dict()


def test_positives_weigh_their_inverse_propensity():
    config = dataclasses.replace(TrainConfig(), options={"positive_weight": "propensity"})
    recaller = build_cluster_linear(config, 4, 3)
    assert isinstance(recaller, PropensityWeightedRecaller)
    inverse = [1.0, 4.0, 10.0]
    recaller.start_epoch(EpochContext(Stage("joint"), 0, 2, label_info(inverse), map_documents=None, map_labels=None,
                                      recalled_clusters=None, encoder=None))
    assert recaller.positive_weights.tolist() == inverse, "kept as a buffer: a checkpoint carries it"
    logits = torch.tensor([[0.5, -1.0, 2.0], [-0.3, 0.2, -2.0]])
    targets = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    by_hand = -(torch.tensor(inverse) * targets * torch.nn.functional.logsigmoid(logits)
                + (1 - targets) * torch.nn.functional.logsigmoid(-logits)).mean()
    assert recaller.loss(logits, targets).item() == pytest.approx(by_hand.item(), rel=1e-6)
    plain = ClusterLinearRecaller(4, 3).loss(logits, targets)
    assert recaller.loss(logits, targets).item() > plain.item(), "the rare label's missed positive costs more"


@pytest.mark.parametrize("option, refusal", [
    ("options.positive_weight=propensity", "positive_weight=propensity weighs each label's positives"),
    ("options.head_init=pifa", "head_init=pifa starts each label's row at its documents"),
    ("options.logit_adjustment=0.5", "logit_adjustment offsets each label's logit by its prior"),
])
def test_a_run_with_label_clusters_is_refused_before_its_folder(tiny_model_dir, tmp_path, option, refusal):
    """The flat recaller's per-label options (this file's positive weights, test_head_init's PIFA rows)."""
    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "data")
    plan = plan_run(registry, "lightxml", str(data), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32",
        "threads=1", "hidden_size=8", "cluster_size=2", "top_clusters=2", option])
    with pytest.raises(XmcError, match=refusal):
        launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    assert not (tmp_path / "run").exists()
