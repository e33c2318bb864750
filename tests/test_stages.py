"""Multi-stage methods (the paper's static-sampling ablations) through the one training loop."""

import copy

import numpy as np
import pytest
import torch

from xmcbench.config import Stage
from xmcbench.errors import XmcError
from xmcbench.interfaces import LabelClusters
from xmcbench.modelio import build_model
from xmcbench.training import Trainer
from xmcbench.registry import build_registry
from xmcbench.tokenization import tokenize
from xmcbench.formats import open_dataset
from xmcbench.indexing import label_clusters
from xmcbench.inference import predict
from xmcbench.rundir import write_results
from xmcbench.runs.plan import plan_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def tiny_setup(registry, tiny_model_dir, method, tiny_dataset, **extra):
    settings = {"model_name": str(tiny_model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 2,
                "batch_size": 8, "max_length": 32, "hidden_size": 8, "cluster_size": 2, "top_clusters": 1,
                "lr": 1e-3, "swa": "false", "threads": 1, **extra}
    plan = plan_run(registry, method, str(tiny_dataset), set_options=[f"{k}={v}" for k, v in settings.items()])
    dataset = open_dataset(registry, plan.dataset)
    rows = np.arange(len(dataset.train_texts))
    clusters = label_clusters(dataset, plan.config, rows, registry)
    torch.manual_seed(0)
    model = build_model(registry, plan.config, clusters)
    tokens = tokenize(dataset.train_texts, model.encoder.tokenizer, plan.config.max_length, None)
    return plan, dataset, model, tokens


class Recorder:
    """Wraps a trainer's train_step to record, per step, the stage, the candidates and the parameters."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.steps = trainer, []
        sampler = trainer.model.sampler
        original_forward = sampler.forward

        def forward(recall_logits, positives, clusters, doc_index):
            candidates = original_forward(recall_logits, positives, clusters, doc_index)
            self.current = {int(d): set(candidates.labels[i][candidates.mask[i]].tolist())
                            for i, d in enumerate(doc_index)}
            return candidates

        sampler.forward = forward
        original_step = trainer.train_step

        def step(rows, stage):
            self.current = {}
            before = copy.deepcopy({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
            record = original_step(rows, stage)
            after = trainer.model.state_dict()
            changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
            self.steps.append({"stage": stage.name, "epoch": trainer.epoch, "candidates": self.current,
                               "changed": changed})
            return record

        trainer.train_step = step


def candidates_by_epoch(steps, stage):
    by_epoch = {}
    for step in steps:
        if step["stage"] == stage:
            by_epoch.setdefault(step["epoch"], {}).update(step["candidates"])
    return by_epoch


def test_static_candidates_stay_fixed_and_stages_train_their_parts(registry, tiny_model_dir, tiny_dataset):
    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml-static", tiny_dataset)
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"),
                      stages=registry.method("lightxml-static").stages)
    recorder = Recorder(trainer)
    trainer.fit()
    stages = [s["stage"] for s in recorder.steps]
    assert stages == ["recall"] * 12 + ["rank"] * 12 + ["recall-refit"] * 6
    changed = {stage: set().union(*(s["changed"] for s in recorder.steps if s["stage"] == stage))
               for stage in ("recall", "rank", "recall-refit")}
    assert changed["recall"] == {"encoder", "recaller"}
    assert changed["rank"] == {"encoder", "ranker"}
    assert changed["recall-refit"] == {"recaller"}
    epochs = candidates_by_epoch(recorder.steps, "rank")
    assert epochs[0] == epochs[1], "static candidates must not change between epochs"
    assert all(not s["candidates"] for s in recorder.steps if s["stage"] != "rank"), "no ranker outside stage 2"


def test_dynamic_candidates_follow_the_recaller(registry, tiny_model_dir, tiny_dataset):
    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml", tiny_dataset, epochs=4)
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"))
    recorder = Recorder(trainer)
    trainer.fit()
    epochs = candidates_by_epoch(recorder.steps, "joint")
    assert any(epochs[e] != epochs[0] for e in epochs), "dynamic candidates never changed"


def test_a_trainer_says_where_it_stands_even_after_its_last_epoch(registry, tiny_model_dir, tiny_dataset):
    # a run that stopped after training (while writing its log) resumes from a checkpoint past every stage: its
    # log said "epoch 1" there, which reads as starting over
    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml", tiny_dataset, epochs=2)
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"))
    assert trainer.position() == "epoch 1 of 2"
    trainer.fit()
    assert trainer.position() == "after its last epoch"
    stages = registry.method("lightxml-static").stages
    assert Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"),
                   stages=stages).position() == f"stage {stages[0].name}, epoch 1 of {stages[0].epochs(plan.config)}"


def test_bs_ranker_gets_its_own_encoder_started_from_the_shared_one(registry, tiny_model_dir, tiny_dataset):
    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml-static-bs", tiny_dataset)
    assert model.ranker_encoder is not None
    stages = registry.method("lightxml-static-bs").stages
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"), stages=stages)
    recorder = Recorder(trainer)
    copied = {}
    original_begin = trainer._begin_stage

    def begin(stage):
        original_begin(stage)
        if stage.name == "rank":
            copied["equal"] = all(torch.equal(a, b) for a, b in zip(model.encoder.state_dict().values(),
                                                                   model.ranker_encoder.state_dict().values()))

    trainer._begin_stage = begin
    trainer.fit()
    assert copied["equal"], "the ranker's encoder starts as a copy of the stage-1 encoder"
    rank_changed = set().union(*(s["changed"] for s in recorder.steps if s["stage"] == "rank"))
    assert rank_changed == {"ranker_encoder", "ranker"}


def test_random_negatives_avoid_positive_clusters(registry, tiny_model_dir, tiny_dataset):
    from xmcbench_lightxml.sampler import RandomSampler

    clusters = LabelClusters.from_assignment(torch.arange(12) % 6, 6)
    sampler = RandomSampler(top_clusters=3)
    torch.manual_seed(0)
    positives = torch.tensor([[0, 1, -1], [5, -1, -1]])
    seen = set()
    for _ in range(30):
        candidates = sampler(torch.zeros(2, 6), positives, clusters, torch.arange(2))
        labels = candidates.labels[0][candidates.mask[0]]
        assert {0, 1} <= set(labels.tolist())
        assert candidates.mask[0].sum() == (2 + 3) * 2   # 2 positive clusters + 3 drawn among the other 4
        seen.add(frozenset(clusters.label_cluster[labels].tolist()))
    assert len(seen) > 1, "draws should vary"


def test_static_methods_need_clusters(registry, tiny_model_dir, tiny_dataset):
    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml-static", tiny_dataset,
                                              cluster_size=1)
    with pytest.raises(XmcError, match="needs label clusters"):
        Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"),
                stages=registry.method("lightxml-static").stages)


def test_malformed_stage_is_rejected():
    with pytest.raises(XmcError, match="malformed"):
        Stage("bad", trains=("decoder",))


def test_a_head_warmup_trains_the_heads_on_the_frozen_encoder_first(registry, tiny_model_dir, tiny_dataset):
    from xmcbench.config import training_stages

    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml", tiny_dataset,
                                              head_warmup_epochs=2)
    stages = training_stages(registry.method("lightxml").stages, plan.config)
    assert [s.name for s in stages] == ["head-warmup", "joint"]
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"), stages=stages)
    recorder = Recorder(trainer)
    trainer.fit()
    assert [s["stage"] for s in recorder.steps] == ["head-warmup"] * 12 + ["joint"] * 12
    warmup_changed = set().union(*(s["changed"] for s in recorder.steps if s["stage"] == "head-warmup"))
    assert warmup_changed == {"recaller", "ranker"}, "the encoder stays as pretrained during the warm-up"
    # a static method warms up what its first stage trains (its recaller, on the recall loss), so its frozen
    # candidates still come from a recaller that trained beside the encoder
    static = training_stages(registry.method("lightxml-static").stages, plan.config)
    assert static[0].trains == ("recaller",) and static[0].losses == ("recall",)
    assert training_stages(registry.method("lightxml").stages, plan.config.__class__()) == \
        registry.method("lightxml").stages   # head_warmup_epochs=0: the paper's recipe


def test_a_static_method_counts_the_documents_of_every_stage_for_its_timings(registry, tiny_model_dir,
                                                                             tiny_dataset, tmp_path):
    import json

    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml-static", tiny_dataset,
                                              epochs=2, refit_epochs=3)
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"),
                      stages=registry.method("lightxml-static").stages)
    trainer.fit()
    # recall (2 epochs), rank (2 epochs) and recall-refit (3 epochs), each over the 48 training documents
    assert trainer.documents_trained == (2 * 2 + 3) * 48
    predictions = predict(model, tokens, plan.config, torch.device("cpu"))
    write_results(tmp_path, dataset, {}, predictions, validation_predictions=None, validation_rows=np.arange(0),
                  train_seconds=7.0, documents_trained=trainer.documents_trained, predict_seconds=1.0, resumed=False,
                  device=torch.device("cpu"))
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["documents_trained"] == 7 * 48
    assert timings["train_ms_per_document"] == pytest.approx(1000 * 7.0 / (7 * 48))


def test_frozen_encoders_run_once_per_stage_with_the_same_result(registry, tiny_model_dir, tiny_dataset,
                                                                monkeypatch):
    from xmcbench import training

    results = {}
    for budget in (training.FROZEN_REPRESENTATION_BYTES, 0):   # kept once, or run at every step
        monkeypatch.setattr(training, "FROZEN_REPRESENTATION_BYTES", budget)
        plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml-static", tiny_dataset,
                                                  refit_epochs=3)
        calls = []
        forward = model.encoder.forward
        model.encoder.forward = lambda ids, mask: calls.append(len(ids)) or forward(ids, mask)
        trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"),
                          stages=registry.method("lightxml-static").stages)
        torch.manual_seed(1)
        trainer.fit()
        results[budget] = ({k: v.clone() for k, v in model.state_dict().items()}, sum(calls))
    (kept, kept_calls), (every_step, every_step_calls) = results.values()
    # the frozen refit stage (3 epochs of 48 documents) runs its encoder over the 48 documents once
    assert every_step_calls - kept_calls == 3 * 48 - 48
    for key in kept:
        assert torch.allclose(kept[key].float(), every_step[key].float(), atol=1e-5), key


def test_early_stopping_after_patience_epochs_without_a_better_validation_score(registry, tiny_model_dir,
                                                                                 tiny_dataset):
    plan, dataset, model, tokens = tiny_setup(registry, tiny_model_dir, "lightxml", tiny_dataset, epochs=6,
                                              patience=2)
    scores = iter([0.5, 0.6, 0.55, 0.58, 0.9, 0.9])   # best after epoch 2, then two epochs without better
    trainer = Trainer(model, tokens, dataset.train_labels, plan.config, torch.device("cpu"),
                      validate=lambda candidate: next(scores))
    _, log = trainer.fit()
    assert [v["epoch"] for v in log.validation] == [1, 2, 3, 4]
    assert log.selected_epoch == 2 and log.stopped_early == 4
    assert trainer.documents_trained == 4 * 48   # what timings.json divides the training time by
