"""Shared fixtures: an isolated cache, a tiny transformer built from a config, a tiny dataset folder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer BERT with hidden size 32 (random weights come from the config) and the real MiniLM
    tokenizer, saved as a local folder: no download (see xmcbench.testing.make_tiny_transformer)."""
    from xmcbench.testing import make_tiny_transformer

    return make_tiny_transformer(tmp_path_factory.mktemp("tiny-bert"))


TOPICS = {
    "lang:python": "python interpreter module script pip",
    "lang:c": "compiler library header gcc linker",
    "role:program": "program command tool binary executable",
    "role:doc": "documentation manual html reference guide",
    "net:web": "http server browser web proxy",
    "sound:audio": "audio sound mixer alsa music",
    "x11:gui": "window desktop widget toolkit graphical",
    "db:sql": "database sql query postgres table",
}


def write_tiny_dataset(folder: Path, train: int = 48, test: int = 16, seed: int = 0) -> Path:
    """Texts whose words reveal their labels, in the raw-text layout."""
    rng = random.Random(seed)
    names = sorted(TOPICS)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        texts, labels = [], []
        for _ in range(count):
            chosen = rng.sample(names, rng.randint(1, 3))
            words = " ".join(" ".join(rng.sample(TOPICS[name].split(), 3)) for name in chosen)
            texts.append(f"package - {words}")
            labels.append(" ".join(chosen))
        (folder / f"{split}_texts.txt").write_text("\n".join(texts) + "\n")
        (folder / f"{split}_labels.txt").write_text("\n".join(labels) + "\n")
    return folder


@pytest.fixture
def tiny_dataset(tmp_path) -> Path:
    return write_tiny_dataset(tmp_path / "tiny-topics")
