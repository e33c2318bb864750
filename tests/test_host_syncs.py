"""A training step must not make the host wait for the GPU beyond what its data-dependent parts need.

Counted on the CPU (xmcbench.profiling dispatches the same operations a GPU would wait on): the step's
syncs beyond the encoder's own forward and backward."""

import numpy as np
import pytest
import torch

from xmcbench.modelio import build_model
from xmcbench.training import Trainer
from xmcbench.profiling import count_host_syncs
from xmcbench.registry import build_registry
from xmcbench.tokenization import tokenize
from xmcbench.indexing import label_clusters
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import split_train_rows

# with label clusters: the ranker's torch.unique over the batch's candidates (scored once each through one
# matrix product) and RowAdam's coalescing of the label-embedding gradient; flat: nothing
ALLOWED_BEYOND_THE_ENCODER = {1: {}, 2: {"aten._unique2": 1, "aten._coalesce": 1}}


def trainer_for(tiny_model_dir, tiny_dataset, cluster_size):
    registry = build_registry()
    options = {"model_name": str(tiny_model_dir), "pretrained_weights": "false", "num_layers": 2,
               "cluster_size": cluster_size, "top_clusters": 2, "max_length": 32, "hidden_size": 8,
               "batch_size": 8, "threads": 1}
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=[f"{k}={v}" for k, v in options.items()])
    rows, _ = split_train_rows(plan.loaded, plan.config)
    model = build_model(registry, plan.config, label_clusters(plan.loaded, plan.config, rows, registry))
    tokens = tokenize(plan.loaded.train_texts, model.encoder.tokenizer, 32, texts_key=None).subset(rows)
    trainer = Trainer(model, tokens, plan.loaded.train_labels[rows], plan.config, torch.device("cpu"))
    trainer.prepare()
    return trainer, tokens


@pytest.mark.parametrize("cluster_size", [1, 2])
def test_a_training_step_waits_for_the_device_only_where_its_data_decides_a_size(
        tiny_model_dir, tiny_dataset, cluster_size):
    trainer, tokens = trainer_for(tiny_model_dir, tiny_dataset, cluster_size)
    trainer.train_step(np.arange(8))   # optimizer states exist from here on
    encoder = trainer.model.encoder
    with count_host_syncs() as encoder_alone:
        encoder(*tokens.batch(np.arange(8, 16))).sum().backward()
    with count_host_syncs() as step:
        trainer.train_step(np.arange(8, 16))
    beyond = {name: count - encoder_alone[name] for name, count in step.items() if count > encoder_alone[name]}
    assert beyond == ALLOWED_BEYOND_THE_ENCODER[cluster_size]


def test_losses_are_read_from_the_device_every_few_steps_and_before_checkpoints(tiny_model_dir, tiny_dataset):
    from xmcbench.training import LOSS_READ_EVERY

    trainer, _ = trainer_for(tiny_model_dir, tiny_dataset, 2)
    for step in range(LOSS_READ_EVERY - 1):
        trainer.train_step(np.arange(8 * (step % 5), 8 * (step % 5) + 8))
    assert trainer.log.steps == [] and len(trainer.unread_losses) == LOSS_READ_EVERY - 1
    trainer.train_step(np.arange(8))
    assert [record["step"] for record in trainer.log.steps] == list(range(1, LOSS_READ_EVERY + 1))
    assert all(np.isfinite(record[key]) for record in trainer.log.steps for key in ("loss", "recall", "rank"))
    trainer.train_step(np.arange(8))
    trainer.save_checkpoint()   # no checkpoint folder: still reads what is pending
    assert len(trainer.log.steps) == LOSS_READ_EVERY + 1 and not trainer.unread_losses
