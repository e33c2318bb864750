"""xmcbench.testing: every registered component passes the conformance suite, and components broken in
each way it checks are caught with a message that names the component and the rule."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from xmcbench.candidates import candidates_with_positives, expand_clusters, positive_targets
from xmcbench.config import Option, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.interfaces import Candidates, Sampler
from xmcbench.registry import COMPONENT_KINDS, build_registry
from xmcbench.testing import (check_component, check_encoder, check_ranker, check_recaller, check_sampler,
                              conformance_config, tiny_config)
from xmcbench_lightxml.encoder import build_transformer_cls
from xmcbench_lightxml.ranker import BottleneckRanker
from xmcbench_lightxml.recaller import ClusterLinearRecaller
from xmcbench_lightxml.sampler import StaticSampler
from tests.test_registry import install_plugin, unique_package

REGISTRY = build_registry()
REGISTERED = [(kind, name) for kind in COMPONENT_KINDS for name in sorted(REGISTRY.components[kind])]


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> TrainConfig:
    return tiny_config(tiny_model_dir)


@pytest.mark.parametrize("kind, name", REGISTERED, ids=[f"{kind}-{name}" for kind, name in REGISTERED])
def test_every_registered_component_conforms(kind, name, config):
    """Built with the options its plugin registers for conformance; one that needs an option and registers
    none is skipped with the reason: an installed third-party plugin never turns this suite red for it."""
    built_with, reason = conformance_config(REGISTRY, kind, name, config)
    if built_with is None:
        pytest.skip(reason)
    check_component(kind, REGISTRY.component(kind, name), built_with)


NEEDS_OPTIONS = '''
from xmcbench.config import Option
from xmcbench.hookspecs import hookimpl
from xmcbench_lightxml.recaller import build_cluster_linear

LABEL_FILE = Option("label_file", "path", None, "one text per label", required=True)
SCALE = Option("scale", float, None, "a scale the recaller cannot guess", required=True, minimum=0)


def build_with_file(config, in_dim, num_clusters):
    LABEL_FILE.value_of(config)   # raises without it, as a recaller reading the file would
    return build_cluster_linear(config, in_dim, num_clusters)


def build_scaled(config, in_dim, num_clusters):
    assert SCALE.value_of(config) == 2.0
    return build_cluster_linear(config, in_dim, num_clusters)


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("recaller", "needs-a-file", build_with_file, options=(LABEL_FILE,))
    registry.add_component("recaller", "needs-a-scale", build_scaled, options=(SCALE,),
                           conformance_options={"scale": "2"})
'''


def test_an_installed_plugin_whose_components_need_options_keeps_this_suite_green(tmp_path):
    """A third-party plugin installed beside xmcbench, one component needing an option it gives no conformance
    value for (skipped, with the reason), one giving it (checked): this file, run again, passes."""
    site = tmp_path / "site"
    package = unique_package(site)
    install_plugin(site, package, NEEDS_OPTIONS)
    environment = {key: value for key, value in os.environ.items() if not key.startswith("XMCBENCH_")}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", __file__, "-k",
                             "not installed_plugin", "-v"], env=environment, cwd=Path(__file__).parents[1],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_every_registered_component_conforms[recaller-needs-a-scale] PASSED" in result.stdout
    assert "test_every_registered_component_conforms[recaller-needs-a-file] SKIPPED" in result.stdout
    assert (f"recaller needs-a-file (from {package} ({package} 1.0)) needs options.label_file and registers no "
            "conformance_options giving them") in " ".join(result.stdout.split())


def test_conformance_options_are_parsed_like_a_runs(config):
    from xmcbench.registry import Registry

    registry = Registry()
    registry.add_component("recaller", "scaled", lambda config, in_dim, num_clusters: None,
                           options=(Option("scale", float, None, "a scale", required=True, minimum=0),),
                           conformance_options={"scale": "-1"})
    with pytest.raises(XmcError, match="conformance_options of recaller scaled: options.scale='-1' is out of range"):
        conformance_config(registry, "recaller", "scaled", config)
    registry.conformance_options[("recaller", "scaled")] = {"scale": "3"}
    built_with, reason = conformance_config(registry, "recaller", "scaled", config)
    assert built_with.options == {"scale": 3.0} and reason == "" and config.options == {}


def test_every_kind_has_a_registered_component():
    assert {kind for kind, _ in REGISTERED} == set(COMPONENT_KINDS)


def test_tiny_config_applies_overrides_and_merges_options(tiny_model_dir):
    config = tiny_config(tiny_model_dir, top_clusters=3, options={"mine": 1})
    assert (config.model_name, config.pretrained_weights, config.num_layers) == (str(tiny_model_dir), False, 2)
    assert (config.hidden_size, config.top_clusters, config.max_length, config.options) == (8, 3, 16, {"mine": 1})


def test_unknown_kind_is_rejected(config):
    with pytest.raises(ValueError, match="unknown component kind 'scorer'"):
        check_component("scorer", lambda config: None, config)


def test_checks_leave_the_callers_seeds_and_threads_alone(config):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    threads = torch.get_num_threads()
    expected = torch.rand(2), np.random.rand(), random.random()
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    check_recaller(REGISTRY.component("recaller", "cluster-linear"), config)
    assert torch.equal(torch.rand(2), expected[0]) and np.random.rand() == expected[1] and random.random() == expected[2]
    assert torch.get_num_threads() == threads


# -- broken components ---------------------------------------------------------------------------------

def caught(check, factory, config, *rules: str) -> str:
    with pytest.raises(AssertionError) as failure:
        check(factory, config)
    message = str(failure.value)
    for rule in rules:
        assert rule in message, message
    return message


class WrongShapeRanker(BottleneckRanker):
    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)

    def forward(self, representation, candidate_labels):
        return super().forward(representation, candidate_labels).sum(dim=1, keepdim=True)   # (B, 1)


def test_a_wrong_output_shape_is_caught(config):
    message = caught(check_ranker, WrongShapeRanker, config, "the output shape must follow the contract",
                     "expected (1, 7)")
    assert message.startswith("ranker tests.test_conformance.WrongShapeRanker: ")


def wrong_out_dim_encoder(config, **exported):
    encoder = build_transformer_cls(config, **exported)
    encoder.out_dim += 1
    return encoder


def test_an_encoder_whose_out_dim_lies_is_caught(config):
    message = caught(check_encoder, wrong_out_dim_encoder, config, "the output shape must follow the contract")
    assert message.startswith("encoder tests.test_conformance.wrong_out_dim_encoder: ")


class UnseededRecaller(ClusterLinearRecaller):
    """Initialised from fresh OS entropy: two instances after the same seed differ."""

    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)
        with torch.no_grad():
            self.linear.weight.copy_(torch.from_numpy(np.random.default_rng().normal(size=(num_clusters, in_dim))))


class NoisyRecaller(ClusterLinearRecaller):
    """Adds noise in eval mode too (should have been dropout)."""

    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)

    def forward(self, representation):
        return super().forward(representation) + torch.randn(representation.shape[0], self.num_clusters)


def test_non_determinism_is_caught(config):
    caught(check_recaller, UnseededRecaller, config, "recaller tests.test_conformance.UnseededRecaller",
           "two instances built after the same torch.manual_seed must give identical outputs")
    caught(check_recaller, NoisyRecaller, config, "recaller tests.test_conformance.NoisyRecaller",
           "eval-mode outputs must depend on the inputs only")


class ForgetfulRanker(BottleneckRanker):
    """A random projection kept in a non-persistent buffer: it moves with .to() but not with state_dict."""

    def __init__(self, config, in_dim, num_labels):
        super().__init__(in_dim, num_labels, config.hidden_size)
        self.register_buffer("projection", torch.randn(in_dim, in_dim), persistent=False)

    def forward(self, representation, candidate_labels):
        return super().forward(representation @ self.projection, candidate_labels)


def test_a_state_dict_that_does_not_round_trip_is_caught(config):
    caught(check_ranker, ForgetfulRanker, config, "ranker tests.test_conformance.ForgetfulRanker",
           "a state_dict round trip must reproduce the outputs")


class Float32Recaller(ClusterLinearRecaller):
    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)

    def forward(self, representation):
        return super().forward(representation).float()


class PlainTensorRecaller(ClusterLinearRecaller):
    """Keeps a tensor as a plain attribute: .to() does not move it."""

    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)
        self.mixing = torch.eye(num_clusters)

    def forward(self, representation):
        return super().forward(representation) @ self.mixing


def test_components_that_do_not_follow_the_pipelines_dtype_are_caught(config):
    caught(check_recaller, Float32Recaller, config, "outputs must follow .to(torch.float64)")
    caught(check_recaller, PlainTensorRecaller, config, "forward after .to(torch.float64) on B=1, D=12 must work: "
                                                        "raised RuntimeError")


def test_wrong_factories_are_caught(config):
    caught(check_recaller, lambda config: ClusterLinearRecaller(12, 6), config,
           "the pipeline's factory call factory(config, in_dim, num_clusters) must work: raised TypeError")
    caught(check_recaller, lambda config, in_dim, num_clusters: nn.Linear(in_dim, num_clusters), config,
           "factory(config, in_dim, num_clusters) must return an xmcbench.interfaces.Recaller",
           "torch.nn.modules.linear.Linear")
    caught(check_recaller, lambda config, in_dim, num_clusters: ClusterLinearRecaller(in_dim, num_clusters + 1),
           config, "a recaller's num_clusters must be the num_clusters it was built with", "7 instead of 6")


class ElementwiseLossRecaller(ClusterLinearRecaller):
    def __init__(self, config, in_dim, num_clusters):
        super().__init__(in_dim, num_clusters)

    def loss(self, logits, cluster_targets):
        return nn.functional.binary_cross_entropy_with_logits(logits, cluster_targets, reduction="none")


def test_a_loss_that_is_not_a_scalar_is_caught(config):
    caught(check_recaller, ElementwiseLossRecaller, config, "loss must return a scalar tensor")


def path_exporting_encoder(config, **exported):
    encoder = build_transformer_cls(config, **exported)
    export = encoder.export
    encoder.export = lambda directory: {**export(directory), "model_name": directory}   # a Path, not JSON
    return encoder


def test_an_export_that_model_json_cannot_store_is_caught(config):
    caught(check_encoder, path_exporting_encoder, config, "must be JSON-serialisable")


# -- broken samplers -----------------------------------------------------------------------------------

class TopClustersOnlySampler(Sampler):
    """The original LightXML defect: the recalled clusters only, so positives elsewhere are dropped."""

    def __init__(self, config):
        super().__init__()
        self.top = config.top_clusters

    def forward(self, recall_logits, positives, clusters, doc_index) -> Candidates:
        top = recall_logits.topk(self.top, dim=1).indices
        candidates = expand_clusters(top, torch.ones_like(top, dtype=torch.bool), clusters)
        candidates.targets = positive_targets(candidates.labels, positives) * candidates.mask
        return candidates


class RepeatingSampler(TopClustersOnlySampler):
    def forward(self, recall_logits, positives, clusters, doc_index) -> Candidates:
        top = recall_logits.topk(self.top, dim=1).indices
        candidates = candidates_with_positives(top, positives, clusters)
        return Candidates(*(torch.cat([t, t], dim=1) for t in (candidates.labels, candidates.mask,
                                                               candidates.clusters, candidates.targets)))


class NoTargetsSampler(TopClustersOnlySampler):
    def forward(self, recall_logits, positives, clusters, doc_index) -> Candidates:
        candidates = candidates_with_positives(recall_logits.topk(self.top, dim=1).indices, positives, clusters)
        candidates.targets = torch.zeros_like(candidates.targets)
        return candidates


class UnseededSampler(TopClustersOnlySampler):
    def forward(self, recall_logits, positives, clusters, doc_index) -> Candidates:
        keys = torch.from_numpy(np.random.default_rng().random(recall_logits.shape))
        return candidates_with_positives(keys.topk(self.top, dim=1).indices, positives, clusters)


class StatelessStaticSampler(StaticSampler):
    """Keeps per-document state but does not hand it to checkpoints."""

    def __init__(self, config):
        super().__init__(config.top_clusters)

    def training_state(self):
        return {}


def test_a_sampler_dropping_a_positive_is_caught(config):
    caught(check_sampler, TopClustersOnlySampler, config, "sampler tests.test_conformance.TopClustersOnlySampler",
           "the sampler's training invariant: every positive must be a candidate exactly once", "appears 0 times")


def test_other_broken_samplers_are_caught(config):
    caught(check_sampler, RepeatingSampler, config, "no label may appear twice in a row among masked-in slots")
    caught(check_sampler, NoTargetsSampler, config, "targets must be 1 exactly on masked-in positives")
    caught(check_sampler, UnseededSampler, config, "two samplers built and called after the same seed must give "
                                                   "identical candidates")
    caught(check_sampler, StatelessStaticSampler, config, "after a state round trip must work: raised XmcError")


def test_the_static_sampler_is_given_its_stage_context(config):
    calls = []

    class RecordingStatic(StaticSampler):
        def __init__(self, config):
            super().__init__(config.top_clusters)

        def start_stage(self, context):
            calls.append((context.stage.losses, context.num_documents, tuple(context.recalled_clusters(2).shape)))
            super().start_stage(context)

    check_sampler(RecordingStatic, config)
    assert calls and all(call == (("rank",), 16, (16, 2)) for call in calls)
