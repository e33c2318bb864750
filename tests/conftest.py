"""Shared fixtures: an isolated cache, a tiny transformer built from a config, a tiny dataset folder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from xmcbench.testing import write_tiny_dataset  # noqa: F401  (tests import it from here too)


@pytest.fixture(autouse=True, scope="session")
def isolated_cache(tmp_path_factory):
    """Session-wide, so that module-scoped fixtures that run xmcbench never read or fill the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XMCBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer BERT with hidden size 32 (random weights come from the config) and the real MiniLM
    tokenizer, saved as a local folder: no download (see xmcbench.testing.make_tiny_transformer)."""
    from xmcbench.testing import make_tiny_transformer

    return make_tiny_transformer(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture
def tiny_dataset(tmp_path) -> Path:
    return write_tiny_dataset(tmp_path / "tiny-topics")
