"""Dataset-aware defaults: statistics of a training set, the rule that turns them into settings, and where
the rule applies (datasets without a preset) and where it does not (presets, method defaults, --set)."""

import json

import numpy as np
import pytest
import scipy.sparse as sp
from typer.testing import CliRunner

from xmcbench import defaults
from xmcbench.config import TrainConfig
from xmcbench.cli import app
from xmcbench.defaults import DatasetStatistics, DeviceFacts, dataset_statistics, derive_settings
from xmcbench.registry import build_registry
from xmcbench.tokenization import load_tokenizer
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run


def statistics(**overrides) -> DatasetStatistics:
    values = {"documents": 5000, "labels": 800, "labels_per_document": 3.0, "median_documents_per_label": 4.0,
              "share_of_labels_with_at_most_2_documents": 0.4, "share_of_documents_with_the_top_label": 0.3,
              "token_length_p50": 90, "token_length_p90": 170, "token_length_p95": 220, "model_max_length": 512}
    return DatasetStatistics(**{**values, **overrides})


CPU, GPU = DeviceFacts("cpu"), DeviceFacts("cuda", 80.0)


def values(derived) -> dict:
    return {key: value.value for key, value in derived.items()}


def test_statistics_of_a_training_set():
    texts = ["one two three", "four five", "six", "seven eight nine ten"] * 25
    rows = np.repeat(np.arange(100), [3 if i % 4 == 0 else 1 for i in range(100)])
    columns = np.concatenate([[0, 1, 2] if i % 4 == 0 else [0 if i % 2 else 3] for i in range(100)])
    labels = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, columns)), shape=(100, 5))
    tokenizer = load_tokenizer("sentence-transformers/all-MiniLM-L6-v2")
    stats = dataset_statistics(texts, labels, tokenizer)
    assert stats.documents == 100 and stats.labels == 5
    assert stats.labels_per_document == pytest.approx(1.5)
    # label 0 on 50 + 25 documents, 1 and 2 on 25, 3 on 25, label 4 on none (not counted)
    assert stats.share_of_documents_with_the_top_label == pytest.approx(0.75)
    assert stats.median_documents_per_label == 25.0 and stats.share_of_labels_with_at_most_2_documents == 0.0
    # [CLS] + words + [SEP]: 3 to 6 tokens
    assert 3 <= stats.token_length_p50 <= stats.token_length_p90 <= stats.token_length_p95 <= 6
    assert stats.model_max_length == 512 and stats.tokenizer_cuts_on_the_right
    tokenizer.padding_side = "left"
    assert not dataset_statistics(texts, labels, tokenizer).tokenizer_cuts_on_the_right


def test_every_derived_setting_names_what_it_follows_from():
    for device in (CPU, GPU):
        for stats in (statistics(), statistics(documents=300, labels=50000)):
            derived = derive_settings(stats, device)
            assert {"validation_size", "max_length", "batch_size", "cluster_size", "head_lr", "epochs"} <= set(derived)
            for key, value in derived.items():
                assert value.source and value.why, key


def test_max_length_follows_the_length_distribution_and_the_device():
    short = values(derive_settings(statistics(token_length_p90=40), CPU))["max_length"]
    assert short == 64 and short % defaults.LENGTH_STEP == 0      # 40 rounded up: short texts do not pay for 128
    assert values(derive_settings(statistics(token_length_p90=900), CPU))["max_length"] == defaults.CPU_MAX_LENGTH
    assert values(derive_settings(statistics(token_length_p90=300), GPU))["max_length"] == 320
    assert values(derive_settings(statistics(token_length_p90=900), GPU))["max_length"] == defaults.GPU_MAX_LENGTH
    assert values(derive_settings(statistics(token_length_p90=900, model_max_length=256), GPU))["max_length"] == 256


def test_validation_split_only_when_there_are_enough_documents():
    assert values(derive_settings(statistics(documents=500), CPU))["validation_size"] == 0
    assert "patience" not in derive_settings(statistics(documents=500), CPU)
    small, large = (values(derive_settings(statistics(documents=n), CPU)) for n in (5000, 2_000_000))
    assert small["validation_size"] == 500 and small["patience"] == defaults.PATIENCE
    assert large["validation_size"] == defaults.VALIDATION_RANGE[1]


def test_label_clusters_beyond_the_flat_limit():
    flat = values(derive_settings(statistics(labels=defaults.FLAT_MAX_LABELS), CPU))
    assert flat["cluster_size"] == 1 and "top_clusters" not in flat
    clustered = values(derive_settings(statistics(labels=defaults.FLAT_MAX_LABELS + 1), CPU))
    assert clustered["cluster_size"] > 1 and clustered["top_clusters"] * clustered["cluster_size"] >= 256


@pytest.mark.parametrize("settings, derived_rate", [
    ({}, 1e-3),                                     # flat, head_init auto: PIFA rows
    ({"options.head_init": "pifa"}, 1e-3),
    ({"options.head_init": "random"}, defaults.HEAD_LR),
    ({"cluster_size": 16}, defaults.HEAD_LR),       # clusters: auto leaves the rows random
    ({"cluster_size": 1}, 1e-3),
])
def test_lightxml_rows_that_start_at_pifa_learn_at_a_tenth_of_the_rate_of_random_rows(settings, derived_rate):
    from xmcbench_lightxml.methods import PIFA_HEAD_LR, derive_flat_head
    from xmcbench.config import apply_overrides

    config = apply_overrides(TrainConfig(), {"options.head_init": "auto", **settings}, "test")
    lightxml = derive_flat_head(statistics(), CPU, settings=config)
    derived = {**derive_settings(statistics(), CPU), **lightxml}["head_lr"]
    assert derived.value == derived_rate and (derived_rate == PIFA_HEAD_LR) == ("head_lr" in lightxml)
    clustered = derive_flat_head(statistics(labels=defaults.FLAT_MAX_LABELS + 1), CPU, settings=config)
    assert "head_lr" not in clustered or settings.get("cluster_size") == 1


@pytest.mark.parametrize("settings, buckets", [
    ({}, 8192),
    ({"options.head_init": "random"}, 8192),        # the bag is the head's input, whatever its rows start at
    ({"cluster_size": 16}, None),                   # label clusters: not measured, so left at the [CLS] states
    ({"cluster_size": 1}, 8192),
])
def test_a_flat_lightxml_head_reads_a_bag_of_word_pieces(settings, buckets):
    from xmcbench_lightxml.methods import FLAT_LEXICAL_BUCKETS, FLAT_LEXICAL_NORM, derive_flat_head
    from xmcbench.config import apply_overrides

    assert FLAT_LEXICAL_BUCKETS == 8192 and FLAT_LEXICAL_NORM == 4
    config = apply_overrides(TrainConfig(), {"options.head_init": "auto", **settings}, "test")
    derived = derive_flat_head(statistics(), CPU, settings=config)
    assert (derived.get("options.lexical_buckets") and derived["options.lexical_buckets"].value) == buckets
    assert (derived.get("options.lexical_norm") and derived["options.lexical_norm"].value) == (buckets and 4)
    clustered = derive_flat_head(statistics(labels=defaults.FLAT_MAX_LABELS + 1), CPU, settings=config)
    assert "options.lexical_buckets" not in clustered or settings.get("cluster_size") == 1


def test_a_flat_lightxml_run_on_a_dataset_without_a_preset_ranks_its_later_places_with_tail_slots(registry,
                                                                                                    tiny_dataset):
    from xmcbench_lightxml.methods import FLAT_TAIL_ALPHA, derive_flat_head

    assert FLAT_TAIL_ALPHA == 1
    plan = plan_run(registry, "lightxml", str(tiny_dataset))
    assert plan.config.tail_alpha == 1 and "flat" in plan.derived["tail_alpha"].source
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=["tail_alpha=0"])
    assert plan.config.tail_alpha == 0 and "tail_alpha" not in plan.derived
    clustered = derive_flat_head(statistics(labels=defaults.FLAT_MAX_LABELS + 1), CPU, settings=TrainConfig())
    assert "tail_alpha" not in clustered, "measured on flat runs only"
    # a preset keeps the paper's ranking: the embedded default and the paper's datasets
    assert plan_run(registry, "lightxml", "debian-debtags-mini").config.tail_alpha == 0
    assert TrainConfig().tail_alpha == 0, "every other method ranks as it scores unless --set tail_alpha=A"
    assert plan_run(registry, "bonsai", str(tiny_dataset), set_options=["tail_alpha=0.5"]).config.tail_alpha == 0.5


@pytest.mark.parametrize("max_length, model_max_length, cuts_on_the_right, window", [
    (128, 512, True, 512),      # a CPU's window: the bag reads 4 times as much
    (128, 256, True, 256),      # no further than the encoder's tokenizer reads
    (512, 512, True, None),     # a GPU's window already reads 512: nothing longer to read
    (128, 512, False, None),    # a tokenizer that pads or truncates on the left cannot cut a longer window down
])
def test_the_bag_reads_up_to_512_word_pieces_where_the_transformer_reads_fewer(max_length, model_max_length,
                                                                              cuts_on_the_right, window):
    from xmcbench_lightxml.methods import derive_flat_head
    from xmcbench.config import apply_overrides

    config = apply_overrides(TrainConfig(), {"max_length": max_length}, "test")
    stats = statistics(model_max_length=model_max_length, tokenizer_cuts_on_the_right=cuts_on_the_right)
    derived = derive_flat_head(stats, CPU, settings=config).get("options.lexical_window")
    assert (derived and derived.value) == window


def test_a_bag_turned_off_gets_no_window_or_length():
    from xmcbench_lightxml.methods import derive_flat_head
    from xmcbench.config import apply_overrides

    off = derive_flat_head(statistics(), CPU, settings=apply_overrides(
        TrainConfig(), {"options.lexical_buckets": "0"}, "test"))
    assert "options.lexical_window" not in off and "options.lexical_norm" not in off
    larger = derive_flat_head(statistics(), CPU, settings=apply_overrides(
        TrainConfig(), {"options.lexical_buckets": "16384"}, "test"))
    assert larger["options.lexical_window"].value == 512 and larger["options.lexical_norm"].value == 4


def test_a_methods_derive_reads_the_settings_only_when_it_declares_them(registry, tiny_dataset):
    plan = plan_run(registry, "lightxml", str(tiny_dataset))
    assert plan.config.head_lr == 1e-3 and "PIFA" in plan.derived["head_lr"].source
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=["options.head_init=random"])
    assert plan.config.head_lr == defaults.HEAD_LR and "random" in plan.derived["head_lr"].source
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=["head_lr=0.02"])
    assert plan.config.head_lr == 0.02 and "head_lr" not in plan.derived
    # the bag of word pieces is derived like a core setting, and --set turns it off
    from xmcbench_lightxml.options import LEXICAL_BUCKETS
    assert LEXICAL_BUCKETS.value_of(plan.config) == 8192 and "flat" in plan.derived["options.lexical_buckets"].source
    assert {"options.lexical_window", "options.lexical_norm"} <= set(plan.derived)
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=["options.lexical_buckets=0"])
    assert LEXICAL_BUCKETS.value_of(plan.config) == 0 and "options.lexical_buckets" not in plan.derived
    assert not {"options.lexical_window", "options.lexical_norm"} & set(plan.derived)   # the encoder would refuse them
    # cascade's derive(statistics, device) declares no settings and still gets its tree
    assert "tree_levels" in plan_run(registry, "cascade", str(tiny_dataset)).derived


def test_fewer_documents_get_more_epochs_within_bounds():
    epochs = [values(derive_settings(statistics(documents=n), CPU))["epochs"] for n in (1500, 5000, 50000, 10**6)]
    assert epochs == sorted(epochs, reverse=True)
    assert defaults.EPOCH_RANGE[0] <= min(epochs) and max(epochs) <= defaults.EPOCH_RANGE[1]


def test_with_a_validation_split_rare_labels_raise_the_epoch_cap():
    """The cap grows with the share of labels seen at most twice, where validation can stop training earlier;
    without a validation split nothing would stop it, so the budget stays TARGET_STEPS."""
    common, rare = (values(derive_settings(statistics(share_of_labels_with_at_most_2_documents=share), CPU))
                    for share in (0.0, 0.75))
    assert common["epochs"] == 4 and rare["epochs"] == 9   # 282 steps an epoch: 1,000 and 2,500 steps
    assert rare["epochs"] <= defaults.EPOCH_RANGE[1] and rare["patience"] == defaults.PATIENCE
    unvalidated = [values(derive_settings(statistics(documents=900, share_of_labels_with_at_most_2_documents=share),
                                          CPU))["epochs"] for share in (0.0, 0.75)]
    assert unvalidated[0] == unvalidated[1] == 10   # 57 steps an epoch: 1,000 steps need 18, capped at 10


def test_a_gpu_gets_a_larger_batch_on_large_sets_only():
    assert values(derive_settings(statistics(documents=200_000), GPU))["batch_size"] > \
        values(derive_settings(statistics(documents=200_000), CPU))["batch_size"]
    assert values(derive_settings(statistics(documents=2000), GPU))["batch_size"] == 16


# -- where the rule applies -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def registry():
    return build_registry()


def test_a_plain_folder_gets_derived_settings_and_set_wins(registry, tiny_dataset):
    plan = plan_run(registry, "lightxml", str(tiny_dataset))
    assert plan.derived and plan.statistics.documents == 48
    for key, derived in plan.derived.items():   # a method's derive may set an option (options.NAME)
        value = plan.config.options[key.removeprefix("options.")] if key.startswith("options.") else getattr(plan.config, key)
        assert value == derived.value, key
    pinned = plan_run(registry, "lightxml", str(tiny_dataset), set_options=["max_length=48", "epochs=1"])
    assert pinned.config.max_length == 48 and pinned.config.epochs == 1
    assert "max_length" not in pinned.derived and "epochs" not in pinned.derived


def test_every_seed_gets_the_same_statistics_and_settings(registry, tiny_dataset, monkeypatch):
    # seeds of one comparison must differ in their randomness only: a length sample drawn by the seed gave
    # debian-builddeps max_length 320 on one seed and 352 on another, and the report then saw two variants
    monkeypatch.setattr(defaults, "LENGTH_SAMPLE", 8)   # a sample smaller than the 48 training texts
    plans = [plan_run(registry, "lightxml", str(tiny_dataset), seed=seed) for seed in range(5)]
    assert len({json.dumps(plan.statistics.to_dict()) for plan in plans}) == 1
    assert len({json.dumps({key: value.value for key, value in plan.derived.items()}) for plan in plans}) == 1


def test_a_whole_method_gets_the_same_settings_on_a_gpu_machine_and_a_cpu(registry, tiny_dataset, monkeypatch):
    # batch size and SWA interval follow the device; a linear tree reads neither, and up to rule version 3 its
    # runs on a GPU machine and on a CPU became two variants of it in the report
    from dataclasses import replace

    from tests.test_whole_methods import WordVotes
    from xmcbench.config import MethodSpec
    from xmcbench.runs import plan as planning

    registry.add_method(MethodSpec("votes", "word votes", whole_method=WordVotes))
    measured = planning.dataset_statistics
    monkeypatch.setattr(planning, "dataset_statistics", lambda *args: replace(measured(*args), documents=30000))
    configs = []
    for facts in (CPU, GPU):
        monkeypatch.setattr(planning, "device_facts", lambda config, facts=facts: facts)
        plan = plan_run(registry, "votes", str(tiny_dataset))
        assert set(plan.derived) == set(defaults.WHOLE_METHOD_DERIVED)
        configs.append(plan.config.to_dict())
    assert configs[0] == configs[1] and configs[0]["validation_size"] == 3000
    assert configs[0]["batch_size"] == TrainConfig().batch_size   # the default, untouched
    # a component method on the same statistics still gets the device's batch size
    monkeypatch.setattr(planning, "device_facts", lambda config: GPU)
    assert plan_run(registry, "lightxml", str(tiny_dataset)).config.batch_size == 32


def test_a_config_file_and_the_methods_own_defaults_win_over_the_rule(registry, tiny_dataset, tmp_path):
    config_file = tmp_path / "settings.toml"
    config_file.write_text("head_lr = 0.005\n")
    plan = plan_run(registry, "lightxml", str(tiny_dataset), config_file=config_file)
    assert plan.config.head_lr == 0.005 and "head_lr" not in plan.derived
    # lightxml's own defaults (e.g. lr, num_layers) are never derived
    assert not {"lr", "num_layers", "dropout"} & set(plan.derived)


def test_presets_are_left_as_they_are(registry):
    plan = plan_run(registry, "lightxml", "wiki500k")
    assert plan.derived == {} and plan.statistics is None and plan.loaded is None
    assert plan.config.num_clusters == 8192 and plan.config.lr == 1e-4


def test_config_command_prints_the_derived_settings_before_any_training(tiny_dataset, tmp_path):
    result = CliRunner().invoke(app, ["config", "lightxml", "--dataset", str(tiny_dataset)])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert printed["dataset_statistics"]["documents"] == 48 and printed["device_facts"]["kind"] in ("cpu", "cuda")
    assert printed["derived"]["max_length"]["value"] == printed["max_length"]
    assert "token length p90" in printed["derived"]["max_length"]["source"]
    assert not list(tmp_path.glob("runs"))   # nothing trained, nothing written


def test_a_bad_selection_metric_is_one_line_before_data_is_read(registry):
    from xmcbench.errors import XmcError

    with pytest.raises(XmcError, match="selection_metric='P@7' is not a validation metric; choose one of P@1"):
        plan_run(registry, "lightxml", "/nonexistent/folder", set_options=["selection_metric=P@7"])


@pytest.mark.slow
def test_a_run_records_what_was_derived_and_from_what(registry, tiny_model_dir, tiny_dataset, tmp_path):
    options = {"model_name": str(tiny_model_dir), "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
               "threads": 1}
    plan = plan_run(registry, "lightxml", str(tiny_dataset), set_options=[f"{k}={v}" for k, v in options.items()])
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["rule_version"] == defaults.RULE_VERSION
    assert recorded["dataset_statistics"] == plan.statistics.to_dict()
    assert set(recorded["derived"]) == set(plan.derived) and "epochs" not in recorded["derived"]
    for key, derived in recorded["derived"].items():
        value = (recorded["config"]["options"][key.removeprefix("options.")] if key.startswith("options.")
                 else recorded["config"][key])
        assert value == derived["value"] and derived["source"] and derived["why"]
    assert TrainConfig.from_dict(recorded["config"]) == plan.config   # what --resume and compare read back
