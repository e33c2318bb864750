"""`xmcbench new-plugin NAME`: a plugin package to start from, which installs and passes its tests as written.

The package holds one component of each kind (a mean-pooling encoder, a linear recaller, a ranker reading each
label's text through the method's own encoder, a top-clusters sampler), a method that combines them, a test file that runs the conformance suite on each and
a tiny end-to-end run, a pyproject.toml whose entry point registers the plugin, and a README. Everything is
meant to be edited; the tests say when an edit breaks a rule.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from xmcbench.errors import XmcError

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

PYPROJECT = Template('''\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "xmcbench-$name"
version = "0.1.0"
description = "xmcbench plugin: $name"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["xmcbench"]

[project.optional-dependencies]
test = ["pytest>=7"]

# xmcbench finds the plugin through this entry-point group; nothing registers on import.
[project.entry-points.xmcbench]
$name = "$module.plugin"

[tool.setuptools]
packages = ["$module"]

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "-p no:cacheprovider"
''')

README = Template('''\
# xmcbench-$name

An xmcbench plugin: one component of each kind and a method, `$name`, that combines them.

```bash
pip install -e .                      # registers the plugin through its entry point
xmcbench plugins                      # lists $name and what it registers
xmcbench run $name --dataset debian-debtags-mini
xmcbench compare lightxml $name --seeds 0 1 2
python -m pytest -q                   # the conformance suite on each component, and a tiny run
```

| kind | name | class (`$module/components.py`) |
|---|---|---|
| encoder | `$name-mean-pooling` | `MeanPoolingEncoder`: the mean of the last layer's token states over the real tokens |
| recaller | `$name-linear` | `LinearRecaller`: one linear layer to cluster logits |
| ranker | `$name-label-text` | `LabelTextRanker`: the document against each label's text, both read by the method's own encoder (shared, one set of weights), dot product of their projections |
| sampler | `$name-top-clusters` | `TopClustersSampler`: the recaller's top clusters plus the positives' |

The method `$name` (`$module/plugin.py`) trains them with label clusters of 8 (`cluster_size`), so that the
ranker and the sampler run even on small datasets, and declares `needs_ranker=True`. Change a component, run
the tests: each rule the conformance suite checks has a name, and a failure names it. The ranker reads the
labels' texts from the `label_info` its factory declares (a dataset without label texts gives the label names)
and the method's encoder from `encoder`: the two keyword-only parameters of `build_label_text_ranker`. CONTRIBUTING.md of
xmcbench documents every hook, contract and helper.
''')

INIT = Template('''\
"""xmcbench plugin $name. Registration happens in plugin.py, through the entry point only."""
''')

PLUGIN = Template('''\
"""Entry point of the $name plugin (pyproject.toml: [project.entry-points.xmcbench])."""

from xmcbench.config import MethodSpec
from xmcbench.hookspecs import hookimpl

from $module.components import build_label_text_ranker, build_linear_recaller, build_mean_pooling, \
    build_top_clusters


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("encoder", "$name-mean-pooling", build_mean_pooling)
    registry.add_component("recaller", "$name-linear", build_linear_recaller)
    registry.add_component("ranker", "$name-label-text", build_label_text_ranker)
    registry.add_component("sampler", "$name-top-clusters", build_top_clusters)


@hookimpl
def xmcbench_register_methods(registry):
    registry.add_method(MethodSpec(
        name="$name",
        description="$name: mean-pooling encoder, linear recaller, label-text ranker, top-clusters sampler",
        defaults={"encoder": "$name-mean-pooling", "recaller": "$name-linear", "ranker": "$name-label-text",
                  "sampler": "$name-top-clusters", "model_name": "sentence-transformers/all-MiniLM-L6-v2",
                  "cluster_size": 8, "top_clusters": 10},
        needs_ranker=True,
    ))
''')

COMPONENTS = '''\
"""The components of this plugin, one of each kind. Shapes: B documents, T tokens, D representation size,
K clusters, C candidate labels per document, L labels."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xmcbench.candidates import candidates_with_positives
from xmcbench.interfaces import Candidates, Encoder, EpochContext, LabelClusters, LabelInfo, Ranker, Recaller, Sampler
from xmcbench.tokenization import load_pretrained, load_tokenizer, resolve_model_path, tokenize


class MeanPoolingEncoder(Encoder):
    """(B, T) ids + mask -> (B, D) the mean of the last layer's token states over the real (unmasked) tokens."""

    def __init__(self, model_name: str, pretrained_weights: bool) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        model_config = load_pretrained(AutoConfig.from_pretrained, model_name, "encoder config")
        self.tokenizer = load_tokenizer(model_name)
        if pretrained_weights:
            self.transformer = AutoModel.from_pretrained(resolve_model_path(model_name), config=model_config)
            self.loaded_dtype = str(next(self.transformer.parameters()).dtype).removeprefix("torch.")
            self.transformer.float()   # float32 master weights, whatever dtype the checkpoint holds
        else:
            self.transformer = AutoModel.from_config(model_config)
        self.out_dim = model_config.hidden_size

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
        mask = attention_mask.unsqueeze(-1).to(states.dtype)                                           # (B, T, 1)
        return (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)   # padding never counts

    def export(self, directory: Path) -> dict:
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)   # without it a rebuilt encoder would read other token ids
        return {"model_name": str(directory), "pretrained_weights": False}


class LinearRecaller(Recaller):
    """(B, D) -> (B, K) cluster logits."""

    def __init__(self, in_dim: int, num_clusters: int) -> None:
        super().__init__()
        self.num_clusters = num_clusters
        self.linear = nn.Linear(in_dim, num_clusters)

    def forward(self, representation: torch.Tensor) -> torch.Tensor:
        return self.linear(representation)


class LabelTextRanker(Ranker):
    """(B, D) representation, (B, C) candidate label ids -> (B, C) logits: the document's projection (B, h) against
    the projection of each candidate's text as the method's own encoder reads it (shared: one set of weights,
    trained by both towers, saved once). In training the candidates' texts are encoded at every step; for
    prediction every label's text is encoded once, when training ends (finalize), and kept with the model."""

    def __init__(self, encoder: Encoder, label_texts: list[str], hidden_size: int, max_length: int) -> None:
        super().__init__()
        self.encoder = encoder   # the method's encoder itself, not a copy
        # rebuilt from the texts on load; a step pads its candidates' texts to the longest of them only
        self.text_tokens = tokenize(label_texts, encoder.tokenizer, max_length, None, description=None)
        self.project = nn.Linear(encoder.out_dim, hidden_size)
        self.register_buffer("label_vectors", torch.zeros(len(label_texts), encoder.out_dim))   # saved

    def forward(self, representation: torch.Tensor, candidate_labels: torch.Tensor) -> torch.Tensor:
        text = self.project(representation)                                        # (B, h)
        if not self.training:
            return torch.einsum("bh,bch->bc", text, self.project(self.label_vectors[candidate_labels]))
        unique, inverse = torch.unique(candidate_labels, return_inverse=True)       # (U,), (B, C)
        ids, mask = (part.to(text.device) for part in self.text_tokens.batch(unique.cpu().numpy()))
        labels = self.project(self.encoder(ids, mask))                               # (U, h)
        return (text @ labels.T).gather(1, inverse)

    def finalize(self, context: EpochContext) -> None:
        self.label_vectors.copy_(context.label_embeddings())   # every label's text, encoded by the final encoder


class TopClustersSampler(Sampler):
    """The candidates of a training document: the labels of the recaller's top clusters (hard negatives that
    follow the recaller as it learns) and of its positives' clusters, every positive exactly once."""

    def __init__(self, top_clusters: int) -> None:
        super().__init__()
        self.top_clusters = top_clusters

    def forward(self, recall_logits: torch.Tensor, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        top = recall_logits.topk(min(self.top_clusters, recall_logits.shape[1]), dim=1).indices   # (B, b)
        return candidates_with_positives(top, positives, clusters)


# Factories: how the pipeline builds each component from the run's TrainConfig (CONTRIBUTING.md, the hooks).

def build_mean_pooling(config, **exported) -> MeanPoolingEncoder:
    return MeanPoolingEncoder(exported.get("model_name", config.model_name),
                              exported.get("pretrained_weights", config.pretrained_weights))


def build_linear_recaller(config, in_dim: int, num_clusters: int) -> LinearRecaller:
    return LinearRecaller(in_dim, num_clusters)


def build_label_text_ranker(config, in_dim: int, num_labels: int, *, label_info: LabelInfo,
                            encoder: Encoder) -> LabelTextRanker:
    # keyword-only parameters: the run's labels (names, texts, counts) and the method's encoder, shared
    return LabelTextRanker(encoder, list(label_info.texts or label_info.names), config.hidden_size, config.max_length)


def build_top_clusters(config) -> TopClustersSampler:
    return TopClustersSampler(config.top_clusters)
'''

TESTS = Template('''\
"""The conformance suite on each component, and a tiny end-to-end run of the method. Nothing is written into
this package's folder: models, data, runs and the cache go to pytest's temporary folders."""

import json

import pytest

from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.registry import build_registry
from xmcbench.testing import check_component, check_method, make_tiny_transformer, tiny_config, write_tiny_dataset

from $module.components import build_label_text_ranker, build_linear_recaller, build_mean_pooling, \
    build_top_clusters


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path / "cache"))   # never the user's cache


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_transformer(tmp_path_factory.mktemp("model"))   # random weights, no download


def test_the_plugin_registers_its_components_and_method():
    registry = build_registry()
    assert not registry.failures_of("$name"), registry.failures_of("$name")   # other plugins may be broken
    assert "$name" in registry.methods


@pytest.mark.parametrize("kind, factory", [("encoder", build_mean_pooling), ("recaller", build_linear_recaller),
                                           ("ranker", build_label_text_ranker), ("sampler", build_top_clusters)])
def test_component_passes_the_conformance_suite(kind, factory, tiny_model):
    check_component(kind, factory, tiny_config(tiny_model))


def test_a_tiny_run(tiny_model, tmp_path):
    dataset = write_tiny_dataset(tmp_path / "data")
    settings = [f"model_name={tiny_model}", "pretrained_weights=false", "epochs=1", "max_length=16", "threads=1",
                "cluster_size=2", "top_clusters=2", "hidden_size=8"]
    registry = build_registry()
    plan = plan_run(registry, "$name", str(dataset), set_options=settings)
    run_dir = launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100
    resolved = json.loads((run_dir / "config.json").read_text())["resolved"]
    assert resolved["components"]["ranker"] == "$name-label-text"   # clusters: the ranker ran


def test_the_method_composes(tiny_model):
    # shared encoder, save -> load -> predict, exact resume, on the tiny dataset with one text per label
    check_method(build_registry(), "$name", [f"model_name={tiny_model}", "pretrained_weights=false",
                                              "cluster_size=2", "top_clusters=2", "hidden_size=8"])
''')


def package_names(name: str) -> tuple[str, str]:
    """(distribution folder, Python module) of a plugin NAME: xmcbench-NAME, xmcbench_NAME (dashes as _)."""
    if not NAME_PATTERN.match(name):
        raise XmcError(f"plugin name {name!r} must be lowercase letters and digits, words joined by single dashes, "
                       "starting with a letter (e.g. cosine-ranker): it becomes the method's and the package's name")
    return f"xmcbench-{name}", "xmcbench_" + name.replace("-", "_")


def write_plugin(name: str, parent: Path) -> Path:
    """Write the package xmcbench-NAME into `parent` (created if missing); return its folder. Refuses a folder
    that already exists, so nothing is written over."""
    folder_name, module = package_names(name)
    folder = Path(parent) / folder_name
    if folder.exists():
        raise XmcError(f"{folder} already exists; choose another --output or remove it first")
    values = {"name": name, "module": module}
    files = {
        "pyproject.toml": PYPROJECT.substitute(values),
        "README.md": README.substitute(values),
        f"{module}/__init__.py": INIT.substitute(values),
        f"{module}/plugin.py": PLUGIN.substitute(values),
        f"{module}/components.py": COMPONENTS,
        f"tests/test_{module}.py": TESTS.substitute(values),
    }
    try:
        for relative, text in files.items():
            path = folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise XmcError(f"cannot write the plugin package into {folder}: {error.strerror or error}; choose another "
                       "--output") from None
    return folder
