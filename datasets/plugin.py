"""Entry point of the datasets xmcbench ships (pyproject.toml: [project.entry-points.xmcbench]): the three
Debian datasets of this package, registered through the same hook as any plugin's."""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable

from xmcbench.data import DatasetSpec
from xmcbench.hookspecs import hookimpl

SOURCE = ("shipped inside xmcbench as the package xmcbench_datasets (reinstall xmcbench if it is missing); "
          "built from Debian 12 bookworm main archive metadata, see datasets/{name}/README.md")


def _embedded(name: str) -> Traversable | None:
    """The shipped folder of a dataset; None when the package is absent (then the data dir is searched)."""
    try:
        return importlib.resources.files("xmcbench_datasets") / name
    except ModuleNotFoundError:   # a bare source checkout without `pip install -e .`: listing must still work
        return None


def _debian(name: str, description: str, num_train: int, num_test: int, num_labels: int,
            is_default: bool = False) -> DatasetSpec:
    return DatasetSpec(name=name, description=description, dirname=name, embedded=_embedded(name),
                       num_train=num_train, num_test=num_test, num_labels=num_labels, propensity_a=0.55,
                       propensity_b=1.5, source=SOURCE.format(name=name), card=f"datasets/{name}/README.md",
                       is_default=is_default)


def shipped_datasets() -> list[DatasetSpec]:
    """The datasets of this package, smallest first; the statistics are those of each stats.json (num_labels
    counts test-only labels too, as the cards do)."""
    return [
        _debian("debian-debtags-mini",
                "Debian package descriptions -> debtags (a sixth of debian-debtags); small default for tests and demos",
                4_244, 1_206, 520, is_default=True),
        _debian("debian-debtags",
                "Debian package descriptions -> debtags facet::value tags; medium, Eurlex-4K-like label count",
                24_218, 6_082, 598),
        _debian("debian-builddeps",
                "Debian source package descriptions -> Build-Depends package names; extreme, power-law labels",
                27_365, 6_788, 20_813),
    ]


@hookimpl
def xmcbench_register_datasets(registry):
    for dataset in shipped_datasets():
        registry.add_dataset(dataset)
