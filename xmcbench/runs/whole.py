"""The run of a whole method (xmcbench.interfaces.WholeMethod): the run folder a component method's run writes
— config.json, environment.json, timings.json, predictions.safetensors and predictions.npz,
validation_predictions.safetensors (with a validation split), data_report.json, metrics.json last, the
`.xmcbench-run` claim — with the same split of the training set, the same propensities and the same scoring
code. It has no training_log.json or loss.png: fitting is one call. It runs on the device the method can use
(WholeMethod.devices), recorded in config.json. `xmcbench run --resume` continues a method whose fit keeps
checkpoints (it declares `checkpoint_dir`) and is refused, in one line, for one that does not."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import torch

from xmcbench.data import Dataset
from xmcbench.device import seed_everything, set_threads
from xmcbench.distributed import Distributed
from xmcbench.errors import XmcError
from xmcbench.formats import open_dataset
from xmcbench.fusion import with_tail_slots
from xmcbench.interfaces import WholeMethod, call_factory
from xmcbench.labels import label_info
from xmcbench.registry import Registry
from xmcbench.rundir import ClaimedRun, claim_existing, claim_output, default_output, is_finished, write_results, \
    write_run_config
from xmcbench.runs.plan import Plan, log_run_header, provenance
from xmcbench.runs.splits import split_train_rows, training_view
from xmcbench.scoring import propensities, room_for_filtered_pairs, score, zero_shot_mask
from xmcbench.whole_methods import check_inputs, documents_of, keeps_checkpoints, method_device, predict, \
    reads_features, save_model_dir


def run_whole_method(plan: Plan, method: type[WholeMethod], output: Path | None, data_dir: Path | None,
                     overwrite: bool, registry: Registry, log, resume: bool, dist: Distributed) -> Path:
    """launch.run for a whole method: refuse what cannot work before the output folder is touched, claim it
    (`--overwrite` and `--resume` as for any run), fit, predict, score, write the run directory."""
    if dist.enabled:
        raise XmcError(f"{plan.method} is a whole method, which runs in one process: run it without torchrun")
    if resume and not keeps_checkpoints(method):
        raise XmcError(f"{plan.method} keeps no checkpoint while it fits, so --resume cannot continue it; fit it "
                       f"again: xmcbench run {plan.method} ... --output {output} --overwrite")
    threads = set_threads(plan.config)
    device = method_device(plan.method, method, plan.config)
    dataset = plan.loaded or open_dataset(registry, plan.dataset, data_dir, plan.reading)
    check_inputs(plan.method, method, dataset, registry)
    room_for_filtered_pairs(plan.config, dataset, log)
    method.check(plan.config, dataset.num_labels)
    output = Path(output) if output else default_output(plan)
    claimed = claim_existing(output) if resume else claim_output(output, overwrite, is_finished)
    try:
        return _fit_and_write(plan, method, claimed, dataset, threads, device, registry, log, resume)
    finally:
        claimed.release()


def _fit_and_write(plan: Plan, method: type[WholeMethod], claimed: ClaimedRun, dataset: Dataset, threads: int,
                   device: torch.device, registry: Registry, log, resume: bool) -> Path:
    output = claimed.directory
    config = dataclasses.replace(plan.config, device=str(device))   # what the method computes on
    weights = propensities(dataset, config)   # the dataset's, before any label is held out of training
    dataset, held_out = training_view(dataset, config, registry.method(plan.method), log)
    num_labels = dataset.num_labels
    features = reads_features(method, dataset)
    inputs = f"the dataset's sparse features ({dataset.train_features.shape[1]} columns)" if features else "texts"
    log(f"{plan.method} on {dataset.name}: {dataset.train_labels.shape[0]} train / {dataset.test_labels.shape[0]} "
        f"test documents, {num_labels} labels, read as {inputs}; whole method "
        f"{method.__module__}.{method.__qualname__}, device {device}, {threads} threads")
    # the one derived setting a whole method sees: its training rows
    log_run_header(plan, dataset, log, {key: value for key, value in plan.derived.items() if key == "validation_size"})
    seed_everything(config.seed)
    train_rows, validation_rows = split_train_rows(dataset, config)
    run_labels = label_info(dataset, config, train_rows, weights)
    output.mkdir(parents=True, exist_ok=True)
    if resume:
        log(f"resuming {output}: {plan.method} continues from its checkpoint")
    else:
        write_run_config(output, plan, dataset, registry, {
            "num_labels": num_labels, "threads": threads, "device": str(device), "processes": 1,
            "train_docs": len(train_rows), "validation_docs": len(validation_rows),
            "whole_method": f"{method.__module__}.{method.__qualname__}", "deterministic": method.deterministic,
            "inputs": "features" if features else "texts", **({"zero_shot_labels": held_out} if held_out else {})},
            provenance(registry, plan.method, plan.config), packages=method.packages)

    started = time.perf_counter()
    fit = method.fit_features if features else method.fit
    checkpoints = output / "checkpoints"
    model = call_factory(fit, documents_of(dataset, "train", train_rows, features),
                         dataset.train_labels[train_rows][:, :num_labels].tocsr(), num_labels, config, log,
                         label_info=run_labels, checkpoint_dir=checkpoints)
    train_seconds = time.perf_counter() - started
    started = time.perf_counter()
    predictions = predict(model, documents_of(dataset, "test", None, features), config.top_k)
    predict_seconds = time.perf_counter() - started
    validation_predictions = None
    if len(validation_rows):   # for ensembles, which choose member weights on these rows, never on test
        validation_predictions = predict(model, documents_of(dataset, "train", validation_rows, features),
                                         config.top_k)
    predictions = with_tail_slots(predictions, run_labels.inverse_propensities, config.tail_alpha)
    validation_predictions = with_tail_slots(validation_predictions, run_labels.inverse_propensities, config.tail_alpha)

    metrics = score(predictions, dataset.test_labels, None, weights, config.eval_ks, filtered=dataset.test_filter,
                    zero_shot=zero_shot_mask(run_labels.counts, num_labels, len(dataset.label_names)),
                    families=registry.metric_families())
    save_model_dir(output / "model", model, plan.method, config, dataset.label_names[:num_labels], run_labels)
    # one pass over the training documents: the ms/document/epoch of a component method's run
    write_results(output, dataset, metrics, predictions, validation_predictions=validation_predictions,
                  validation_rows=validation_rows, train_seconds=train_seconds, documents_trained=len(train_rows),
                  predict_seconds=predict_seconds, resumed=resume, device=device)
    if not config.keep_checkpoint:
        shutil.rmtree(checkpoints, ignore_errors=True)
    return claimed.finish()
