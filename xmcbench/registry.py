"""The plugin registry: discovers plugins through entry points and looks up what they registered.

Nothing is loaded at import time: call `build_registry()`.

Loading fails safe. A plugin that cannot be imported, implements a hook that `xmcbench/hookspecs.py` does not
declare, or whose hook raises (a duplicate name, a registration of the wrong type, any exception) is not
loaded: whatever it had registered is removed again, and `Registry.failed` records it with its package and
a one-line error, which `xmcbench plugins` prints. Commands that do not need it keep working.

Environment:
    XMCBENCH_DISABLE_PLUGIN_AUTOLOAD=1   load no entry point except those named in XMCBENCH_PLUGINS (the
                                         built-in `lightxml` plugin is an entry point too).
    XMCBENCH_PLUGINS=name1,name2         entry-point names to load explicitly; a name no installed package
                                         provides is reported as a failed plugin.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import pluggy

from xmcbench import hookspecs
from xmcbench.errors import XmcError

COMPONENT_KINDS = ("encoder", "recaller", "ranker", "sampler")
DISABLE_AUTOLOAD_ENV = "XMCBENCH_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "XMCBENCH_PLUGINS"
BUILTIN_DISTRIBUTION = "xmcbench"
# Every hook of hookspecs.py, in the order they are defined there and run for each plugin (components
# first, so a plugin's methods may name its components).
HOOK_NAMES = tuple(name for name, value in vars(hookspecs).items()
                   if callable(value) and hasattr(value, hookspecs.PROJECT_NAME + "_spec"))


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: its name, the distribution that ships it, the hooks it implements and what it
    registered."""

    name: str
    package: str
    version: str
    registered: list[str] = field(default_factory=list, hash=False)
    hooks: list[str] = field(default_factory=list, hash=False)


class FailedPlugin(NamedTuple):
    """A plugin that was not loaded: its name, its package ("name version"), and a one-line error."""

    name: str
    package: str
    error: str


@dataclass(frozen=True)
class Entry:
    value: Any
    origin: str  # "plugin-name (package version)" for error messages


class RegistrationError(XmcError):
    """A plugin registered something the registry rejects (wrong type, unknown kind, duplicate name)."""


class PluginLoadError(XmcError):
    """A plugin could not be loaded; the message is one line naming what is wrong."""


def closest_names_hint(name: str, choices) -> str:
    if not choices:
        return "none is registered"
    matches = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.4)
    if matches:
        return "did you mean " + ", ".join(repr(m) for m in matches) + "?"
    return "valid names: " + ", ".join(sorted(choices))


def one_line(error: BaseException) -> str:
    """`TypeName: first line of the message` (the type alone when the message is empty)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _short_repr(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def autoload_disabled() -> bool:
    """XMCBENCH_DISABLE_PLUGIN_AUTOLOAD set to anything but empty, 0, false, no or off."""
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def requested_plugins() -> list[str]:
    """The entry-point names in XMCBENCH_PLUGINS (comma-separated), in order, without repeats."""
    names = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",")]
    return list(dict.fromkeys(name for name in names if name))


class Registry:
    """Typed tables of components, methods, datasets and data formats, filled by the plugins' hooks."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Entry]] = {kind: {} for kind in COMPONENT_KINDS}
        self.methods: dict[str, Entry] = {}
        self.datasets: dict[str, Entry] = {}
        self.formats: dict[str, Entry] = {}   # data formats (xmcbench.formats.DataFormat) by name
        self.plugins: list[PluginInfo] = []
        self.failed: list[FailedPlugin] = []   # plugins not loaded, each with a one-line error
        self.skipped: list[tuple[str, str]] = []   # (entry point, package) not loaded: autoloading is off
        self.requested: list[str] = []   # the entry points named in XMCBENCH_PLUGINS
        self._current: PluginInfo | None = None
        self._added: list[tuple[dict[str, Entry], str]] = []   # what the current plugin added, to roll back

    # -- registration (called from hooks) ---------------------------------------------------------
    def add_component(self, kind: str, name: str, factory: Callable[..., Any]) -> None:
        if kind not in COMPONENT_KINDS:
            raise RegistrationError(f"plugin {self._origin()} registers a component of unknown kind {kind!r}; "
                                    f"kinds are {', '.join(COMPONENT_KINDS)}")
        if not isinstance(name, str) or not name:
            raise RegistrationError(f"plugin {self._origin()} registers a {kind} whose name is not a non-empty "
                                    f"string: {_short_repr(name)}")
        if not callable(factory):
            raise RegistrationError(f"plugin {self._origin()} registers {kind} {name!r} with a factory that is "
                                    f"not callable: {_short_repr(factory)}")
        self._add(self.components[kind], f"{kind} {name!r}", name, factory)

    def add_method(self, method) -> None:
        from xmcbench.config import MethodSpec

        if not isinstance(method, MethodSpec):
            raise RegistrationError(f"plugin {self._origin()} registers a method that is not a MethodSpec: "
                                    f"{_short_repr(method)}")
        if method.whole_method is not None:
            from xmcbench.interfaces import WholeMethod

            if not (isinstance(method.whole_method, type) and issubclass(method.whole_method, WholeMethod)):
                raise RegistrationError(f"plugin {self._origin()} registers method {method.name!r} whose whole_method "
                                        f"is not a subclass of xmcbench.interfaces.WholeMethod: "
                                        f"{_short_repr(method.whole_method)}")
        self._add(self.methods, f"method {method.name!r}", method.name, method)

    def add_dataset(self, dataset) -> None:
        from xmcbench.data import DatasetSpec

        if not isinstance(dataset, DatasetSpec):
            raise RegistrationError(f"plugin {self._origin()} registers a dataset that is not a DatasetSpec: "
                                    f"{_short_repr(dataset)}")
        self._add(self.datasets, f"dataset {dataset.name!r}", dataset.name, dataset)

    def add_format(self, data_format) -> None:
        from xmcbench.formats import DataFormat

        if not isinstance(data_format, DataFormat):
            raise RegistrationError(f"plugin {self._origin()} registers a data format that is not a DataFormat: "
                                    f"{_short_repr(data_format)}")
        self._add(self.formats, f"format {data_format.name!r}", data_format.name, data_format)

    def _origin(self) -> str:
        info = self._current
        if info is None:
            return "<in-process>"
        return f"{info.name} ({' '.join(part for part in (info.package, info.version) if part)})"

    def _add(self, table: dict[str, Entry], what: str, name: str, value: Any) -> None:
        if name in table:
            raise RegistrationError(f"{what} is registered twice: by {table[name].origin} and by "
                                    f"{self._origin()}; uninstall or rename one of them")
        table[name] = Entry(value, self._origin())
        if self._current is not None:
            self._current.registered.append(what)
            self._added.append((table, name))

    # -- look-up ----------------------------------------------------------------------------------
    def _missing_hint(self) -> str:
        """Why a name may be missing: plugins that failed to load, or were not loaded (autoloading off)."""
        notes = []
        if self.failed:
            notes.append("plugins that failed to load: " + ", ".join(f.name for f in self.failed))
        if self.skipped:
            notes.append(f"plugin autoloading is off ({DISABLE_AUTOLOAD_ENV}), so these were not loaded: "
                         + ", ".join(name for name, _ in self.skipped)
                         + f"; name them in {PLUGINS_ENV}, e.g. {self.plugins_env_example()}")
        return "".join(f"; {note}" for note in notes)

    def plugins_env_example(self) -> str:
        """`XMCBENCH_PLUGINS=...` that would also load the first plugin skipped because autoloading is off."""
        names = self.requested + [name for name, _ in self.skipped[:1]]
        return f"{PLUGINS_ENV}={','.join(names)}"

    def component(self, kind: str, name: str) -> Callable[..., Any]:
        if kind not in self.components:
            raise XmcError(f"unknown component kind {kind!r}; kinds are {', '.join(COMPONENT_KINDS)}")
        table = self.components[kind]
        if name not in table:
            raise XmcError(f"unknown {kind} {name!r}: {closest_names_hint(name, table)} "
                           f"(`xmcbench plugins` lists them{self._missing_hint()})")
        return table[name].value

    def method(self, name: str):
        if name not in self.methods:
            raise XmcError(f"unknown method {name!r}: {closest_names_hint(name, self.methods)} "
                           f"(`xmcbench plugins` lists them{self._missing_hint()})")
        return self.methods[name].value

    def dataset(self, name: str):
        if name not in self.datasets:
            raise XmcError(f"unknown dataset {name!r}: {closest_names_hint(name, self.datasets)} "
                           f"(`xmcbench datasets` lists them; a folder path works too{self._missing_hint()})")
        return self.datasets[name].value

    def format(self, name: str):
        if name not in self.formats:
            raise XmcError(f"unknown data format {name!r}: {closest_names_hint(name, self.formats)} "
                           f"(`xmcbench formats` lists them{self._missing_hint()})")
        return self.formats[name].value

    # -- filling ----------------------------------------------------------------------------------
    def register_plugin(self, plugin_manager: pluggy.PluginManager, plugin: Any, name: str,
                        package: str = "", version: str = "") -> None:
        """Register one plugin object (module or instance) and run its hooks into this registry.

        On any failure nothing of the plugin stays: its registrations are removed, it is unregistered from
        `plugin_manager`, and an XmcError with a one-line message is raised (RegistrationError for what the
        registry rejects, PluginLoadError otherwise)."""
        info = PluginInfo(name, package or "<in-process>", version)
        hooks = validate_plugin(plugin_manager, plugin, name)
        try:
            plugin_manager.register(plugin, name=name)
        except pluggy.PluginValidationError as error:
            raise PluginLoadError(f"plugin {name!r} does not match xmcbench/hookspecs.py: "
                                  f"{' '.join(str(error).split())}") from error
        except ValueError as error:   # pluggy: the name or the very object is registered already
            if plugin_manager.is_registered(plugin):
                raise PluginLoadError(f"plugin {name!r} is the same module as the already loaded plugin "
                                      f"{plugin_manager.get_name(plugin)!r}; list it once") from error
            loaded = next((p for p in self.plugins if p.name == name), None)
            where = f" from {' '.join(x for x in (loaded.package, loaded.version) if x)}" if loaded else ""
            raise PluginLoadError(f"another plugin named {name!r}{where} is already loaded; rename one of the "
                                  "entry points") from error
        info.hooks.extend(hooks)
        self.plugins.append(info)
        self._current, self._added = info, []
        try:
            others = [p for p in plugin_manager.get_plugins() if p is not plugin]
            for hook in HOOK_NAMES:
                try:
                    plugin_manager.subset_hook_caller(hook, others)(registry=self)
                except RegistrationError:
                    raise
                except Exception as error:
                    raise PluginLoadError(f"plugin {self._origin()}: hook {hook} raised {one_line(error)}") \
                        from error
        except BaseException:
            for table, added in self._added:
                table.pop(added, None)
            self.plugins.remove(info)
            plugin_manager.unregister(plugin)
            raise
        finally:
            self._current, self._added = None, []


def _hook_argnames(function: Callable) -> list[str] | None:
    """The argument names pluggy passes by name (those without a default); None if not inspectable."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in parameters
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def validate_plugin(plugin_manager: pluggy.PluginManager, plugin: Any, name: str) -> list[str]:
    """The hooks `plugin` implements, checked against the hookspecs (pluggy's check_pending, per plugin
    and before anything runs). Raises PluginLoadError naming an unknown (misspelled) hook, a hook function
    without @hookimpl, a hook whose arguments the hookspec does not pass, or a plugin with no hook at all."""
    specs = {hook: _hook_argnames(getattr(hookspecs, hook)) or [] for hook in HOOK_NAMES}
    implemented = []
    for attribute in dir(plugin):
        if attribute.startswith("_"):
            continue
        try:
            options = plugin_manager.parse_hookimpl_opts(plugin, attribute)
        except Exception:   # an attribute that raises on access is not a hook
            continue
        if options is None:
            if attribute in specs and callable(getattr(plugin, attribute, None)):
                raise PluginLoadError(f"plugin {name!r} defines {attribute} without @hookimpl (from "
                                      "xmcbench.hookspecs import hookimpl), so it would never be called")
            continue
        hook = options.get("specname") or attribute
        if hook not in specs:
            if options.get("optionalhook"):
                continue
            raise PluginLoadError(f"plugin {name!r} implements unknown hook {hook!r}: "
                                  f"{closest_names_hint(hook, specs)} (hooks: xmcbench/hookspecs.py)")
        argnames = _hook_argnames(getattr(plugin, attribute))
        extra = [arg for arg in argnames or [] if arg not in specs[hook]]
        if extra:
            raise PluginLoadError(f"plugin {name!r}: hook {hook} takes argument(s) {', '.join(extra)}, which the "
                                  f"hookspec does not pass (it passes: {', '.join(specs[hook])})")
        implemented.append(hook)
    if not implemented:
        raise PluginLoadError(f"plugin {name!r} implements no xmcbench hook (is its entry point the module with "
                              f"the @hookimpl functions? hooks: {', '.join(HOOK_NAMES)})")
    return sorted(implemented, key=HOOK_NAMES.index)


def new_plugin_manager() -> pluggy.PluginManager:
    plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    plugin_manager.add_hookspecs(hookspecs)
    return plugin_manager


def _package_of(entry_point) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    return (dist.name, dist.version) if dist is not None else ("<unknown package>", "")


def _load_order(entry_points) -> list:
    """xmcbench's own plugins first (so a third party's clash is blamed on the third party), then by name."""
    return sorted(entry_points, key=lambda ep: (_package_of(ep)[0] != BUILTIN_DISTRIBUTION, ep.name))


def build_registry(extra_plugins: list[tuple[str, Any]] = (), load_entry_points: bool = True) -> Registry:
    """Load the plugins of the `xmcbench` entry-point group (and `extra_plugins`, as (name, module) pairs,
    with the same fail-safe handling) into a new Registry.

    Hooks are run one plugin at a time so each registration is attributed to its plugin, which lets a
    duplicate name be reported with both origins. A plugin that fails is recorded in `registry.failed`
    and leaves nothing behind. See the module docstring for XMCBENCH_DISABLE_PLUGIN_AUTOLOAD and
    XMCBENCH_PLUGINS.
    """
    plugin_manager = new_plugin_manager()
    registry = Registry()

    def load(name: str, package: str, version: str, get_plugin: Callable[[], Any]) -> None:
        label = " ".join(part for part in (package, version) if part)
        # a plugin's prints go to stderr, never into a command's output (predict writes JSON to stdout)
        with contextlib.redirect_stdout(sys.stderr):
            try:
                plugin = get_plugin()
            # a broken third-party plugin must not break unrelated commands, not even by exiting
            except (Exception, SystemExit, KeyboardInterrupt) as error:
                registry.failed.append(FailedPlugin(name, label, f"import failed: {one_line(error)}"))
                return
            try:
                registry.register_plugin(plugin_manager, plugin, name, package, version)
            except (Exception, SystemExit, KeyboardInterrupt) as error:
                message = " ".join(str(error).split()) if isinstance(error, XmcError) else one_line(error)
                registry.failed.append(FailedPlugin(name, label, message))

    if load_entry_points:
        entry_points = _load_order(importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME))
        requested = registry.requested = requested_plugins()
        autoload = not autoload_disabled()
        available = {ep.name for ep in entry_points}
        for name in requested:
            if name not in available:
                registry.failed.append(FailedPlugin(
                    name, "<not installed>", f"{PLUGINS_ENV} names {name!r}, but no installed package has an "
                    f"entry point of that name in the {hookspecs.PROJECT_NAME!r} group: "
                    f"{closest_names_hint(name, available) if available else 'none is installed'}"))
        for entry_point in entry_points:
            package, version = _package_of(entry_point)
            if not autoload and entry_point.name not in requested:
                registry.skipped.append((entry_point.name, " ".join(p for p in (package, version) if p)))
                continue
            load(entry_point.name, package, version, entry_point.load)
    for name, plugin in extra_plugins:
        load(name, "<in-process>", "", lambda plugin=plugin: plugin)
    return registry
