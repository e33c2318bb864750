"""The run of a method built from registered components (encoder, recaller, ranker, sampler): refuse what
cannot work before the output folder is touched, build the model, tokenize, train, predict, score, write."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from xmcbench.callbacks import JsonLog, ValidationLog, still_improving
from xmcbench.checkpoint import load_checkpoint
from xmcbench.config import TrainConfig, training_stages
from xmcbench.data import Dataset
from xmcbench.device import pick_device, seed_everything, set_threads
from xmcbench.distributed import Distributed, broadcast_text, shutdown
from xmcbench.errors import TrainingInterrupted, XmcError, joined_line
from xmcbench.formats import open_dataset
from xmcbench.fusion import with_tail_slots
from xmcbench.indexing import label_clusters, resolve_num_clusters
from xmcbench.inference import predict
from xmcbench.labels import label_info
from xmcbench.model import XMCModel
from xmcbench.modelio import build_model, save_model_dir
from xmcbench.registry import Registry
from xmcbench.rundir import ClaimedRun, claim_existing, claim_output, default_output, is_finished, note_budget, \
    write_results, write_run_config
from xmcbench.runs.plan import Plan, log_run_header, provenance
from xmcbench.runs.splits import split_train_rows, training_view
from xmcbench.scoring import filtered_pairs, propensities, room_for_filtered_pairs, score, zero_shot_mask
from xmcbench.storage import read_json
from xmcbench.tokenization import tokenize
from xmcbench.training import Trainer


def run_component_method(plan: Plan, output: Path | None, data_dir: Path | None, overwrite: bool, registry: Registry,
                         log, resume: bool, dist: Distributed) -> Path:
    """launch.run for a method built from components, in one process of a (possibly distributed) run: every
    process trains and predicts its share, rank 0 alone writes the run directory and logs."""
    config = plan.config
    if not dist.is_main:
        log = lambda line: None  # noqa: E731  (one voice per run)
    # everything that can refuse the run does so before the output folder is touched
    threads = set_threads(config)
    device = pick_device(config, dist)
    dataset = plan.loaded or open_dataset(registry, plan.dataset, data_dir, plan.reading)
    check_flat(plan, dataset, registry)
    room_for_filtered_pairs(plan.config, dataset, log)
    check_components(registry, plan, dataset)
    claimed = None
    output = Path(output) if output else default_output(plan)
    if dist.is_main:
        claimed = claim_existing(output) if resume else claim_output(output, overwrite, is_finished)
        output = claimed.directory
    if dist.enabled:   # every process writes into the one directory rank 0 claimed (names carry the time)
        output = Path(broadcast_text(dist, str(output)))
    try:
        return _train_and_write(plan, output, claimed, dataset, threads, device, registry, log, resume, dist)
    finally:
        if claimed is not None:
            claimed.release()


def runs_flat(registry: Registry, config: TrainConfig, num_labels: int) -> bool:
    """Whether a run scores every label with the recaller alone, without ranker or sampler: one label per cluster,
    unless the recaller is a retriever that shortlists labels for the ranker and sampler the settings name."""
    shortlists = config.recaller in registry.retrievers and bool(config.ranker and config.sampler)
    return resolve_num_clusters(config, num_labels) == num_labels and not shortlists


def check_flat(plan: Plan, dataset: Dataset, registry: Registry) -> None:
    """Refuse, before the run folder is touched, a flat run (one logit per label: no clusters, no ranker) of a
    method whose stages train the ranker on its own."""
    spec = registry.method(plan.method)
    flat = runs_flat(registry, plan.config, dataset.num_labels)
    stages = training_stages(spec.stages, plan.config)
    if flat and any("rank" in stage.losses and "recall" not in stage.losses for stage in stages):
        raise XmcError(f"{plan.method} trains a ranker in a stage of its own, which needs label clusters, and this run "
                       f"is flat ({dataset.num_labels} labels, below flat_below={plan.config.flat_below}, or "
                       "cluster_size=1): set cluster_size above 1 (e.g. --set cluster_size=8)")


def check_components(registry: Registry, plan: Plan, dataset: Dataset) -> None:
    """Run the checks of the components a run will use (`add_component(..., check=...)`: a flat run uses no
    ranker or sampler) on its settings and its labels (xmcbench.labels.label_info), before the output folder
    is touched; a refusal is one XmcError line naming the component."""
    config = plan.config
    flat = runs_flat(registry, config, dataset.num_labels)
    checks = [(kind, name, registry.component_checks[(kind, name)])
              for kind, name in components_that_ran(config, flat).items()
              if (kind, name) in registry.component_checks]
    if not checks:
        return
    labels = label_info(dataset, config, split_train_rows(dataset, config)[0])
    for kind, name, check in checks:
        try:
            check(config, labels)
        except XmcError as error:
            raise XmcError(f"{kind} {name} refuses this run: {joined_line(error)}") from None


def components_that_ran(config: TrainConfig, flat: bool) -> dict[str, str]:
    """config.json's record of the components a run used: a flat run has no ranker and no sampler, whatever
    its settings name."""
    return {"encoder": config.encoder, "recaller": config.recaller,
            "ranker": "none (flat)" if flat else config.ranker, "sampler": "none (flat)" if flat else config.sampler}


def _train_and_write(plan: Plan, output: Path, claimed: ClaimedRun | None, dataset: Dataset, threads: int,
                     device: torch.device, registry: Registry, log, resume: bool, dist: Distributed) -> Path:
    config = plan.config
    if resume:
        recorded = read_json(output / "config.json")["dataset_version"]
        if recorded != dataset.version:
            raise XmcError(f"the dataset {plan.dataset} changed since {output} was started "
                           f"(version {dataset.version}, recorded {recorded}); start a new run instead")
    weights = propensities(dataset, config)   # the dataset's, before any label is held out of training
    dataset, held_out = training_view(dataset, config, registry.method(plan.method), log)
    log(f"{plan.method} on {dataset.name}: {len(dataset.train_texts)} train / {len(dataset.test_texts)} test "
        f"documents, {dataset.num_labels} labels; device {device}, {threads} threads"
        + (f", {dist.world_size} processes (global batch {config.batch_size}, about "
           f"{config.batch_size / dist.world_size:g} documents per process)" if dist.enabled else ""))
    log_run_header(plan, dataset, log)
    seed_everything(config.seed)
    train_rows, validation_rows = split_train_rows(dataset, config)
    with dist.main_first():   # rank 0 fills the caches, the others read them
        clusters = label_clusters(dataset, config, train_rows, registry)
    run_labels = label_info(dataset, config, train_rows, weights)
    model = build_model(registry, config, clusters, label_info=run_labels)
    if model.is_flat:
        dropped = (f"flat run ({dataset.num_labels} labels, one logit each): the ranker {config.ranker!r} and the "
                   f"sampler {config.sampler!r} are not used; --set cluster_size=8 (or more) trains them")
        log(("warning: " if registry.method(plan.method).needs_ranker else "") + dropped)
    tokenizer = model.encoder.tokenizer
    document_length = model.encoder.tokens_to_read(config.max_length)
    with dist.main_first():
        train_tokens = tokenize(dataset.train_texts, tokenizer, document_length, f"{dataset.version}/train",
                                description="tokenizing train")
        test_tokens = tokenize(dataset.test_texts, tokenizer, document_length, f"{dataset.version}/test",
                               description="tokenizing test")
    if dist.enabled:   # same initial weights everywhere (DDP also broadcasts them), different dropout masks
        torch.manual_seed(config.seed + dist.rank)

    def label_tokens():   # tokenized only when a component asks for label embeddings; names where no texts
        texts = run_labels.texts or run_labels.names
        with dist.main_first():
            return tokenize(list(texts), tokenizer, config.max_length,
                            f"{dataset.version}/label-{'texts' if run_labels.has_texts else 'names'}",
                            description="tokenizing label texts")

    validation_tokens = train_tokens.subset(validation_rows) if len(validation_rows) else None
    selection_k = int(config.selection_metric.split("@")[1])   # validation scores only the metric it selects by

    def validate(candidate: XMCModel) -> float:
        found = predict(candidate, validation_tokens, config, device, description="validating", dist=dist)
        return score(found, dataset.train_labels[validation_rows], candidate, weights, ks=(selection_k,),
                     frequency_bins=False,
                     filtered=filtered_pairs(dataset, "train", rows=validation_rows),
                     families=registry.metric_families())[config.selection_metric]

    if dist.is_main:
        output.mkdir(parents=True, exist_ok=True)
        if not resume:
            write_run_config(output, plan, dataset, registry, {
                "num_labels": dataset.num_labels, "num_clusters": clusters.num_clusters, "flat": clusters.is_flat,
                "components": components_that_ran(config, model.is_flat),
                "threads": threads, "device": str(device), "processes": dist.world_size,
                "train_docs": len(train_rows), "validation_docs": len(validation_rows),
                **({"zero_shot_labels": held_out} if held_out else {}),
                "encoder_loaded_dtype": model.encoder.loaded_dtype,
                "parameter_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
                provenance(registry, plan.method, config))
    stages = training_stages(registry.method(plan.method).stages, config)
    trainer = Trainer(model, train_tokens.subset(train_rows), dataset.train_labels[train_rows], config, device,
                      validate if len(validation_rows) else None, checkpoint_dir=output / "checkpoints",
                      stages=stages, dist=dist,
                      callbacks=[ValidationLog(log, config), *training_loggers(registry, config, output)]
                      if dist.is_main else (),
                      label_info=run_labels, label_tokens=label_tokens,
                      validation=(validation_tokens, dataset.train_labels[validation_rows])
                      if len(validation_rows) else None)
    if resume:
        state = load_checkpoint(output / "checkpoints")
        if state is not None:
            trainer.load_state_dict(state)
            log(f"resuming {output} at step {trainer.step} ({trainer.position()})")
    try:
        model, _ = trainer.fit()
    except TrainingInterrupted as stop:
        raise TrainingInterrupted(f"{stop}; continue with: xmcbench run --resume {output}") from None
    trainer.finalize()   # e.g. a retriever builds its label index from the final weights
    epochs = stages[-1].epochs(config)
    if dist.is_main and still_improving(trainer.log, epochs):
        log(f"training ended at its budget of {epochs} epochs while the validation score was still improving: "
            "more epochs may score better (--set epochs=N; config.json records it)")
        note_budget(output, epochs, trainer.log)
    train_seconds = trainer.train_seconds
    started = time.perf_counter()
    predictions = predict(model, test_tokens, config, device, description="predicting test", dist=dist)
    predict_seconds = time.perf_counter() - started
    validation_predictions = None
    if len(validation_rows):   # kept for ensembles, which choose member weights on these rows, never on test
        validation_predictions = predict(model, validation_tokens, config, device,
                                         description="predicting validation", dist=dist)
    shutdown(dist, together=True)   # the last collective is behind every process: rank 0 writes alone from here
    if not dist.is_main:
        return output
    predictions = with_tail_slots(predictions, run_labels.inverse_propensities, config.tail_alpha)
    validation_predictions = with_tail_slots(validation_predictions, run_labels.inverse_propensities, config.tail_alpha)
    metrics = score(predictions, dataset.test_labels, model, weights, config.eval_ks, filtered=dataset.test_filter,
                    zero_shot=zero_shot_mask(run_labels.counts, dataset.num_labels, len(dataset.label_names)),
                    families=registry.metric_families())
    save_model_dir(output / "model", model, config, dataset.label_names[:dataset.num_labels], run_labels)
    write_results(output, dataset, metrics, predictions, validation_predictions=validation_predictions,
                  validation_rows=validation_rows, train_seconds=train_seconds,
                  documents_trained=trainer.documents_trained, predict_seconds=predict_seconds, resumed=resume,
                  device=device)
    if not config.keep_checkpoint:
        shutil.rmtree(output / "checkpoints", ignore_errors=True)
    return claimed.finish()


def training_loggers(registry: Registry, config: TrainConfig, output: Path) -> list:
    """The run's loggers: the run directory's JSON log (training_log.json and loss.png, which reports read),
    then config.loggers in the order given."""
    return [JsonLog(output), *(registry.logger(name)(output, config) for name in config.loggers)]
