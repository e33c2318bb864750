"""Label indexers (xmcbench.indexing): the registry kind, the built-in balanced 2-means tree, a plugin's random
indexer in a run, and the features a dataset brings reaching the indexer instead of TF-IDF of its texts."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from typer.testing import CliRunner

from xmcbench import clustering
from xmcbench.config import TrainConfig, apply_overrides
from xmcbench.errors import UnknownName, XmcError
from xmcbench.features import label_features, tfidf_features
from xmcbench.formats import open_dataset, write_dataset
from xmcbench.hookspecs import hookimpl
from xmcbench.indexing import NO_FEATURES, OWN_FEATURES, check_indexer, checked_assignment, label_clusters
from xmcbench.modelio import load_model_dir
from xmcbench.registry import RejectedName, build_registry, code_record
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.storage import fingerprint
from xmcbench.testing import write_tiny_dataset

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"


def random_clusters(label_features, num_clusters, seed, threads):
    return np.random.default_rng(seed).permutation(label_features.shape[0]) % num_clusters


def random_plugin() -> types.ModuleType:
    module = types.ModuleType("random_indexer")
    module.xmcbench_register_indexers = hookimpl(
        lambda registry: registry.add_indexer("random", random_clusters, "labels in random balanced clusters"))
    return module


class Spy:
    """An indexer that records the label features it was given and clusters them as the built-in one does."""

    def __init__(self) -> None:
        self.received: list[sp.csr_matrix] = []

    def __call__(self, label_features, num_clusters, seed, threads):
        self.received.append(label_features)
        return clustering.balanced_clusters(label_features, num_clusters, seed=seed, threads=threads)

    def plugin(self) -> types.ModuleType:
        module = types.ModuleType("spy_indexer")
        module.xmcbench_register_indexers = hookimpl(
            lambda registry: registry.add_indexer("spy", self, "records what it is given"))
        return module


@pytest.fixture(scope="module")
def registry():
    return build_registry(extra_plugins=[("random-indexer", random_plugin())])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: clusters another test computed must not stand in for an indexer's call."""
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "clusters"


def config(**settings) -> TrainConfig:
    return apply_overrides(TrainConfig(), {"cluster_size": 2, "threads": 1, **settings}, "test")


def all_rows(dataset) -> np.ndarray:
    return np.arange(dataset.train_labels.shape[0])


# -- the registry kind ---------------------------------------------------------------------------------------

def test_the_built_in_indexer_is_registered_and_listed(registry, monkeypatch):
    assert registry.indexer("balanced-2means").index is clustering.balanced_clusters
    assert registry.indexers["balanced-2means"].origin.startswith("lightxml ")
    assert not registry.failures_of("random-indexer") and registry.indexer("random").index is random_clusters
    assert TrainConfig().indexer == "balanced-2means"

    from xmcbench import cli as cli_module
    from xmcbench import registry as registry_module

    # the command imports build_registry when it runs
    monkeypatch.setattr(registry_module, "build_registry",
                        lambda: build_registry(extra_plugins=[("random-indexer", random_plugin())]))
    result = CliRunner().invoke(cli_module.app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^random-indexer\s+<in-process>\s+xmcbench_register_indexers\s+indexer 'random'$",
                     result.output, re.MULTILINE), result.output
    assert "indexer 'balanced-2means'" in result.output


def test_an_unknown_indexer_is_one_line_naming_the_registered_ones(registry):
    with pytest.raises(UnknownName) as error:
        check_indexer(registry, config(indexer="kmeans"))
    message = str(error.value)
    assert message.startswith("unknown indexer 'kmeans' in indexer: the registered ones are balanced-2means, random")
    assert "\n" not in message
    check_indexer(registry, config(indexer="random"))


def test_a_clashing_indexer_name_is_rejected_alone():
    @hookimpl
    def xmcbench_register_indexers(registry):
        registry.add_indexer("balanced-2means", random_clusters, "another tree")
        registry.add_indexer("mine", random_clusters, "mine")

    module = types.ModuleType("clasher")
    module.xmcbench_register_indexers = xmcbench_register_indexers
    registry = build_registry(extra_plugins=[("clasher", module)])
    (failure,) = registry.failures_of("clasher")
    assert isinstance(failure, RejectedName)
    assert "indexer 'balanced-2means' is registered twice: by lightxml" in failure.error
    assert registry.indexer("balanced-2means").index is clustering.balanced_clusters and "mine" in registry.indexers


@pytest.mark.parametrize("arguments, error", [
    (("my indexer", random_clusters, "d"), "registers an indexer named 'my indexer', which contains whitespace"),
    (("fine", "not callable", "d"), "registers indexer 'fine' with a factory that is not callable"),
    (("fine", random_clusters, ""), "registers indexer 'fine' without a description"),
])
def test_a_bad_indexer_registration_fails_the_plugin_in_one_line(arguments, error):
    plugin = types.SimpleNamespace(xmcbench_register_indexers=lambda registry: registry.add_indexer(*arguments))
    registry = build_registry(extra_plugins=[("bad", plugin)], load_entry_points=False)
    (failure,) = registry.failures_of("bad")
    assert error in failure.error and "\n" not in failure.error
    assert registry.indexers == {}


def test_the_contributing_example_indexer_obeys_the_contract():
    text = CONTRIBUTING.read_text(encoding="utf-8")
    section = text[text.index("#### `xmcbench_register_indexers"):]
    start = section.index("```python\n") + len("```python\n")
    module = types.ModuleType("xmcbench_randomindex_plugin")
    exec(compile(section[start:section.index("```\n", start)], "CONTRIBUTING.md", "exec"), module.__dict__)
    registry = build_registry(extra_plugins=[("randomindex", module)], load_entry_points=False)
    assert not registry.failures_of("randomindex")
    assignment = registry.indexer("random").index(sp.csr_matrix((13, 5), dtype=np.float32), 4, seed=3, threads=0)
    assert np.bincount(checked_assignment("random", assignment, 13, 4)).tolist() == [4, 3, 3, 3]


@pytest.mark.parametrize("assignment, error", [
    (np.zeros(7, dtype=np.int64), "an array of shape \\(7,\\) and dtype int64 for 8 labels"),
    (np.arange(8) * 0.5, "an array of shape \\(8,\\) and dtype float64"),
    (np.arange(8) % 4 + 1, "cluster ids from 1 to 4; they must lie in \\[0, 4\\)"),
    (np.array([0, 0, 0, 1, 2, 2, 3, 3]), "clusters of 1 to 3 labels; each of the 4 clusters of 8 labels must hold 2$"),
    (np.array([0, 0, 0, 1, 2, 2, 3, 3, 3]), "clusters of 1 to 3 labels; each of the 4 clusters of 9 labels must hold "
                                             "2 or 3$"),
])
def test_an_assignment_that_breaks_the_contract_is_refused_naming_the_indexer(assignment, error):
    with pytest.raises(ValueError, match=f"^indexer 'odd' returned {error}"):
        checked_assignment("odd", assignment, max(8, len(assignment)), 4)


# -- label_clusters --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny")


def test_the_default_indexer_keeps_the_clusters_and_the_key_it_had_before_indexers(registry, tiny_dir, cache):
    dataset = open_dataset(registry, str(tiny_dir))
    rows = all_rows(dataset)
    clusters = label_clusters(dataset, config(seed=3), rows, registry)
    # what label_clusters computed before the indexers, under the key it wrote
    labels = dataset.train_labels[rows][:, :dataset.num_labels]
    before = clustering.balanced_clusters(label_features(tfidf_features(dataset.train_texts), labels), 4, seed=3)
    assert clusters.label_cluster.numpy().tolist() == before.tolist()
    key = fingerprint(dataset.version, "all", 4, 3, "None", clustering.ALGORITHM_VERSION)
    assert NO_FEATURES == "None" and [path.name for path in cache.iterdir()] == [f"{key}.npy"]


def test_another_indexer_clusters_under_a_key_naming_it(registry, tiny_dir, cache):
    dataset = open_dataset(registry, str(tiny_dir))
    rows = all_rows(dataset)
    default = label_clusters(dataset, config(), rows, registry)
    chosen = label_clusters(dataset, config(indexer="random"), rows, registry)
    expected = random_clusters(sp.csr_matrix((dataset.num_labels, 1)), 4, seed=0, threads=1)
    assert chosen.label_cluster.numpy().tolist() == expected.tolist() != default.label_cluster.numpy().tolist()
    key = fingerprint(dataset.version, "all", 4, 0, NO_FEATURES, "indexer random",
                      code_record(registry.indexers["random"]))
    assert (cache / f"{key}.npy").is_file() and len(list(cache.iterdir())) == 2
    assert label_clusters(dataset, config(indexer="random"), rows, registry).label_cluster.tolist() == expected.tolist()


def assert_indexer_reads_documents_as_features(dataset):
    """Cluster `dataset` (whose document i has feature i alone) with a spy indexer: label l's features must be
    its documents, normalised. Returns the spy's registry."""
    spy = Spy()
    spied = build_registry(extra_plugins=[("spy", spy.plugin())])
    label_clusters(dataset, config(indexer="spy"), all_rows(dataset), spied)
    (received,) = spy.received
    documents = dataset.train_labels[:, :dataset.num_labels].T.toarray()
    np.testing.assert_allclose(received.toarray(), documents / np.linalg.norm(documents, axis=1, keepdims=True),
                               rtol=1e-6)
    return spied


def test_the_features_of_a_pecos_folder_reach_the_indexer_rather_than_tfidf(registry, tiny_dir, tmp_path, cache):
    folder = write_dataset(registry, open_dataset(registry, str(tiny_dir)), tmp_path / "pecos", "pecos")
    # document i has feature i alone (of value i + 1, as stored): once the documents' rows are unit, label l's
    # features are its documents, normalised
    sp.save_npz(folder / "X.trn.npz", sp.diags(np.arange(1, 49, dtype=np.float32)).tocsr())
    sp.save_npz(folder / "X.tst.npz", sp.csr_matrix((16, 48), dtype=np.float32))
    dataset = open_dataset(registry, str(folder))
    assert dataset.train_texts and dataset.has_train_features
    spied = assert_indexer_reads_documents_as_features(dataset)
    key = fingerprint(dataset.version, "all", 4, 0, OWN_FEATURES, "indexer spy", code_record(spied.indexers["spy"]))
    assert [path.name for path in cache.iterdir()] == [f"{key}.npy"]


def test_the_raw_text_features_file_reaches_the_indexer(registry, tiny_dir, tmp_path, cache):
    folder = Path(shutil.copytree(tiny_dir, tmp_path / "with-features"))
    (folder / "train_v1.txt").write_text("".join(f"0 {i}:2\n" for i in range(48)))   # LightXML's svmlight file
    dataset = open_dataset(registry, str(folder))
    assert_indexer_reads_documents_as_features(dataset)


def test_only_clustering_reads_the_features_file(registry, tiny_dir, tmp_path, cache):
    folder = Path(shutil.copytree(tiny_dir, tmp_path / "broken-features"))
    (folder / "train_v1.txt").write_text("0 0:1\n1 oops\n")
    dataset = open_dataset(registry, str(folder))
    assert label_clusters(dataset, config(cluster_size=1), all_rows(dataset), registry).is_flat
    with pytest.raises(XmcError, match="train_v1.txt:2: malformed feature 'oops'"):
        label_clusters(dataset, config(), all_rows(dataset), registry)


# -- a run -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_clusters_with_the_indexer_its_settings_name(registry, tiny_model_dir, tiny_dir, tmp_path, cache):
    settings = {"model_name": tiny_model_dir, "pretrained_weights": "false", "num_layers": 2, "epochs": 1,
                "batch_size": 8, "max_length": 16, "hidden_size": 8, "threads": 1, "cluster_size": 2,
                "top_clusters": 2, "indexer": "random"}
    plan = plan_run(registry, "lightxml", str(tiny_dir), set_options=[f"{k}={v}" for k, v in settings.items()])
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["config"]["indexer"] == "random"
    assert recorded["provenance"]["indexer"] == {"name": "random", **code_record(registry.indexers["random"])}
    model, _, _ = load_model_dir(run_dir, registry)
    expected = random_clusters(sp.csr_matrix((8, 1)), 4, seed=plan.config.seed, threads=1)
    assert model.label_cluster.tolist() == expected.tolist()


def test_a_run_naming_an_unknown_indexer_is_refused_before_reading_data(registry, tmp_path):
    with pytest.raises(UnknownName, match="^unknown indexer 'kmeans' in indexer: the registered ones are "):
        plan_run(registry, "lightxml", str(tmp_path / "no-such-folder"), set_options=["indexer=kmeans"])
