"""Dataset-aware defaults: settings derived from a training set's statistics and the device.

A dataset without a preset of the method gets these instead of fixed numbers: the statistics of its training
set (documents, labels, label frequencies, token lengths under the encoder's tokenizer) and the device decide
the settings in RULES below. README.md shows the rule as a table (statistic -> setting -> why).

Resolution order with the rule (config.resolve_config):
    TrainConfig defaults < derived < method defaults < preset < --config file < --set
so a method's own deliberate defaults, a preset, a config file and --set all win over a derived value; a
derived value that something later overrides is not reported as derived.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# A change to any rule below changes the configurations it derives: bump it, so results stay traceable.
# 3: the token-length sample is the same for every seed (under 2 the seed drew it, and seeds of one
# comparison could get different max_length).
# 4: a whole method gets only WHOLE_METHOD_DERIVED (up to 3 it also recorded the training loop's settings, which
# it never reads; derived from the device, they split its runs on two machines into two report variants).
# 5: LightXML's heads learn at 1e-3 where its rows start at PIFA (plugins/xmcbench_lightxml/methods.py).
# 6: a flat LightXML head reads a bag of 4,096 buckets of word pieces beside the [CLS] states (the same file).
# 7: that bag reads up to 512 word pieces of each document, in 8,192 buckets, scaled to length 4 (the same file).
# (An 8 that ranked a flat LightXML run's places after the 4th by score over propensity, tail_alpha 1, was reverted
# two commits later: on the pair fixed to decide it the hybrid built on such runs fell below LightXML in PSP@5. A 9,
# the same with a hybrid that keeps its members' tail slots, was reverted too: on debian-debtags-mini seed 5 that
# hybrid only tied LightXML's P@1.)
# 10: 9's tail slots again, and a fitted hybrid's stacked model chooses its alpha on the validation ranking with its
#     members' tail slots in place (xmcbench.fusion.served_metrics), so the two do not add the propensity twice.
RULE_VERSION = 10

LENGTH_SAMPLE = 2000             # training texts tokenized (without truncation) for the length distribution
LENGTH_QUANTILE = 0.9            # max_length covers this share of training texts whole...
LENGTH_STEP = 32                 # ...rounded up to a multiple of this
CPU_MAX_LENGTH = 128             # a CPU pays ~linearly per token: beyond this, longer texts are truncated
GPU_MAX_LENGTH = 512
MIN_VALIDATION_DOCUMENTS = 1000  # below this many training documents, none are held out
VALIDATION_SHARE = 0.1
VALIDATION_RANGE = (200, 4000)   # the paper holds out 4,000 documents of Wiki-500K / Amazon-670K
FLAT_MAX_LABELS = 30000          # the paper's models are flat up to Wiki10-31K's 30,938 labels
CLUSTER_SIZE = 64                # beyond: the paper's Wiki-500K / Amazon-670K clusters hold 62 / 82 labels...
TOP_CLUSTERS = 32                # ...and its Wiki-500K model recalls 32 of them
TARGET_STEPS = 1000              # steps after which the heads have converged on the tuning sets (README)
RARE_LABEL_STEPS = 2             # with a validation split, the cap grows by this x TARGET_STEPS x the rare share
EPOCH_RANGE = (3, 10)
PATIENCE = 2
SWA_UPDATES_PER_EPOCH = 4
HEAD_LR = 1e-2
# what the run itself reads for a whole method (a linear tree fits on its own, with no batches, epochs or heads):
# the validation split. A whole method derives anything else it reads through MethodSpec.derive.
WHOLE_METHOD_DERIVED = ("validation_size",)


@dataclass(frozen=True)
class DatasetStatistics:
    """What the rule reads of a training set (all counts over the training rows the run will use)."""

    documents: int                 # training documents before any validation split
    labels: int                    # training label vocabulary
    labels_per_document: float
    median_documents_per_label: float
    share_of_labels_with_at_most_2_documents: float
    share_of_documents_with_the_top_label: float
    token_length_p50: int          # tokens per text, special tokens included, no truncation,
    token_length_p90: int          # over a sample of at most LENGTH_SAMPLE training texts, the same for every seed
    token_length_p95: int
    model_max_length: int          # positions the encoder can read (its tokenizer's limit)
    # its tokenizer pads and truncates on the right (True where there is none): a window of more than max_length
    # tokens can be cut down to the transformer's
    tokenizer_cuts_on_the_right: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeviceFacts:
    kind: str                      # "cpu" or "cuda"
    gpu_memory_gib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Derived:
    value: Any
    source: str    # the statistics it follows from, with their values
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dataset_statistics(train_texts: list[str] | None, train_labels, tokenizer) -> DatasetStatistics:
    """train_labels: (N, L) 0/1 csr of the training documents; tokenizer: the encoder's (fast) tokenizer, None
    for a method that reads no tokens (token lengths and model_max_length then count as 0); train_texts: None
    for a dataset of sparse features only (token lengths then count as 0). The length sample is drawn by a fixed
    generator, not the run's seed: given the documents in the same order, every seed gets the same settings."""
    documents, labels = train_labels.shape
    counts = np.bincount(train_labels.indices, minlength=labels)
    seen = counts[counts > 0]
    sample = np.random.default_rng(0).permutation(documents)[:LENGTH_SAMPLE] \
        if train_texts and tokenizer is not None else []
    lengths = np.array([len(ids) for ids in tokenizer([train_texts[i] for i in sample], add_special_tokens=True,
                                                      truncation=False, verbose=False)["input_ids"]]) if len(sample) \
        else np.zeros(0)
    if not len(lengths):
        lengths = np.zeros(1)
    from xmcbench.tokenization import cuts_on_the_right   # here: registering a plugin must not import torch

    limit = getattr(tokenizer, "model_max_length", GPU_MAX_LENGTH) if tokenizer is not None else 0
    return DatasetStatistics(
        documents=int(documents),
        labels=int(labels),
        labels_per_document=round(float(train_labels.nnz) / max(documents, 1), 3),
        median_documents_per_label=float(np.median(seen)) if len(seen) else 0.0,
        share_of_labels_with_at_most_2_documents=round(float(np.mean(seen <= 2)) if len(seen) else 0.0, 4),
        share_of_documents_with_the_top_label=round(float(counts.max(initial=0)) / max(documents, 1), 4),
        token_length_p50=int(np.percentile(lengths, 50)),
        token_length_p90=int(np.percentile(lengths, 90)),
        token_length_p95=int(np.percentile(lengths, 95)),
        model_max_length=(int(limit) if limit < 1_000_000 else GPU_MAX_LENGTH) if tokenizer is not None else 0,
        tokenizer_cuts_on_the_right=tokenizer is None or cuts_on_the_right(tokenizer),
    )


def derive_settings(stats: DatasetStatistics, device: DeviceFacts) -> dict[str, Derived]:
    """The dataset-aware settings, each with the statistics it follows from and why (README's table)."""
    derived: dict[str, Derived] = {}
    n, labels = stats.documents, stats.labels

    validation = 0
    if n >= MIN_VALIDATION_DOCUMENTS:
        validation = int(min(max(round(VALIDATION_SHARE * n), VALIDATION_RANGE[0]), VALIDATION_RANGE[1]))
    derived["validation_size"] = Derived(
        validation, f"documents = {n}",
        f"{VALIDATION_SHARE:.0%} of the training documents, within {VALIDATION_RANGE}, held out to select the "
        f"epoch and stop early; none below {MIN_VALIDATION_DOCUMENTS} documents" if validation else
        f"below {MIN_VALIDATION_DOCUMENTS} training documents every one is needed for training")
    train_documents = n - validation

    if stats.model_max_length:   # 0: the method reads no tokens (no model_name), so no length to choose
        cap = min(GPU_MAX_LENGTH if device.kind == "cuda" else CPU_MAX_LENGTH, stats.model_max_length)
        covering = int(math.ceil(stats.token_length_p90 / LENGTH_STEP) * LENGTH_STEP)
        derived["max_length"] = Derived(
            max(LENGTH_STEP, min(covering, cap)),
            f"token length p90 = {stats.token_length_p90} (p50 {stats.token_length_p50}); device {device.kind}",
            f"covers {LENGTH_QUANTILE:.0%} of texts whole, rounded up to a multiple of {LENGTH_STEP}, at most {cap} "
            f"on {device.kind} (the encoder's cost grows with length; short texts should not pay for 512)")

    batch_size = 32 if device.kind == "cuda" and train_documents >= 20000 else 16
    derived["batch_size"] = Derived(
        batch_size, f"device {device.kind}; training documents = {train_documents}",
        "32 on a GPU with at least 20,000 training documents (the paper's batch for its large sets), else 16 "
        "(LightXML's default): small sets need the steps")

    flat = labels <= FLAT_MAX_LABELS
    derived["cluster_size"] = Derived(
        1 if flat else CLUSTER_SIZE, f"labels = {labels}",
        f"flat (one logit per label) up to {FLAT_MAX_LABELS:,} labels, as the paper's models up to Wiki10-31K "
        f"(on a 5,000-document cut of debian-builddeps flat beat clusters of 16 in PSP@5); beyond, clusters of "
        f"about {CLUSTER_SIZE} labels, the paper's size at Wiki-500K and Amazon-670K")
    if not flat:
        derived["top_clusters"] = Derived(
            TOP_CLUSTERS, f"cluster size = {CLUSTER_SIZE}",
            f"the paper's Wiki-500K setting: {TOP_CLUSTERS} recalled clusters, about "
            f"{TOP_CLUSTERS * CLUSTER_SIZE:,} candidate labels per document for the ranker")

    derived["head_lr"] = Derived(
        HEAD_LR, "the recaller and ranker start from random weights, the encoder from pretrained ones",
        f"heads learn at {HEAD_LR:g}, 100x the encoder's lr: on debian-debtags-mini two epochs at 1e-2 reach "
        "P@1 87.2 / PSP@5 50.3, at 1e-3 82.4 / 37.5 (and 87.4 / 48.6 only after eight)")

    steps_per_epoch = max(1, math.ceil(train_documents / batch_size))
    rare = stats.share_of_labels_with_at_most_2_documents
    if validation:   # a cap: validation stops training once it no longer improves
        steps = int(round(TARGET_STEPS * (1 + RARE_LABEL_STEPS * rare)))
        why = (f"a cap of {steps:,} steps ({TARGET_STEPS:,}, plus {RARE_LABEL_STEPS} x {TARGET_STEPS:,} x the share "
               f"of labels with at most 2 documents: a rare label's row sees its positives once an epoch), within "
               f"{EPOCH_RANGE}; training stops earlier after {PATIENCE} epochs without a better validation score")
    else:
        steps = TARGET_STEPS
        why = (f"enough epochs for {TARGET_STEPS:,} steps, where validation P@5 stopped improving on the tuning sets, "
               f"within {EPOCH_RANGE} (no validation split to stop earlier)")
    epochs = int(min(max(math.ceil(steps / steps_per_epoch), EPOCH_RANGE[0]), EPOCH_RANGE[1]))
    derived["epochs"] = Derived(
        epochs, f"{steps_per_epoch} steps per epoch ({train_documents} documents / batch {batch_size})"
                + (f"; {rare:.0%} of labels with at most 2 documents" if validation else ""), why)
    swa_every = max(1, steps_per_epoch // SWA_UPDATES_PER_EPOCH)
    derived["swa_every_steps"] = Derived(
        swa_every, f"{steps_per_epoch} steps per epoch",
        f"the paper's SWA, {SWA_UPDATES_PER_EPOCH} snapshots an epoch from the second epoch on: on "
        "debian-debtags-mini it took P@1 / PSP@5 after 4 epochs from 87.9 / 52.9 to 90.3 / 53.4")
    derived["swa_start_epoch"] = Derived(1, "every run",
                                         "the first epoch's weights are too far from the end to average")
    if validation:
        derived["patience"] = Derived(PATIENCE, f"validation_size = {validation}",
                                      "early stopping on the validation split, never the test set")
    return derived
