"""Integration: the real pipeline and plugins, with a tiny transformer built from a config."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from xmcbench.modelio import load_model_dir
from xmcbench.registry import build_registry
from xmcbench import saved as saved_models
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.saved import predict_texts

pytestmark = pytest.mark.slow


def tiny_options(model_dir, **extra):
    options = {"model_name": str(model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 2,
               "batch_size": 8, "max_length": 32, "hidden_size": 16, "lr": 1e-3, "swa_start_epoch": 1,
               "swa_every_steps": 2, "threads": 1, **extra}
    return [f"{k}={v}" for k, v in options.items()]


@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.mark.parametrize("cluster_size", [1, 2])
def test_run_trains_predicts_scores_and_reloads(registry, tiny_model_dir, tiny_dataset, tmp_path, cluster_size):
    plan = plan_run(registry, "lightxml", str(tiny_dataset),
                           set_options=tiny_options(tiny_model_dir, cluster_size=cluster_size, top_clusters=2))
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100 and "PSP@5" in metrics and "nDCG@3" in metrics
    assert ("coverage" in metrics) == (cluster_size > 1)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resolved"]["flat"] == (cluster_size == 1)
    assert config["resolved"]["num_clusters"] == (8 if cluster_size == 1 else 4)
    log = json.loads((run_dir / "training_log.json").read_text())
    assert len(log["steps"]) == 2 * 6 and log["swa_updates"] > 0
    assert ("rank" in log["steps"][0]) == (cluster_size > 1)
    for name in ("loss.png", "timings.json", "environment.json", "model/weights.safetensors",
                 "model/model.json", "model/labels.json", "model/encoder/tokenizer.json"):
        assert (run_dir / name).exists(), name
    timings = json.loads((run_dir / "timings.json").read_text())
    assert timings["model_bytes"] == (run_dir / "model" / "weights.safetensors").stat().st_size

    # a reloaded model predicts exactly what the trained one predicted
    saved = load_file(str(run_dir / "predictions.safetensors"))
    reloaded = saved_models.evaluate(run_dir, registry=registry)
    assert reloaded["P@1"] == pytest.approx(metrics["P@1"])
    model, model_config, label_names = load_model_dir(run_dir, registry)
    test_texts = (tiny_dataset / "test_texts.txt").read_text().splitlines()
    results = predict_texts(run_dir, test_texts, top_k=5, registry=registry)
    for row, result in enumerate(results):
        expected = [label_names[i] for i in saved["labels"][row][:5] if i >= 0]
        assert result["labels"] == expected
        np.testing.assert_allclose(result["scores"], saved["scores"][row][:len(expected)], rtol=1e-4, atol=1e-6)


def test_training_reduces_the_loss(registry, tiny_model_dir, tiny_dataset, tmp_path):
    plan = plan_run(registry, "lightxml", str(tiny_dataset),
                           set_options=tiny_options(tiny_model_dir, epochs=6, swa="false", cluster_size=2))
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    losses = [s["loss"] for s in json.loads((run_dir / "training_log.json").read_text())["steps"]]
    assert np.mean(losses[-6:]) < np.mean(losses[:6])


def test_gradients_of_both_losses_reach_the_encoder(registry, tiny_model_dir):
    from xmcbench.config import TrainConfig
    from xmcbench.interfaces import LabelClusters
    from xmcbench.modelio import build_model

    config = TrainConfig(encoder="transformer-cls", recaller="cluster-linear", ranker="bottleneck",
                         sampler="dynamic", model_name=str(tiny_model_dir), pretrained_weights=False, num_layers=2,
                         hidden_size=8, top_clusters=1)
    clusters = LabelClusters.from_assignment(torch.tensor([0, 0, 1, 1, 2, 2]), 3)
    model = build_model(registry, config, clusters)
    ids = torch.randint(1000, 2000, (2, 6))
    mask = torch.ones_like(ids)
    positives = torch.tensor([[0, -1], [3, 5]])
    embedding = model.encoder.transformer.embeddings.word_embeddings.weight
    for part in ("recall", "rank"):
        model.zero_grad()
        representation = model.encoder(ids, mask)
        recall_logits = model.recaller(representation)
        if part == "recall":
            loss = recall_logits.sum()
        else:
            candidates = model.sampler(recall_logits.detach(), positives, model.clusters, torch.arange(2))
            loss = model.ranker(representation, candidates.labels).sum()
        loss.backward()
        assert embedding.grad is not None and embedding.grad.abs().sum() > 0, part


def test_validation_split_selects_an_epoch_without_the_test_set(registry, tiny_model_dir, tiny_dataset, tmp_path):
    plan = plan_run(registry, "lightxml", str(tiny_dataset),
                           set_options=tiny_options(tiny_model_dir, validation_size=8, swa="false"))
    lines = []
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lines.append)
    log = json.loads((run_dir / "training_log.json").read_text())
    assert [v["epoch"] for v in log["validation"]] == [1, 2]
    assert log["selected_epoch"] in (1, 2)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resolved"]["train_docs"] == 40
    # each validation's score is in the log; a run whose best epoch is its last says the budget ended it
    shown = [line for line in lines if line.startswith("validation after epoch")]
    assert [line.split(":")[0] for line in shown] == ["validation after epoch 1 of 2", "validation after epoch 2 of 2"]
    assert all(f"P@5 {v['score']:.2f}" in line for line, v in zip(shown, log["validation"]))
    capped = log["selected_epoch"] == 2 and log["stopped_early"] is None
    assert ("budget" in config) == capped == any("still improving" in line for line in lines)
    if capped:
        assert config["budget"] == {"epochs": 2, "still_improving": True,
                                    "validation": [{"epoch": v["epoch"], "score": v["score"]} for v in log["validation"]]}


def test_still_improving_means_best_at_the_last_epoch_without_an_early_stop():
    from types import SimpleNamespace

    from xmcbench.callbacks import still_improving

    def log(scores, stopped=None):
        best = max(range(len(scores)), key=lambda i: (scores[i], -i)) + 1 if scores else None
        return SimpleNamespace(validation=[{"epoch": e + 1, "score": s} for e, s in enumerate(scores)],
                               selected_epoch=best, stopped_early=stopped)

    assert still_improving(log([15.8, 24.4, 26.3, 26.8, 27.7]), 5)
    assert not still_improving(log([15.8, 27.7, 26.3]), 3)
    assert not still_improving(log([]), 3), "no validation split: nothing says it was still improving"
    assert not still_improving(log([1.0, 2.0], stopped=2), 3)
