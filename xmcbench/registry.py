"""The plugin registry: discovers plugins through entry points and looks up what they registered.

Nothing is loaded at import time: call `build_registry()`.
"""

from __future__ import annotations

import difflib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from xmcbench import hookspecs
from xmcbench.errors import XmcError

COMPONENT_KINDS = ("encoder", "recaller", "ranker", "sampler")


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: its name, the distribution that ships it, and what it registered."""

    name: str
    package: str
    version: str
    registered: list[str] = field(default_factory=list, hash=False)


@dataclass(frozen=True)
class Entry:
    value: Any
    origin: str  # "plugin-name (package version)" for error messages


def closest_names_hint(name: str, choices) -> str:
    matches = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.4)
    if matches:
        return "did you mean " + ", ".join(repr(m) for m in matches) + "?"
    return "valid names: " + ", ".join(sorted(choices))


class Registry:
    """Typed tables of components, methods and datasets, filled by the plugins' hooks."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Entry]] = {kind: {} for kind in COMPONENT_KINDS}
        self.methods: dict[str, Entry] = {}
        self.datasets: dict[str, Entry] = {}
        self.plugins: list[PluginInfo] = []
        self.failed: list[tuple[str, str, str]] = []   # (plugin, package, one-line error) of plugins not loaded
        self._current: PluginInfo | None = None

    # -- registration (called from hooks) ---------------------------------------------------------
    def add_component(self, kind: str, name: str, factory: Callable[..., Any]) -> None:
        if kind not in COMPONENT_KINDS:
            raise XmcError(f"plugin {self._origin()} registers a component of unknown kind {kind!r}; "
                           f"kinds are {', '.join(COMPONENT_KINDS)}")
        if not callable(factory):
            raise XmcError(f"plugin {self._origin()} registers {kind} {name!r} with a factory that is not callable")
        self._add(self.components[kind], f"{kind} {name!r}", name, factory)

    def add_method(self, method) -> None:
        from xmcbench.config import MethodSpec

        if not isinstance(method, MethodSpec):
            raise XmcError(f"plugin {self._origin()} registers a method that is not a MethodSpec: {method!r}")
        self._add(self.methods, f"method {method.name!r}", method.name, method)

    def add_dataset(self, dataset) -> None:
        from xmcbench.data import DatasetSpec

        if not isinstance(dataset, DatasetSpec):
            raise XmcError(f"plugin {self._origin()} registers a dataset that is not a DatasetSpec: {dataset!r}")
        self._add(self.datasets, f"dataset {dataset.name!r}", dataset.name, dataset)

    def _origin(self) -> str:
        info = self._current
        return f"{info.name} ({info.package} {info.version})" if info else "<in-process>"

    def _add(self, table: dict[str, Entry], what: str, name: str, value: Any) -> None:
        if name in table:
            raise XmcError(f"{what} is registered twice: by {table[name].origin} and by {self._origin()}; "
                           "uninstall or rename one of them")
        table[name] = Entry(value, self._origin())
        if self._current is not None:
            self._current.registered.append(what)

    # -- look-up ----------------------------------------------------------------------------------
    def component(self, kind: str, name: str) -> Callable[..., Any]:
        table = self.components[kind]
        if name not in table:
            raise XmcError(f"unknown {kind} {name!r}: {closest_names_hint(name, table)}")
        return table[name].value

    def method(self, name: str):
        if name not in self.methods:
            failed = f"; plugins that failed to load: {', '.join(f[0] for f in self.failed)}" if self.failed else ""
            raise XmcError(f"unknown method {name!r}: {closest_names_hint(name, self.methods)} "
                           f"(`xmcbench plugins` lists them{failed})")
        return self.methods[name].value

    def dataset(self, name: str):
        if name not in self.datasets:
            raise XmcError(f"unknown dataset {name!r}: {closest_names_hint(name, self.datasets)} "
                           "(`xmcbench datasets` lists them; a folder path works too)")
        return self.datasets[name].value

    # -- filling ----------------------------------------------------------------------------------
    def register_plugin(self, plugin_manager: pluggy.PluginManager, plugin: Any, name: str,
                        package: str = "", version: str = "") -> None:
        """Register one plugin object (module or instance) and run its hooks into this registry."""
        plugin_manager.register(plugin, name=name)
        info = PluginInfo(name, package or "<in-process>", version)
        self.plugins.append(info)
        self._current = info
        try:
            hooks = plugin_manager.subset_hook_caller
            remove = [p for p in plugin_manager.get_plugins() if p is not plugin]
            hooks("xmcbench_register_components", remove)(registry=self)
            hooks("xmcbench_register_methods", remove)(registry=self)
            hooks("xmcbench_register_datasets", remove)(registry=self)
        finally:
            self._current = None


def new_plugin_manager() -> pluggy.PluginManager:
    plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    plugin_manager.add_hookspecs(hookspecs)
    return plugin_manager


def build_registry(extra_plugins: list[tuple[str, Any]] = (), load_entry_points: bool = True) -> Registry:
    """Load every plugin of the `xmcbench` entry-point group (and `extra_plugins`, as (name, module) pairs).

    Hooks are run one plugin at a time so each registration is attributed to its plugin, which lets
    a duplicate name be reported with both origins.
    """
    plugin_manager = new_plugin_manager()
    registry = Registry()
    if load_entry_points:
        for entry_point in sorted(importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME),
                                  key=lambda ep: ep.name):
            dist = entry_point.dist
            package = f"{dist.name} {dist.version}" if dist else "<unknown package>"
            try:
                module = entry_point.load()
            except Exception as error:  # a broken third-party plugin must not break unrelated commands
                registry.failed.append((entry_point.name, package, f"import failed: {type(error).__name__}: {error}"))
                continue
            try:
                registry.register_plugin(plugin_manager, module, entry_point.name,
                                         dist.name if dist else "", dist.version if dist else "")
            except XmcError as error:
                registry.failed.append((entry_point.name, package, str(error)))
    for name, plugin in extra_plugins:
        registry.register_plugin(plugin_manager, plugin, name)
    plugin_manager.check_pending()
    return registry
