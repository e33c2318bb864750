"""The label-information contracts: LabelInfo and the shared encoder handed to the factories that declare them,
a ranker's own loss, the score combiner, lifecycle events with document and label embeddings, the retriever
path, what the model folder keeps, `check_method`, and whole methods' label information, device and resume."""

from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from xmcbench.candidates import positive_targets, unique_per_row
from xmcbench.config import MethodSpec, Stage, TrainConfig
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.interfaces import Candidates, LabelClusters, Ranker, Recaller, Retriever, Sampler, call_factory
from xmcbench.modelio import load_model_dir, model_size
from xmcbench.registry import build_registry
from xmcbench.testing import TOPICS, check_component, check_method, tiny_config, write_tiny_dataset, \
    write_tiny_label_texts
from xmcbench.runs import launch
from xmcbench.formats import open_dataset
from xmcbench.indexing import label_clusters
from xmcbench.models import predict_documents
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import split_train_rows
from xmcbench.scoring import propensities

pytestmark = pytest.mark.slow


# -- a tiny dual encoder, as a third-party plugin would write it: label texts from LabelInfo, the label tower is
#    the method's encoder, negatives mined at epoch starts, a softmax loss, prediction through a retriever --------

def normalized(vectors):
    return nn.functional.normalize(vectors, dim=-1)


class LabelIndex(Retriever):
    def __init__(self, num_labels, dim):
        super().__init__()
        self.num_clusters = num_labels
        self.register_buffer("label_vectors", torch.zeros(num_labels, dim))

    def forward(self, representation):
        return normalized(representation) @ self.label_vectors.T

    def search(self, representation, top):   # its own search, apart from forward
        scores = normalized(representation) @ self.label_vectors.T
        logits, labels = scores.topk(min(top, scores.shape[1]), dim=1)
        return labels, logits

    def start_epoch(self, context):
        self.label_vectors.copy_(normalized(context.label_embeddings()))

    def finalize(self, context):
        self.label_vectors.copy_(normalized(context.label_embeddings()))


class LabelTower(Ranker):
    def __init__(self, encoder, label_info, persistent=True):
        super().__init__()
        from xmcbench.tokenization import tokenize

        self.encoder = encoder
        tokens = tokenize(list(label_info.texts), encoder.tokenizer, 16, None, description=None)
        ids, mask = tokens.batch(np.arange(label_info.num_labels))
        self.register_buffer("label_ids", ids, persistent=False)
        self.register_buffer("label_mask", mask, persistent=False)
        self.register_buffer("label_vectors", torch.zeros(label_info.num_labels, encoder.out_dim),
                             persistent=persistent)
        self.scale = nn.Parameter(torch.ones(()))   # a weight of its own besides the shared encoder's

    def forward(self, representation, candidate_labels):
        if self.training:
            unique, inverse = torch.unique(candidate_labels, return_inverse=True)
            vectors = normalized(self.encoder(self.label_ids[unique], self.label_mask[unique]))
            return self.scale * (normalized(representation) @ vectors.T).gather(1, inverse)
        return self.scale * torch.einsum("bd,bcd->bc", normalized(representation), self.label_vectors[candidate_labels])

    def loss(self, logits, candidates):
        logits = (10.0 * logits.float()).masked_fill(~candidates.mask, -1e4)
        positive = logits.masked_fill(candidates.targets <= 0, -1e4)
        has_positive = (candidates.targets > 0).any(dim=1)
        per_document = torch.logsumexp(logits, dim=1) - torch.logsumexp(positive, dim=1)
        return (per_document * has_positive).sum() / has_positive.sum().clamp_min(1)

    def finalize(self, context):
        self.label_vectors.copy_(normalized(context.label_embeddings()))


class MinedNegatives(Sampler):
    reads_recall_logits = False

    def __init__(self, keeps_state=True):
        super().__init__()
        self.mined, self.keeps_state = None, keeps_state

    def start_epoch(self, context):
        scores = normalized(context.document_embeddings()) @ normalized(context.label_embeddings()).T
        self.mined = scores.topk(3, dim=1).indices

    def training_state(self):
        return {"mined": self.mined} if self.keeps_state and self.mined is not None else {}

    def load_training_state(self, state):
        self.mined = state.get("mined")

    def forward(self, recall_logits, positives, clusters, doc_index):
        batch = positives.shape[0]
        parts = [positives, positives.reshape(1, -1).expand(batch, -1)]
        if self.mined is not None:
            parts.append(self.mined[doc_index.cpu()].to(positives.device))
        ids = torch.cat(parts, dim=1)
        labels, keep = unique_per_row(ids.clamp_min(0), ids >= 0)
        return Candidates(labels, keep, clusters.label_cluster[labels], positive_targets(labels, positives) * keep)


def build_index(config, in_dim, num_labels, *, encoder):
    return LabelIndex(num_labels, in_dim)


def build_tower(config, in_dim, num_labels, *, encoder, label_info):
    return LabelTower(encoder, label_info)


def build_mined(config):
    return MinedNegatives()


DUAL_DEFAULTS = {"encoder": "transformer-cls", "recaller": "test-index", "ranker": "test-tower",
                 "sampler": "test-mined", "cluster_size": 1, "swa": False, "score_combiner": "weighted-sum",
                 "ranker_weight": 1.0, "num_layers": 2, "pretrained_weights": False, "lr": 1e-3}
CONTRASTIVE = (Stage("contrastive", trains=("encoder", "ranker"), losses=("rank",)),)


def dual_plugin(index=build_index, tower=build_tower, mined=build_mined, retriever=True):
    @hookimpl
    def xmcbench_register_components(registry):
        registry.add_component("recaller", "test-index", index, retriever=retriever)
        registry.add_component("ranker", "test-tower", tower)
        registry.add_component("sampler", "test-mined", mined)

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("test-dual", "a tiny dual encoder", defaults=DUAL_DEFAULTS, stages=CONTRASTIVE))

    return types.SimpleNamespace(xmcbench_register_components=xmcbench_register_components,
                                 xmcbench_register_methods=xmcbench_register_methods)


def tiny_settings(model_dir, *extra):
    return [f"model_name={model_dir}", "epochs=2", "batch_size=8", "max_length=16", "threads=1",
            "validation_size=0", *extra]


@pytest.fixture
def labelled_dataset(tmp_path):
    folder = write_tiny_dataset(tmp_path / "data")
    write_tiny_label_texts(folder)
    return folder


def open_with_texts(registry, folder):
    dataset = open_dataset(registry, str(folder))
    assert dataset.label_texts == [TOPICS[name] for name in dataset.label_names], "label_texts.tsv was read"
    return dataset


def train(registry, method, folder, output, settings):
    dataset = open_with_texts(registry, folder)
    plan = plan_run(registry, method, str(folder), set_options=settings, seed=0, loaded=dataset)
    plan.loaded = dataset
    return launch.run(plan, output, registry=registry, log=lambda line: None), dataset


# -- factories receive what they declare ----------------------------------------------------------------

def test_call_factory_passes_only_declared_keyword_only_parameters():
    def plain(config, in_dim, num_labels):
        return "plain"

    def with_kwargs(config, **exported):
        return exported

    def wants(config, *, label_info, encoder=None):
        return label_info, encoder

    assert call_factory(plain, 1, 2, 3, label_info="info", encoder="enc") == "plain"
    assert call_factory(with_kwargs, 1, model_name="m", label_info="info") == {"model_name": "m"}
    assert call_factory(wants, 1, label_info="info", encoder="enc") == ("info", "enc")


def test_factories_receive_label_info_and_the_encoder_they_declare(tiny_model_dir, labelled_dataset, tmp_path):
    seen = {}

    def recording_tower(config, in_dim, num_labels, *, encoder, label_info):
        seen["encoder"], seen["label_info"] = encoder, label_info
        return LabelTower(encoder, label_info)

    registry = build_registry([("contracts-test", dual_plugin(tower=recording_tower))], load_entry_points=True)
    run_dir, dataset = train(registry, "test-dual", labelled_dataset, tmp_path / "run", tiny_settings(tiny_model_dir))
    info = seen["label_info"]
    train_rows, _ = split_train_rows(dataset, TrainConfig(validation_size=0))
    expected_counts = np.asarray(dataset.train_labels[train_rows].sum(axis=0)).ravel()[:dataset.num_labels]
    assert info.names == tuple(dataset.label_names[:dataset.num_labels])
    assert info.texts == tuple(TOPICS[name] for name in info.names)
    assert np.array_equal(info.counts, expected_counts)
    assert np.allclose(info.inverse_propensities, propensities(dataset).inverse[:dataset.num_labels])
    assert isinstance(seen["encoder"], nn.Module) and seen["encoder"].out_dim == 64   # 2 layers x 32

    model, _, names = load_model_dir(run_dir, registry)
    assert model.ranker.encoder is model.encoder, "the loaded model's ranker shares the encoder"
    saved = json.loads((run_dir / "model" / "label_info.json").read_text())
    assert saved["texts"] == list(info.texts) and saved["counts"] == info.counts.tolist()
    assert "label_info.json" in json.loads((run_dir / "model" / "model.json").read_text())["files"]


def test_a_shared_encoder_is_saved_and_counted_once(tiny_model_dir, labelled_dataset, tmp_path):
    registry = build_registry([("contracts-test", dual_plugin())])
    run_dir, _ = train(registry, "test-dual", labelled_dataset, tmp_path / "run", tiny_settings(tiny_model_dir))
    weights = load_file(str(run_dir / "model" / "weights.safetensors"))
    assert not [name for name in weights if name.startswith("ranker.encoder.")], "shared weights stored twice"
    model, _, _ = load_model_dir(run_dir, registry)
    encoder_parameters = sum(p.numel() for p in model.encoder.parameters())
    assert model_size(model)["parameters"] == sum(p.numel() for p in model.parameters())
    assert model_size(model)["parameters"] < 2 * encoder_parameters


def test_a_stage_that_freezes_the_encoder_freezes_it_inside_the_ranker_too(tiny_model_dir, labelled_dataset, tmp_path):
    registry = build_registry([("contracts-test", dual_plugin())])
    frozen_encoder = (Stage("ranker-only", trains=("ranker",), losses=("rank",)),)
    spec = registry.methods["test-dual"].value
    registry.methods["test-dual"] = type(registry.methods["test-dual"])(
        MethodSpec(spec.name, spec.description, spec.defaults, stages=frozen_encoder), "test")
    dataset = open_with_texts(registry, labelled_dataset)
    plan = plan_run(registry, "test-dual", str(labelled_dataset), set_options=tiny_settings(tiny_model_dir),
                           seed=0, loaded=dataset)
    train_rows, _ = split_train_rows(dataset, plan.config)
    from xmcbench.device import seed_everything
    from xmcbench.labels import label_info
    from xmcbench.modelio import build_model

    seed_everything(plan.config.seed)   # as the run does before building its model: the same initial weights
    model = build_model(registry, plan.config, label_clusters(dataset, plan.config, train_rows, registry),
                        label_info=label_info(dataset, plan.config, train_rows))
    before = copy.deepcopy(model.encoder.state_dict())
    plan.loaded = dataset
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    trained = load_file(str(run_dir / "model" / "weights.safetensors"))
    for name, tensor in before.items():
        assert torch.equal(trained[f"encoder.{name}"], tensor), f"the frozen encoder's {name} changed"


def test_a_rankers_own_loss_is_the_loss_trained(tiny_model_dir, labelled_dataset, tmp_path):
    class ConstantLossTower(LabelTower):
        def loss(self, logits, candidates):
            return logits.sum() * 0.0 + 4.25

    registry = build_registry([("contracts-test", dual_plugin(
        tower=lambda config, in_dim, num_labels, *, encoder, label_info: ConstantLossTower(encoder, label_info)))])
    run_dir, _ = train(registry, "test-dual", labelled_dataset, tmp_path / "run", tiny_settings(tiny_model_dir))
    steps = json.loads((run_dir / "training_log.json").read_text())["steps"]
    assert steps and all(step["rank"] == 4.25 for step in steps)


# -- scores -------------------------------------------------------------------------------------------------

class FixedRecaller(Retriever):
    """Logits over 4 labels: label l scores l / 4."""
    num_clusters = 4

    def forward(self, representation):
        return torch.arange(4.0).div(4).expand(len(representation), 4)


class FixedRanker(Ranker):
    def forward(self, representation, candidate_labels):
        return 1.0 - candidate_labels.float() / 2


class NoSampler(Sampler):
    def forward(self, recall_logits, positives, clusters, doc_index):
        raise AssertionError("not used in prediction")


class IdentityEncoder(nn.Module):
    out_dim = 2

    def forward(self, input_ids, attention_mask):
        return torch.zeros(len(input_ids), 2)


@pytest.mark.parametrize("combiner, weight", [("product", 0.5), ("weighted-sum", 0.25), ("weighted-sum", 1.0)])
def test_the_score_combiner_decides_the_final_score(combiner, weight):
    from xmcbench.model import XMCModel

    clusters = LabelClusters.from_assignment(torch.arange(4), 4)
    model = XMCModel(IdentityEncoder(), FixedRecaller(), FixedRanker(), NoSampler(), clusters,
                     score_combiner=combiner, ranker_weight=weight).eval()
    (labels, scores), _ = model.predict_top(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), 4, 4)
    parent = torch.sigmoid(torch.arange(4.0, dtype=scores.dtype) / 4)
    own = torch.sigmoid(1.0 - torch.arange(4.0, dtype=scores.dtype) / 2)
    expected = parent * own if combiner == "product" else weight * own + (1 - weight) * parent
    assert torch.allclose(scores[0], expected[labels[0]])
    assert torch.equal(labels[0], expected.argsort(descending=True))


class ConfidentRecaller(Recaller):
    """Logits 20, 30, 25 and 0 over 4 clusters: the sigmoid of each of the first three is 1 in float32."""
    num_clusters = 4

    def forward(self, representation):
        return torch.tensor([20.0, 30.0, 25.0, 0.0]).expand(len(representation), 4)


class ConfidentRanker(Ranker):
    """Logit 18 for an even label, 20 for an odd one: both probabilities are 1 in float32."""
    def forward(self, representation, candidate_labels):
        return 18.0 + 2.0 * (candidate_labels % 2).float()


def test_confident_logits_are_ranked_by_their_scores_not_by_their_ids():
    from xmcbench.model import XMCModel

    ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3)
    flat = XMCModel(IdentityEncoder(), ConfidentRecaller(), None, None,
                    LabelClusters.from_assignment(torch.arange(4), 4)).eval()
    (labels, scores), _ = flat.predict_top(ids, mask, 4, 4)
    assert labels[0].tolist() == [1, 2, 0, 3]
    assert scores[0, 0] > scores[0, 1] > scores[0, 2]

    clustered = XMCModel(IdentityEncoder(), ConfidentRecaller(), ConfidentRanker(), NoSampler(),
                         LabelClusters.from_assignment(torch.arange(8) // 2, 4)).eval()   # labels 2c, 2c + 1 in c
    (labels, scores), recalled = clustered.predict_top(ids, mask, 4, 8)
    assert recalled[0].tolist() == [1, 2, 0, 3]
    # each product is about 1 - e^-recall - e^-rank: 3 (e^-30 + e^-20) first, then 5 (e^-25 + e^-20), 1, 2, 4, 0
    assert labels[0].tolist() == [3, 5, 1, 2, 4, 0, 7, 6]


def test_an_unknown_score_combiner_is_refused_in_one_line():
    with pytest.raises(XmcError, match="score_combiner='max' is not one of product, weighted-sum"):
        TrainConfig(score_combiner="max").validate()


# -- lifecycle events -------------------------------------------------------------------------------------

def test_lifecycle_events_come_in_order_with_the_models_embeddings(tiny_model_dir, labelled_dataset, tmp_path):
    events = []

    class RecordingIndex(LabelIndex):
        def start_stage(self, context):
            events.append(("start_stage", context.stage.name))

        def start_epoch(self, context):
            documents, labels = context.document_embeddings(), context.label_embeddings()
            assert context.document_embeddings() is documents, "computed once per event"
            events.append(("start_epoch", context.epoch, tuple(documents.shape), tuple(labels.shape)))
            super().start_epoch(context)

        def finalize(self, context):
            events.append(("finalize", context.epoch))
            super().finalize(context)

    registry = build_registry([("contracts-test", dual_plugin(
        index=lambda config, in_dim, num_labels, *, encoder: RecordingIndex(num_labels, in_dim)))])
    run_dir, dataset = train(registry, "test-dual", labelled_dataset, tmp_path / "run", tiny_settings(tiny_model_dir))
    documents, labels = (48, 64), (dataset.num_labels, 64)
    assert events == [("start_stage", "contrastive"), ("start_epoch", 0, documents, labels),
                      ("start_epoch", 1, documents, labels), ("finalize", None)]
    model, _, _ = load_model_dir(run_dir, registry)
    assert bool(model.recaller.label_vectors.abs().sum() > 0), "finalize's index is saved with the model"


def test_a_validated_model_hears_finalize_first(tiny_model_dir, labelled_dataset, tmp_path):
    finalized = []

    class CountingIndex(LabelIndex):
        def finalize(self, context):
            finalized.append(self)
            super().finalize(context)

    registry = build_registry([("contracts-test", dual_plugin(
        index=lambda config, in_dim, num_labels, *, encoder: CountingIndex(num_labels, in_dim)))])
    settings = tiny_settings(tiny_model_dir, "validation_size=8", "swa=true", "swa_every_steps=2", "swa_start_epoch=0")
    run_dir, _ = train(registry, "test-dual", labelled_dataset, tmp_path / "run", [s for s in settings
                                                                                   if s != "validation_size=0"])
    validation = json.loads((run_dir / "training_log.json").read_text())["validation"]
    assert len(validation) == 2 and len(finalized) == 3, "once before each validation, once at the end"
    assert finalized[0] is not finalized[-1], "the validated SWA average built its own index"


def test_without_label_texts_label_embeddings_read_the_label_names(tiny_model_dir, tmp_path):
    seen = {}

    class NamesIndex(LabelIndex):
        def finalize(self, context):
            seen["texts"] = context.label_info.texts
            super().finalize(context)

    registry = build_registry([("contracts-test", dual_plugin(
        index=lambda config, in_dim, num_labels, *, encoder: NamesIndex(num_labels, in_dim),
        tower=lambda config, in_dim, num_labels, *, encoder, label_info: LabelTower(
            encoder, types.SimpleNamespace(texts=label_info.names, num_labels=label_info.num_labels))))])
    folder = write_tiny_dataset(tmp_path / "data")
    plan = plan_run(registry, "test-dual", str(folder), set_options=tiny_settings(tiny_model_dir), seed=0)
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    assert seen["texts"] is None
    model, _, _ = load_model_dir(run_dir, registry)
    assert bool(model.recaller.label_vectors.abs().sum() > 0), "the names were embedded"


# -- the retriever path -----------------------------------------------------------------------------------

def test_prediction_goes_through_search_not_a_score_of_every_label(tiny_model_dir, labelled_dataset, tmp_path):
    registry = build_registry([("contracts-test", dual_plugin())])
    run_dir, dataset = train(registry, "test-dual", labelled_dataset, tmp_path / "run", tiny_settings(tiny_model_dir))
    model, config, names = load_model_dir(run_dir, registry)
    expected = predict_documents(model, dataset.test_texts, None, config)

    def refuse(representation):
        raise AssertionError("prediction scored every label")

    searched = []
    search = model.recaller.search
    model.recaller.forward = refuse
    model.recaller.search = lambda representation, top: searched.append(top) or search(representation, top)
    found = predict_documents(model, dataset.test_texts, None, config)
    assert searched == [config.top_clusters] and np.array_equal(found.labels, expected.labels)


def test_a_retriever_registered_without_the_flag_is_refused(tiny_model_dir, labelled_dataset, tmp_path):
    registry = build_registry([("contracts-test", dual_plugin(retriever=False))])
    with pytest.raises(XmcError, match="trains a ranker in a stage of its own"):
        train(registry, "test-dual", labelled_dataset, tmp_path / "run", tiny_settings(tiny_model_dir))
    assert not (tmp_path / "run").exists(), "refused before the run folder was touched"


# -- check_method catches broken compositions ---------------------------------------------------------------

def test_the_dual_encoder_and_lightxml_pass_check_method(tiny_model_dir):
    registry = build_registry([("contracts-test", dual_plugin())])
    check_method(registry, "test-dual", [f"model_name={tiny_model_dir}"])
    check_method(registry, "lightxml", [f"model_name={tiny_model_dir}", "num_layers=2", "pretrained_weights=false",
                                        "cluster_size=2"])


def test_check_method_catches_a_tower_that_copies_the_encoder(tiny_model_dir):
    def copying(config, in_dim, num_labels, *, encoder, label_info):
        return LabelTower(copy.deepcopy(encoder), label_info)

    registry = build_registry([("contracts-test", dual_plugin(tower=copying))])
    with pytest.raises(AssertionError, match="must use it, not a copy"):
        check_method(registry, "test-dual", [f"model_name={tiny_model_dir}"])


def test_check_method_catches_a_weight_wrapped_twice(tiny_model_dir):
    class Rewrapping(LabelTower):
        def __init__(self, encoder, label_info):
            super().__init__(encoder, label_info)
            first = next(encoder.parameters())
            self.alias = nn.Parameter(first.data)

    registry = build_registry([("contracts-test", dual_plugin(
        tower=lambda config, in_dim, num_labels, *, encoder, label_info: Rewrapping(encoder, label_info)))])
    with pytest.raises(AssertionError, match="each weight must be one parameter"):
        check_method(registry, "test-dual", [f"model_name={tiny_model_dir}"])


def test_check_method_catches_prediction_state_that_is_not_saved(tiny_model_dir):
    registry = build_registry([("contracts-test", dual_plugin(
        tower=lambda config, in_dim, num_labels, *, encoder, label_info: LabelTower(encoder, label_info,
                                                                                    persistent=False)))])
    with pytest.raises(AssertionError, match="saved and loaded model must predict the test texts as the run did"):
        check_method(registry, "test-dual", [f"model_name={tiny_model_dir}"])


def test_check_method_catches_epoch_state_missing_from_checkpoints(tiny_model_dir):
    registry = build_registry([("contracts-test", dual_plugin(mined=lambda config: MinedNegatives(keeps_state=False)))])
    with pytest.raises(AssertionError, match="resumed inside an epoch must end as the uninterrupted run"):
        check_method(registry, "test-dual", [f"model_name={tiny_model_dir}"])


def test_check_component_builds_keyword_factories_and_catches_a_wrong_search(tiny_model_dir):
    config = tiny_config(tiny_model_dir)
    for kind, factory in (("recaller", build_index), ("ranker", build_tower), ("sampler", build_mined)):
        check_component(kind, factory, config)

    class WrongSearch(LabelIndex):
        def search(self, representation, top):
            labels, logits = super().search(representation, top)
            return labels.flip(1), logits

    with pytest.raises(AssertionError, match="search's logits must be the scores forward gives|best labels first"):
        check_component("recaller", lambda config, in_dim, num_labels, *, encoder: WrongSearch(num_labels, in_dim),
                        config)
