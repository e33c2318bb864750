"""The `lightxml` method and the paper's per-dataset hyperparameters.

Presets follow the paper's Table 2, completed from the authors' run script (epochs, batch size, maximum
length, bottleneck h, clusters, recalled clusters b, SWA schedule). The original script trains
`epoch + 5` epochs; these are the epochs the paper states.
"""

from xmcbench.config import MethodSpec, Stage, TrainConfig
from xmcbench.defaults import DatasetStatistics, Derived, DeviceFacts
from xmcbench_lightxml.options import HEAD_INIT, LEXICAL_BUCKETS

LIGHTXML_DEFAULTS = {
    "encoder": "transformer-cls",
    "recaller": "cluster-linear",
    "ranker": "bottleneck",
    "sampler": "dynamic",
    # the offline default encoder, shipped inside a PyPI package; the paper's presets use BERT-base
    "model_name": "sentence-transformers/all-MiniLM-L6-v2",
    "num_layers": 5,
    "dropout": 0.5,
    "lr": 1e-4,
    "weight_decay": 0.01,
    # a flat recaller's rows start at their labels' documents (PIFA): on a 5,000-document cut of debian-builddeps
    # labels with at most 10 training documents went from contributing 0.00 to PSP@5 to 0.24 (README's rule table)
    "options.head_init": "auto",
}

# SWA start is a 0-based epoch index: "from epoch 10" means after 10 finished epochs. The paper's encoder
# is BERT-base (uncased) for every dataset; its ensembles add RoBERTa and XLNet on the three smaller ones,
# which are separate runs (`--set model_name=roberta-base`, then `xmcbench ensemble`).
PAPER_ENCODER = {"model_name": "bert-base-uncased", "options.head_init": "random"}   # the paper's heads start random
PAPER_PRESETS = {
    "eurlex4k": {**PAPER_ENCODER, "epochs": 20, "batch_size": 16, "max_length": 512, "cluster_size": 1,
                 "swa_start_epoch": 10, "swa_every_steps": 200},
    "wiki10-31k": {**PAPER_ENCODER, "epochs": 30, "batch_size": 16, "max_length": 512, "cluster_size": 1,
                   "swa_start_epoch": 10, "swa_every_steps": 200},
    "amazoncat13k": {**PAPER_ENCODER, "epochs": 5, "batch_size": 16, "max_length": 512, "cluster_size": 1,
                     "swa_start_epoch": 2, "swa_every_steps": 10000},
    "wiki500k": {**PAPER_ENCODER, "epochs": 10, "batch_size": 32, "max_length": 128, "hidden_size": 500,
                 "num_clusters": 8192, "top_clusters": 32, "swa_start_epoch": 4, "swa_every_steps": 3000, "validation_size": 4000},
    "amazon670k": {**PAPER_ENCODER, "epochs": 15, "batch_size": 16, "max_length": 128, "hidden_size": 400,
                   "num_clusters": 8192, "top_clusters": 75, "swa_start_epoch": 4, "swa_every_steps": 3000, "validation_size": 4000},
}

# The embedded default must train in minutes on a 2-core CPU (about twelve), so its preset fixes three epochs
# and no validation split; the rest follows the dataset-aware rule (xmcbench/defaults.py): heads at 1e-2
# while the pretrained encoder keeps the paper's 1e-4, and four SWA snapshots an epoch from the second.
# The full Debian datasets have no preset: the rule alone decides. Their former presets kept the heads
# at 1e-3, which on debian-debtags-mini lagged 1e-2 by about 5 points of P@1 after two epochs. The embedded
# default keeps random rows: its run took 15 min on a loaded 2-core machine, and PIFA rows cost one more pass.
DEBIAN_PRESETS = {
    "debian-debtags-mini": {"epochs": 3, "batch_size": 16, "max_length": 128, "head_lr": 1e-2,
                            "swa_start_epoch": 1, "swa_every_steps": 66, "options.head_init": "random"},
}


# The rate of rows that start at PIFA: the core's 1e-2 is for heads that start at random, far from where they end
# (the measurements are in derive_flat_head's why and BENCHMARKS.md section 10).
PIFA_HEAD_LR = 1e-3
# A flat head reads the document's words beside the [CLS] states, as a linear method does (BENCHMARKS.md section 10):
# 4,096 buckets (about 7 of the vocabulary's 30,522 word pieces each) did better than 16,384 for half the price on a
# cut of debian-builddeps; on the full dataset 8,192 did better than 4,096 (P@1 86.93 -> 87.12, seed 1). The bag
# reads up to 512 word pieces, where a CPU's transformer reads 128, and is scaled to length 4, about the centred
# [CLS] states' median length.
FLAT_LEXICAL_BUCKETS = 8192
FLAT_LEXICAL_WINDOW = 512
FLAT_LEXICAL_NORM = 4.0
# A flat run's places after the 4th go by score over propensity (rule version 10): a rare label held just below the
# top 5 can take the 5th place, and P@1 and P@3 stay the model's; a fitted hybrid keeps them (xmcbench.fusion,
# choose_tail_alpha) and chooses its stacked model's alpha with them in place (served_metrics) (reports/the-tail).
FLAT_TAIL_ALPHA = 1.0


def derive_flat_head(statistics: DatasetStatistics, device: DeviceFacts, *, settings: TrainConfig) -> dict:
    """The head of a flat run (settings: the run's clusters, the core's derived cluster_size or the user's):
    a bag of word pieces (options.lexical_buckets FLAT_LEXICAL_BUCKETS, options.lexical_window FLAT_LEXICAL_WINDOW
    where that is longer than max_length and the tokenizer cuts on the right, options.lexical_norm
    FLAT_LEXICAL_NORM), head_lr PIFA_HEAD_LR where options.head_init (auto or pifa) starts each row at its
    documents, and tail slots (tail_alpha FLAT_TAIL_ALPHA). Label clusters get none of them; a run whose --set
    turns the bag off gets no window or length."""
    from xmcbench.indexing import resolve_num_clusters   # here: registering the plugin must not import torch

    if resolve_num_clusters(settings, statistics.labels) != statistics.labels:
        return {}
    flat = f"labels = {statistics.labels}: flat"
    derived = {"options.lexical_buckets": Derived(
        FLAT_LEXICAL_BUCKETS, flat,
        "a flat head reads a bag of the document's word pieces beside the [CLS] states, as a linear method reads its "
        "words: on a 5,000-document cut of debian-builddeps (seeds 0 / 1) 4,096 buckets over the transformer's "
        "window took P@1 from 85.34 / 84.72 to 86.15 / 85.40, above Bonsai's 85.75 / 85.24, for about 3 times the "
        "CPU time a document and epoch, but cost debian-debtags-mini and debian-debtags 4 points of PSP@5. 8,192 "
        "buckets over up to 512 word pieces at length 4 (options.lexical_window and options.lexical_norm) against "
        "that raw bag, 2-core CPU: the full debian-builddeps (seed 0) P@1 86.43 -> 87.37 (Bonsai 87.08), PSP@5 "
        "30.13 -> 30.62 (Bonsai 29.52), and seed 1 87.12 (Bonsai 87.23); debian-debtags-mini (seeds 0 / 1) P@1 "
        "90.80 / 90.80 -> 90.38 / 90.88 (Bonsai 86.07 / 86.32), PSP@5 53.90 / 54.84 -> 57.42 / 58.08 (Bonsai 51.97 / "
        "52.31); the full debian-debtags (seed 1) P@1 90.40 -> "
        "92.01 (Bonsai 87.96), PSP@5 67.01 -> 70.31 (Bonsai 64.88) (reports/the-tail)")}
    derived["tail_alpha"] = Derived(
        FLAT_TAIL_ALPHA, flat,
        "the places after the 4th go by score x (1 / p_l) over the rest of the top 10 (tail slots; ranking by "
        "probability over propensity maximises expected PSP@k), so P@1 and P@3 stay the model's and a rare label "
        "held just below the top 5 can take the 5th place. On 9 runs of rule version 7 (debian-debtags-mini seeds "
        "0-3, debian-debtags 0-3, debian-builddeps 0; 2-core CPU): PSP@5 +1.01 to +2.68, P@5 -0.65 to +0.15, labels "
        "with at most 3 training documents on the full debian-debtags 0.00 -> 0.08 / 0.06 / 0.03 / 0.03; a fitted "
        "hybrid ranks its own later places with at least this alpha, and its stacked model's alpha is chosen with them "
        "in place (rule version 10) (reports/the-tail)")
    if LEXICAL_BUCKETS.name in (settings.options or {}) and not LEXICAL_BUCKETS.value_of(settings):
        return derived   # --set options.lexical_buckets=0: no bag, so nothing to read it over or scale
    window = min(FLAT_LEXICAL_WINDOW, statistics.model_max_length)
    if statistics.tokenizer_cuts_on_the_right and window > settings.max_length:
        derived["options.lexical_window"] = Derived(
            window, f"{flat}; max_length = {settings.max_length}, the encoder reads {statistics.model_max_length} "
                    f"(token length p95 = {statistics.token_length_p95})",
            f"the bag reads the first {window} word pieces of each document while the transformer reads "
            f"{settings.max_length}, as a linear method reads the whole text; the bag costs little per token, the "
            "transformer every one. On the full debian-builddeps (47 % of the test texts' word pieces past the "
            "128th) it took P@1 on the documents longer than 128 tokens from 84.75 to 85.15 (seed 0, 4,096 raw "
            "buckets); options.lexical_buckets' why has the three options together")
    derived["options.lexical_norm"] = Derived(
        FLAT_LEXICAL_NORM, flat,
        f"each document's bag is scaled to length {FLAT_LEXICAL_NORM:g}, as a linear method makes each TF-IDF row "
        "unit length, so a long text's words weigh no more than a short one's; 4 is about the median length of "
        "all-MiniLM-L6-v2's centred [CLS] states (benchmarks/bag_lengths.py). On the full debian-builddeps (seed 1, "
        "512 word pieces) P@1 86.52 -> 86.93 and PSP@5 30.16 -> 30.64 against the raw bag; options.lexical_buckets' "
        "why has the three options together")
    head_init = HEAD_INIT.value_of(settings)
    if head_init != "random":
        derived["head_lr"] = Derived(
            PIFA_HEAD_LR, f"{flat}, and options.head_init={head_init} starts each row at its documents (PIFA)",
            f"rows that start at their documents learn at {PIFA_HEAD_LR:g}, not the 1e-2 of rows that start at "
            "random: against 1e-2, on a 5,000-document cut of debian-builddeps (3 seeds) PSP@5 25.74 -> 26.26 and "
            "P@1 85.01 -> 84.82 in about half the training time, on debian-debtags-mini (seed 0) PSP@5 56.93 -> "
            "58.37 and P@1 90.13 -> 90.46")
    return derived


# The paper describes its static-sampling ablations in one sentence each; this is how we read them.
# S: "negatives are static". Stage 1 trains encoder + recaller (recall loss only). Its top-b clusters for
#    every training document are then computed once and frozen (the `static` sampler). Stage 2 trains the
#    ranker and the shared encoder on those fixed candidates plus the positives (rank loss only). Because
#    stage 2 moved the encoder, stage 3 refits the recaller on the frozen encoder (refit_epochs), so one
#    encoder serves both at prediction time and the model has lightxml's size.
# BS: as S, but the ranker reads a second encoder of its own, initialised from the stage-1 encoder and
#    fine-tuned in stage 2; the recaller keeps the stage-1 encoder, so no refit is needed (twice the size).
STATIC_STAGES = (
    Stage("recall", trains=("encoder", "recaller"), losses=("recall",)),
    Stage("rank", trains=("encoder", "ranker"), losses=("rank",)),
    Stage("recall-refit", trains=("recaller",), losses=("recall",), epochs_key="refit_epochs"),
)
STATIC_BS_STAGES = (
    Stage("recall", trains=("encoder", "recaller"), losses=("recall",)),
    Stage("rank", trains=("ranker_encoder", "ranker"), losses=("rank",), start="copy-encoder-to-ranker-encoder"),
)


def lightxml_methods() -> list[MethodSpec]:
    presets = {**PAPER_PRESETS, **DEBIAN_PRESETS}
    return [
        MethodSpec(
            name="lightxml",
            description="LightXML: multi-layer [CLS] transformer, cluster recaller, bottleneck ranker, "
                        "dynamic negative sampling (Jiang et al., AAAI 2021)",
            defaults=LIGHTXML_DEFAULTS,
            presets=presets,
            derive=derive_flat_head,
        ),
        MethodSpec(
            name="lightxml-1layer",
            description="LightXML with the [CLS] state of the last layer only (the paper's single-layer ablation)",
            defaults={**LIGHTXML_DEFAULTS, "num_layers": 1},
            presets=presets,
            derive=derive_flat_head,
        ),
        MethodSpec(
            name="lightxml-static",
            description="LightXML with static negatives (the paper's S): recaller first, its top clusters frozen, "
                        "then the ranker on the shared encoder, then the recaller refitted on the frozen encoder",
            defaults={**LIGHTXML_DEFAULTS, "sampler": "static"},
            presets=presets,
            derive=derive_flat_head,
            stages=STATIC_STAGES,
            needs_ranker=True,   # the point of the variant is its negatives: warn when a flat run drops them
        ),
        MethodSpec(
            name="lightxml-static-bs",
            description="LightXML with static negatives and a second encoder for the ranker (the paper's BS)",
            defaults={**LIGHTXML_DEFAULTS, "sampler": "static", "separate_ranker_encoder": True},
            presets=presets,
            derive=derive_flat_head,
            stages=STATIC_BS_STAGES,
            needs_ranker=True,   # the point of the variant is its negatives: warn when a flat run drops them
        ),
        MethodSpec(
            name="lightxml-random-neg",
            description="LightXML with negatives drawn uniformly from non-positive clusters each step "
                        "(no recaller guidance; beyond the paper)",
            defaults={**LIGHTXML_DEFAULTS, "sampler": "random"},
            presets=presets,
            derive=derive_flat_head,
            needs_ranker=True,   # the point of the variant is its negatives: warn when a flat run drops them
        ),
    ]
