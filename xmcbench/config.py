"""Run configuration: one typed dataclass, resolved in a fixed order.

    TrainConfig defaults < method defaults < the method's preset for the dataset < --config file < --set
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from xmcbench.errors import RefusedSetting, UnknownName, closest_names_hint


@dataclass
class TrainConfig:
    """Every knob of a run. Component factories read the fields they need."""

    # components: a method names them (MethodSpec.defaults); the core names none
    encoder: str = ""
    recaller: str = ""
    ranker: str = ""
    sampler: str = ""
    # encoder
    model_name: str = ""           # the pretrained model an encoder loads (a method's default, or --set)
    pretrained_weights: bool = True  # False: random weights from the model's config (tests, benchmarks)
    num_layers: int = 5            # [CLS] states of the last n layers, concatenated
    dropout: float = 0.5
    max_length: int = 128
    # label clusters: s labels per cluster (1 = flat, 0 = automatic: flat below flat_below labels)
    cluster_size: int = 0
    num_clusters: int = 0          # overrides cluster_size when > 0 (a power of two)
    flat_below: int = 30000
    auto_cluster_size: int = 64
    indexer: str = "balanced-2means"   # what groups the labels into clusters: a registered indexer (`xmcbench plugins`)
    top_clusters: int = 10         # b: clusters recalled per document
    # a deeper label tree (CascadeXML): node counts of the levels between the recaller's and the leaf clusters,
    # coarse to fine, powers of two below the number of clusters; the recaller then scores tree_levels[0] nodes.
    # Empty: the recaller scores the leaf clusters (LightXML)
    tree_levels: tuple[int, ...] = ()
    level_top: tuple[int, ...] = ()   # nodes each tree level keeps for the next (empty: top_clusters at each)
    hidden_size: int = 300         # h: the ranker's bottleneck
    # a label's final score from its ranker's probability p and its cluster's (a retriever's: its search score's)
    # q: "product" p * q (LightXML), "weighted-sum" ranker_weight * p + (1 - ranker_weight) * q
    score_combiner: str = "product"
    ranker_weight: float = 0.5
    separate_ranker_encoder: bool = False   # the ranker reads a second encoder of its own
    # training
    epochs: int = 5
    refit_epochs: int = 1          # epochs of a stage that refits the recaller on a frozen encoder
    head_warmup_epochs: int = 0    # epochs training the fresh heads on the frozen pretrained encoder first (0: none)
    batch_size: int = 16
    eval_batch_size: int = 64
    lr: float = 1e-4
    head_lr: float = 0.0           # learning rate of everything but the encoder (0: same as lr)
    weight_decay: float = 0.01
    sparse_label_embeddings: bool = True   # update only the label-embedding rows a step touched
    swa: bool = True
    swa_start_epoch: int = 1       # SWA averaging starts after this many epochs (0-based epoch index)
    swa_every_steps: int = 200
    checkpoint_every_steps: int = 0   # also checkpoint every N steps (0: only per epoch, on Ctrl-C, at the end)
    checkpoint_every_epochs: int = 1
    keep_checkpoint: bool = False   # keep the final training checkpoint once the run has finished
    validation_size: int = 0       # training documents held out for model selection (0: none, keep the last)
    # how they are drawn: "random" (a seeded draw), or "grouped" (near-copies, TF-IDF cosine >= 0.9, all on one
    # side, as a test split that keeps related documents together; xmcbench.runs.splits)
    validation_split: str = "random"
    selection_metric: str = "P@5"  # validation metric that selects the epoch (and stops early): P@k, nDCG@k, PSP@k
    patience: int = 0              # stop after this many epochs without a better validation score (0: never)
    max_train_docs: int = 0        # train on a seeded subset (0: all)
    zero_shot_labels: float = 0.0  # share of the labels the test set has held out of training (seeded), to measure zero-shot
    length_bucketing: bool = True  # batches of similar length: less padding, same expected gradient
    amp: bool = True               # automatic mixed precision, CUDA only
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    threads: int = 0               # torch CPU threads (0: one per core)
    seed: int = 0
    top_k: int = 10                # labels kept per test document (raised to max(eval_ks) unless given)
    # > 0: the places after the 4th go by score x (1 / p_l) ** tail_alpha over the rest of the top_k (tail slots,
    # xmcbench.fusion.with_tail_slots), on the test and validation predictions and in `xmcbench predict`; 0: the
    # model's own ranking. P@1 and P@3 stay the model's; a rare label it holds just below the top 5 can take the 5th
    tail_alpha: float = 0.0
    eval_ks: tuple[int, ...] = (1, 3, 5)   # cut-offs k of every metric@k (P, nDCG, PSP, PSnDCG, R, PSR)
    propensity_a: float = 0.0      # A, B of the propensity model for PSP/PSnDCG/PSR (0: the dataset's own)
    propensity_b: float = 0.0
    storage_dtype: str = "float32"  # saved weights: float32 | float16 | bfloat16 (computing stays float32)
    loggers: tuple[str, ...] = ()   # training loggers besides the JSON log, e.g. tensorboard,mlflow (`xmcbench plugins`)
    options: dict[str, Any] = field(default_factory=dict)  # free-form knobs for third-party components

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        config = apply_overrides(cls(), values, source="saved config")
        config.validate("saved config")
        return config

    def validate(self, source: str = "settings", tree_derived_later: bool = False) -> None:
        """Refuse a value outside its range in one line (SETTING_RANGES), before any data is read.
        tree_derived_later: the dataset's statistics have yet to derive tree_levels, so a level_top given for
        the derived levels is checked once they are known."""
        # first: a deep eval_ks raises top_k, whose range error would not name the setting given
        if not self.eval_ks or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOP_K
                                   for k in self.eval_ks):
            raise RefusedSetting(f"{source}: eval_ks={format_ks(self.eval_ks)} must be a list of integers between 1 "
                                 f"and {MAX_TOP_K}, e.g. eval_ks=1,3,5,10,100")
        for key, (low, high) in SETTING_RANGES.items():
            value = getattr(self, key)
            if isinstance(value, float) and not math.isfinite(value):
                raise RefusedSetting(f"{source}: {key}={value} is not a finite number")
            if (low is not None and value < low) or (high is not None and value > high):
                bounds = f"at least {low}" if high is None else f"between {low} and {high}"
                raise RefusedSetting(f"{source}: {key}={value} is out of range; it must be {bounds}")
        if self.validation_split not in VALIDATION_SPLITS:
            raise RefusedSetting(f"{source}: validation_split={self.validation_split!r} is not one of "
                                 f"{', '.join(VALIDATION_SPLITS)}")
        if self.score_combiner not in SCORE_COMBINERS:
            raise RefusedSetting(f"{source}: score_combiner={self.score_combiner!r} is not one of "
                                 f"{', '.join(SCORE_COMBINERS)}")
        if not 0.0 <= self.zero_shot_labels < 1.0:
            raise RefusedSetting(f"{source}: zero_shot_labels={self.zero_shot_labels:g} is out of range; it must be "
                                 "in [0, 1) (the share of the test set's labels held out of training, e.g. 0.05)")
        if not 0.0 <= self.dropout < 1.0:
            raise RefusedSetting(f"{source}: dropout={self.dropout:g} is out of range; it must be in [0, 1)")
        if self.top_k < max(self.eval_ks):
            raise RefusedSetting(f"{source}: top_k={self.top_k} keeps fewer labels than eval_ks asks for "
                                 f"(@{max(self.eval_ks)}); set top_k={max(self.eval_ks)} or more")
        levels = self.tree_levels
        if any(n & (n - 1) for n in levels) or any(a >= b for a, b in zip(levels, levels[1:])):
            raise RefusedSetting(f"{source}: tree_levels={format_ks(levels)} must be increasing powers of two, coarse "
                                 "to fine, e.g. tree_levels=1024,8192")
        if self.level_top and len(self.level_top) != len(levels) and not tree_derived_later:
            raise RefusedSetting(f"{source}: level_top={format_ks(self.level_top)} must give one count per tree level "
                                 f"({len(levels)}: tree_levels={format_ks(levels)}), or be empty")
        if self.num_clusters and self.num_clusters & (self.num_clusters - 1):
            raise RefusedSetting(f"{source}: num_clusters={self.num_clusters} must be a power of two (or 0 to use "
                                 "cluster_size)")


# A run keeps at least 5 labels per document (validation selects on metrics up to @5, weighted ensembles
# on P@1 and PSP@5) and at least max(eval_ks); more than MAX_TOP_K is a memory hazard (N x k scores) with
# no use in XMC evaluation.
METRIC_MAX_K = 5
MAX_TOP_K = 1000
def format_ks(ks) -> str:
    """eval_ks as --set takes it: "1,3,5"."""
    return ",".join(str(k) for k in ks) if isinstance(ks, (tuple, list)) else repr(ks)


def parse_ks(value: Any, key: str, source: str) -> tuple[int, ...]:
    """A list of cut-offs as written in a config file ([1, 3, 5]) or given to --set ("1,3,5") -> the sorted,
    distinct tuple (1, 3, 5); anything else ends in one XmcError line."""
    items = value.replace(" ", "").split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)):
        try:
            ks = [int(k) if isinstance(k, str) else k for k in items]
        except ValueError:
            ks = None
        if ks and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
            return tuple(sorted(set(ks)))
    raise RefusedSetting(f"{source}: {key} must be a list of positive integers, e.g. {key}=1,3,5,10,100; got {value!r}")


# list settings whose order and repeats mean something (one value per tree level), unlike eval_ks's cut-offs
ORDERED_COUNT_SETTINGS = ("tree_levels", "level_top")


def parse_counts(value: Any, key: str, source: str) -> tuple[int, ...]:
    """A list of positive integers in the order given ("1024,8192" or [1024, 8192]; "" for none)."""
    items = [item for item in value.replace(" ", "").split(",") if item] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)):
        try:
            counts = tuple(int(k) if isinstance(k, str) else k for k in items)
        except ValueError:
            counts = None
        if counts is not None and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in counts):
            return counts
    raise RefusedSetting(f"{source}: {key} must be a list of positive integers, e.g. {key}=1024,8192; got {value!r}")


def parse_names(value: Any, key: str, source: str) -> tuple[str, ...]:
    """A list of names as written in a config file (["tensorboard", "mlflow"]) or given to --set
    ("tensorboard,mlflow"; "" for none) -> ("tensorboard", "mlflow"), order kept, duplicates dropped."""
    items = [item.strip() for item in value.split(",")] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(item, str) for item in items):
        return tuple(dict.fromkeys(item for item in items if item))
    raise RefusedSetting(f"{source}: {key} must be a list of names, e.g. {key}=tensorboard,mlflow; got {value!r}")


def check_top_k(top_k: int) -> None:
    """The labels asked of `predict` per text: a whole number (not a bool, a float or a string), 1 to MAX_TOP_K."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise RefusedSetting(f"top_k must be a whole number between 1 and {MAX_TOP_K}, got {top_k!r} "
                             f"({type(top_k).__name__})")
    if not 1 <= top_k <= MAX_TOP_K:
        raise RefusedSetting(f"--top-k must be between 1 and {MAX_TOP_K}, got {top_k}")


# (lowest, highest) allowed value of each numeric setting; None: unbounded. dropout and num_clusters have
# their own checks in TrainConfig.validate.
SETTING_RANGES: dict[str, tuple[float | None, float | None]] = {
    "num_layers": (1, None), "max_length": (2, 8192),
    "cluster_size": (0, None), "num_clusters": (0, None), "flat_below": (0, None), "auto_cluster_size": (2, None),
    "top_clusters": (1, None), "hidden_size": (1, None),
    "epochs": (1, None), "refit_epochs": (0, None), "head_warmup_epochs": (0, None),
    "batch_size": (1, None), "eval_batch_size": (1, None),
    "lr": (1e-9, 10.0), "head_lr": (0.0, 10.0), "weight_decay": (0.0, 10.0),
    "swa_start_epoch": (0, None), "swa_every_steps": (1, None),
    "checkpoint_every_steps": (0, None), "checkpoint_every_epochs": (0, None),
    "validation_size": (0, None), "patience": (0, None), "max_train_docs": (0, None),
    "threads": (0, 4096), "seed": (0, 2**32 - 1), "top_k": (METRIC_MAX_K, MAX_TOP_K),
    "propensity_a": (0.0, 10.0), "propensity_b": (0.0, 1000.0), "ranker_weight": (0.0, 1.0), "tail_alpha": (0.0, 10.0),
}
VALIDATION_SPLITS = ("random", "grouped")
# How a label's final score follows from its own probability p (its ranker's, (B, C)) and q, its leaf cluster's
# (under a retriever: its own search score's), (B, C): f(p, q, ranker_weight) -> (B, C) (xmcbench.model).
SCORE_COMBINERS = {
    "product": lambda own, parent, weight: parent * own,   # LightXML, CascadeXML
    "weighted-sum": lambda own, parent, weight: weight * own + (1.0 - weight) * parent,   # NGAME-style fusion
}


TRAINABLE_PARTS = ("encoder", "ranker_encoder", "recaller", "ranker")
LOSS_PARTS = ("recall", "rank")


def copy_encoder_to_ranker_encoder(model, stage_name: str) -> None:
    """The ranker's own encoder starts from the shared encoder's weights (the paper's BS ablation)."""
    if model.ranker_encoder is None:
        raise RefusedSetting(f"stage {stage_name!r} copies the encoder into the ranker's own encoder, but the "
                             "model has none: set separate_ranker_encoder=true")
    model.ranker_encoder.load_state_dict(model.encoder.state_dict())


# What a stage may do to the model when it begins, by the name a Stage gives as `start`.
STAGE_STARTS = {"copy-encoder-to-ranker-encoder": copy_encoder_to_ranker_encoder}


@dataclass(frozen=True)
class Stage:
    """One phase of training: which parts learn, which losses count, for how many epochs.

    trains: parts whose parameters update (others are frozen; a frozen encoder also runs without
        dropout or gradients). losses: "recall" (cluster BCE) and/or "rank" (candidate BCE).
    epochs_key: the integer TrainConfig setting holding this stage's epochs (read by `epochs`).
    start: None, or the name of a STAGE_STARTS entry run on the model when the stage begins (`begin`),
        before the sampler's start_stage.
    """

    name: str
    trains: tuple[str, ...] = ("encoder", "ranker_encoder", "recaller", "ranker")
    losses: tuple[str, ...] = ("recall", "rank")
    epochs_key: str = "epochs"
    start: str | None = None

    def __post_init__(self) -> None:
        unknown = [p for p in self.trains if p not in TRAINABLE_PARTS] + \
                  [l for l in self.losses if l not in LOSS_PARTS]
        epochs_setting = TrainConfig.__dataclass_fields__.get(self.epochs_key)
        if unknown or not self.losses or (self.start is not None and self.start not in STAGE_STARTS) or \
                epochs_setting is None or epochs_setting.type not in (int, "int"):
            raise RefusedSetting(f"stage {self.name!r} is malformed: trains {self.trains}, losses {self.losses}, "
                                 f"epochs_key {self.epochs_key!r}, start {self.start!r}; parts are {TRAINABLE_PARTS}, "
                                 f"losses {LOSS_PARTS}, starts {tuple(STAGE_STARTS)}, epochs_key an integer setting")

    def epochs(self, config: TrainConfig) -> int:
        return getattr(config, self.epochs_key)

    def begin(self, model) -> None:
        if self.start is not None:
            STAGE_STARTS[self.start](model, self.name)


JOINT_TRAINING = (Stage("joint"),)
ENCODERS = ("encoder", "ranker_encoder")


def training_stages(method_stages: tuple[Stage, ...], config: "TrainConfig") -> tuple[Stage, ...]:
    """The stages a run trains: the method's, preceded by a head warm-up when config.head_warmup_epochs > 0.

    The warm-up trains the heads of the method's first stage (its parts other than encoders) with that
    stage's losses, on the frozen pretrained encoder, whose representations are then computed once: fresh
    heads start the joint training as a fitted linear probe instead of sending random gradients into the
    encoder (linear probing, then fine-tuning: Kumar et al., ICLR 2022)."""
    first = method_stages[0]
    heads = tuple(part for part in first.trains if part not in ENCODERS)
    if config.head_warmup_epochs <= 0 or not heads:
        return method_stages
    return (Stage("head-warmup", trains=heads, losses=first.losses, epochs_key="head_warmup_epochs"),
            *method_stages)


@dataclass(frozen=True)
class MethodSpec:
    """A named recipe: one component per kind plus default hyperparameters, per-dataset presets, and
    the training stages (one joint stage unless the method says otherwise; the pipeline runs them).

    whole_method: instead of components, a subclass of `xmcbench.interfaces.WholeMethod` that fits, saves,
    loads and predicts on its own (a linear XMC method); `defaults` and `presets` still resolve its
    settings, the component names and `stages` are then unused.

    options: `Option`s of the method itself (`--set options.NAME=VALUE`), checked before anything runs.

    needs_ranker: the method is about its ranker or sampler (a new ranker, a negative-sampling scheme), which
    run only with label clusters; a flat run (below flat_below labels, or cluster_size=1) would drop them, so
    it starts with a warning saying how to keep them (a method whose stages train the ranker on its own is
    refused instead). Every run records in config.json which components ran.

    derive: settings the method derives from a dataset it has no preset for, as the core does
    (xmcbench.defaults): derive(DatasetStatistics, DeviceFacts) -> {setting: xmcbench.defaults.Derived}. They
    take the place of the core's derived value of the same setting; the method's defaults and what the user
    sets still win over both. A derive that declares a keyword-only `settings` also gets the TrainConfig the run
    would have without it (the core's derived values under the method's defaults, the config file and --set), for
    a value that depends on them (LightXML's head_lr follows options.head_init and whether the run is flat)."""

    name: str
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    stages: tuple[Stage, ...] = JOINT_TRAINING
    whole_method: type | None = None
    needs_ranker: bool = False
    options: tuple[Option, ...] = ()   # the method's own options (its components declare theirs)
    # the method scores a label no training document carries, from its text (a dual encoder): with label texts,
    # its vocabulary holds every label of the dataset, test-only ones included, and zero-shot figures can be > 0
    scores_unseen_labels: bool = False
    derive: Callable[..., dict] | None = None   # derive(statistics, device) -> {setting: Derived}: see above


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def coerce_setting(key: str, value: Any, expected, source: str) -> Any:
    """`value` (as written in a config file or given to --set, e.g. the string "5") as type `expected` (bool,
    int, float or str; any other type passes it through); a value that is not one ends in one XmcError line
    naming `source` and `key`. Plugins parse their own options with it."""
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif expected is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(expected) is tuple:   # cut-offs (eval_ks), ordered counts (tree_levels) or names
        if typing.get_args(expected)[0] is not int:
            return parse_names(value, key, source)
        return parse_counts(value, key, source) if key in ORDERED_COUNT_SETTINGS else parse_ks(value, key, source)
    else:
        return value
    raise RefusedSetting(f"{source}: {key} must be {expected.__name__}, got {value!r}")


PATH_KIND = "path"   # Option(kind="path"): the path of a file the option names


def readable_file(value: Any, key: str, source: str) -> str:
    """`value` as the absolute path of an existing, readable file (so config.json names it from any folder);
    XmcError in one line naming `source` and `key` otherwise."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise RefusedSetting(f"{source}: {key} must be the path of a file, got {value!r}")
    path = Path(value).expanduser()
    if not path.exists():
        raise RefusedSetting(f"{source}: {key}={value}: no such file; give the path of an existing file")
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file"
        raise RefusedSetting(f"{source}: {key}={value} is {what}; give the path of a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise RefusedSetting(f"{source}: {key}={value} cannot be read ({error.strerror}); fix its permissions or give "
                             "another file") from None
    return str(path.resolve())


@dataclass(frozen=True)
class Option:
    """A setting a plugin declares for its component or method, set as `--set options.NAME=VALUE`.

    kind: bool, int, float, str, tuple[int, ...] (a list of positive integers, "2,4,8"), or "path" (a file:
    checked to exist and be readable, kept as its absolute path; a result key of `xmcbench compare` hashes
    the file's contents); default: its value when not set (the plugin reads it with
    `Option.value_of(config)`); minimum/maximum: the allowed range of a number; choices: the allowed values;
    required: the option has no usable default (give None), and a run that does not set it is refused while
    it is planned. Declared options are checked like core settings before anything runs: an unknown name
    gets "did you mean", a bad value one line; `xmcbench plugins --options` lists them."""

    name: str
    kind: Any
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    required: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.kind, str) and self.kind != PATH_KIND:
            raise ValueError(f"option {self.name!r} has kind {self.kind!r}; a kind is bool, int, float, str, "
                             f"tuple[int, ...] or {PATH_KIND!r}")

    def parse(self, value: Any, source: str) -> Any:
        """`value` as this option's kind, checked; XmcError in one line otherwise."""
        key = f"options.{self.name}"
        if self.kind == PATH_KIND:
            return readable_file(value, key, source)
        parsed = coerce_setting(key, value, self.kind, source)
        numbers = parsed if isinstance(parsed, tuple) else (parsed,)
        if self.kind in (int, float) or typing.get_origin(self.kind) is tuple:
            low, high = self.minimum, self.maximum
            if any((low is not None and n < low) or (high is not None and n > high) for n in numbers):
                bounds = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}" \
                    if low is not None else f"at most {high:g}"
                raise RefusedSetting(f"{source}: {key}={value!r} is out of range; it must be {bounds}")
        if self.choices is not None and parsed not in self.choices:
            raise RefusedSetting(f"{source}: {key}={value!r} is not one of {', '.join(map(str, self.choices))}")
        return parsed

    def value_of(self, config: "TrainConfig") -> Any:
        """This option's value in a run's config: what was set (checked), else the default (a required
        option that was not set: XmcError, which planning a run raises first)."""
        given = (config.options or {}).get(self.name)
        if given is None and self.required:
            raise RefusedSetting(self.missing())
        return self.default if given is None else self.parse(given, "options")

    def missing(self, owner: str = "") -> str:
        """The one line that refuses a run without this required option; owner: who declares it."""
        who = f"{owner} needs" if owner else "needs"
        return f"{who} options.{self.name} ({self.help}), which has no default: add --set options.{self.name}=VALUE"

    def describe(self) -> str:
        if self.kind == PATH_KIND:
            kind = "path of a file"
        else:
            kind = "list of int" if typing.get_origin(self.kind) is tuple else self.kind.__name__
        default = ",".join(map(str, self.default)) if isinstance(self.default, tuple) else self.default
        given = "required" if self.required else f"default {default}"
        allowed = f", at least {self.minimum:g}" if self.minimum is not None else ""
        allowed += f", at most {self.maximum:g}" if self.maximum is not None else ""
        allowed += f", one of {', '.join(map(str, self.choices))}" if self.choices else ""
        return f"options.{self.name} ({kind}, {given}{allowed}): {self.help}"


def check_options(options: dict[str, Any], declared: dict[str, tuple["Option", str]], source: str) -> dict[str, Any]:
    """config.options checked against the options declared for a run ({name: (Option, owner)}, owner: the
    component or method that declares it): each value parsed to its kind; an undeclared name ends in one line
    with the closest declared ones; a required option (Option.required) that is not given ends in one line
    naming `--set options.NAME=VALUE`, as does a path option left at a default that names no readable file.
    Returns the parsed options (defaults are not filled in)."""
    checked = {}
    for name, value in (options or {}).items():
        if name not in declared:
            close = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6)
            hint = f"did you mean options.{close[0]} ({declared[close[0]][1]})?" if close else \
                "declared: " + ", ".join(f"options.{key}" for key in sorted(declared))
            raise UnknownName(f"{source}: unknown setting options.{name}: {hint}")
        checked[name] = declared[name][0].parse(value, source)
    for name, (option, owner) in declared.items():
        if option.required and checked.get(name) is None:
            raise RefusedSetting(option.missing(owner))
        if option.kind == PATH_KIND and checked.get(name) is None and option.default is not None:
            readable_file(option.default, f"options.{name}", f"the default of {owner}")   # its contents are hashed
    return checked


def apply_overrides(config: TrainConfig, overrides: dict[str, Any], source: str) -> TrainConfig:
    """Return a copy of `config` with `overrides` applied; keys `options.NAME` set free-form options."""
    types = _field_types()
    values = config.to_dict()
    for key, value in overrides.items():
        if key.startswith("options."):
            values["options"] = {**values["options"], key.removeprefix("options."): value}
            continue
        if key not in types:
            raise UnknownName(f"{source}: unknown setting {key!r}: {closest_names_hint(key, types)}")
        if key == "options":
            if not isinstance(value, dict):
                raise RefusedSetting(f"{source}: options must be a table of key = value")
            values["options"] = {**values["options"], **value}
            continue
        values[key] = coerce_setting(key, value, types[key], source)
    return TrainConfig(**values)


def parse_set_options(pairs: list[str]) -> dict[str, Any]:
    """`["epochs=3", "lr=2e-5"]` -> {"epochs": "3", "lr": "2e-5"}; typed later by `apply_overrides`."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise RefusedSetting(f"--set expects key=value, got {pair!r} (e.g. --set epochs=3)")
        overrides[key.strip()] = value.strip()
    return overrides


def read_config_file(path: Path) -> dict[str, Any]:
    """A TOML or JSON file of flat `key = value` settings."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise RefusedSetting(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise RefusedSetting(f"config file {path} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    try:
        values = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise RefusedSetting(f"config file {path} is not valid {'JSON' if str(path).endswith('.json') else 'TOML'}: "
                             f"{error}") from None
    if not isinstance(values, dict):
        raise RefusedSetting(f"config file {path} must hold a table of key = value settings")
    return values


def resolve_config(method: MethodSpec, dataset_name: str, config_file: Path | None = None,
                   set_options: list[str] = (), derived: dict[str, Any] | None = None,
                   tree_derived_later: bool = False) -> TrainConfig:
    """derived: settings derived from the dataset (xmcbench.defaults), for datasets without a preset; they
    sit above TrainConfig's defaults and below everything else. tree_derived_later: see TrainConfig.validate."""
    config = apply_overrides(TrainConfig(), derived or {}, "settings derived from the dataset")
    config = apply_overrides(config, method.defaults, f"method {method.name!r}")
    config = apply_overrides(config, method.presets.get(dataset_name, {}),
                             f"method {method.name!r} preset for {dataset_name!r}")
    given = parse_set_options(list(set_options))
    if config_file is not None:
        from_file = read_config_file(config_file)
        config = apply_overrides(config, from_file, str(config_file))
        given = {**from_file, **given}
    config = apply_overrides(config, parse_set_options(list(set_options)), "--set")
    if "top_k" not in given:   # predictions must reach the deepest cut-off: eval_ks=1,3,5,100 keeps the top 100
        config.top_k = max(config.top_k, max(config.eval_ks, default=1))
    # a top_k the user gave below max(eval_ks) is refused, not raised behind their back
    config.validate(tree_derived_later=tree_derived_later)
    return config
