"""The plugin registry: discovers plugins through entry points and looks up what they registered.

Nothing is loaded at import time: call `build_registry()`.

Loading fails safe. A plugin that cannot be imported, implements a hook that `xmcbench/hookspecs.py` does not
declare, or whose hook raises (a registration of the wrong type, a name unusable on the command line, any
exception) is not loaded: whatever it had registered is removed again, and `Registry.failed` records it with
its package and a one-line error (for an exception: the file and line in the plugin's code where it was
raised), which `xmcbench plugins` prints. Commands that do not need it keep working.

A name another plugin registered first (a clash) rejects only that name: the rest of the plugin loads, and
`Registry.failed` records the clash as a `RejectedName` entry, a FailedPlugin naming both plugins.
`Registry.failures_of(name)` lists the entries of one plugin (a plugin author's test asserts it is empty).

A plugin is a module with `@hookimpl` functions (what an entry point names), or any other object whose
attributes are hook functions, marked or not (a `types.SimpleNamespace`, an instance): such an object is
registered through a stand-in that marks its plain callables.

Environment:
    XMCBENCH_DISABLE_PLUGIN_AUTOLOAD=1   load no entry point except those named in XMCBENCH_PLUGINS (the
                                         built-in `lightxml`, `xmcbench-datasets`, `xmcbench-formats`,
                                         `xmcbench-loggers`, `xmcbench-executors` and `xmcbench-metrics`
                                         plugins are entry points too).
    XMCBENCH_PLUGINS=name1,name2         entry-point names to load explicitly; a name no installed package
                                         provides is reported as a failed plugin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pluggy

from xmcbench import hookspecs
from xmcbench.config import MethodSpec, Option
from xmcbench.errors import UnknownName, XmcError, closest_names_hint, error_line, joined_line

COMPONENT_KINDS = ("encoder", "recaller", "ranker", "sampler")
# Characters a registered name must not contain: they break its use on the command line (a path, `--set
# key=value`, comma-separated lists). Whitespace and control characters are refused too.
BAD_NAME_CHARACTERS = "/=,"
DISABLE_AUTOLOAD_ENV = "XMCBENCH_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "XMCBENCH_PLUGINS"
BUILTIN_DISTRIBUTION = "xmcbench"
# "package.module:attribute.path": a factory named by the entry-point syntax, imported when first used (LazyFactory)
LAZY_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
# Every hook of hookspecs.py, in the order they are defined there and run for each plugin (components
# first, so a plugin's methods may name its components).
HOOK_NAMES = tuple(name for name, value in vars(hookspecs).items()
                   if callable(value) and hasattr(value, hookspecs.PROJECT_NAME + "_spec"))


class LazyFactory:
    """A factory a plugin names as "module:attribute" (the entry-point syntax) instead of passing it: imported
    when it is first called or its signature is read, so that registering costs no import and `xmcbench
    plugins` or `datasets` do not load torch for every plugin's components. A name that cannot be imported
    fails there, in one XmcError line naming the plugin."""

    def __init__(self, target: str, owner: str) -> None:
        self.target = target
        self.owner = owner   # "encoder 'transformer-cls' of plugin lightxml (xmcbench 0.1.0)", for errors
        self._value: Callable[..., Any] | None = None
        # where the factory lives, known without importing it (messages and checks that name a factory read these)
        self.__module__, _, self.__qualname__ = target.partition(":")
        self.__name__ = self.__qualname__.rpartition(".")[2]

    def resolve(self) -> Callable[..., Any]:
        if self._value is None:
            module_name, _, attribute = self.target.partition(":")
            try:
                value: Any = importlib.import_module(module_name)
                for part in attribute.split("."):
                    value = getattr(value, part)
            except Exception as error:   # an import error of the plugin's code, or a name it lacks
                raise XmcError(f"{self.owner}: cannot import {self.target} ({type(error).__name__}: "
                               f"{joined_line(error)}); reinstall the plugin or fix its registration") from None
            if not callable(value):
                raise XmcError(f"{self.owner}: {self.target} is not callable: {_short_repr(value)}")
            self._value = value
        return self._value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:   # what call_factory reads to pass the keywords it declares
        return inspect.signature(self.resolve())

    def __repr__(self) -> str:
        return f"LazyFactory({self.target!r})"


def resolved(factory: Any) -> Any:
    """The factory itself: a LazyFactory's import done (its errors one XmcError line), anything else as given.
    What the registry's lookups return, so that a run gets, and a test can compare, the plugin's own object."""
    return factory.resolve() if isinstance(factory, LazyFactory) else factory


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: its name, the distribution that ships it, the hooks it implements and what it
    registered.

    source: the files and folders of its code (the top-level package of its module, or the module file, and
    the files of its hook functions), which `source_digest` hashes. released: its distribution was installed
    from a built package (a wheel: a .dist-info whose RECORD lists the plugin's files, not editable), so its
    version identifies its code; False for editable installs, source checkouts (an .egg-info) and plugins
    given in-process, whose code only a digest of `source` identifies (see `code_record`)."""

    name: str
    package: str
    version: str
    registered: list[str] = field(default_factory=list, hash=False)
    hooks: list[str] = field(default_factory=list, hash=False)
    source: tuple[str, ...] = field(default=(), hash=False)
    released: bool = False


class FailedPlugin(NamedTuple):
    """A plugin that was not loaded: its name, its package ("name version"), and a one-line error."""

    name: str
    package: str
    error: str


class RejectedName(FailedPlugin):
    """A name a loaded plugin registered that another plugin (or itself) had registered first: that one
    registration was not loaded, the rest of the plugin was. Recorded in `Registry.failed` beside the
    plugins that were not loaded, so `xmcbench plugins` prints it."""


@dataclass(frozen=True)
class Entry:
    value: Any
    origin: str  # "plugin-name (package version)" for error messages
    plugin: PluginInfo | None = None   # the plugin that registered it; None when registered outside plugin loading


@dataclass(frozen=True)
class LoggerSpec:
    """A training logger a plugin registered (`Registry.add_logger`): `factory(run_dir, config)` returns an
    `xmcbench.callbacks.TrainingCallback`; `extra` is the pip extra that installs its library
    (`pip install 'xmcbench[EXTRA]'`), None when it needs none."""

    name: str
    factory: Callable[..., Any]
    description: str
    extra: str | None = None


@dataclass(frozen=True)
class ExecutorSpec:
    """A grid executor a plugin registered (`Registry.add_executor`), for `xmcbench compare --executor NAME`:
    `factory(options)` receives an `xmcbench.executors.ExecutorOptions` and returns an
    `xmcbench.executors.Executor`; `extra` is the pip extra that installs its engine, None when it needs none."""

    name: str
    factory: Callable[..., Any]
    description: str
    extra: str | None = None


@dataclass(frozen=True)
class IndexerSpec:
    """A label indexer a plugin registered (`Registry.add_indexer`), for `--set indexer=NAME`:
    `index(label_features, num_clusters, seed, threads)` returns the (L,) cluster of each label (the contract is
    in xmcbench.indexing)."""

    name: str
    index: Callable[..., Any]
    description: str


class RegistrationError(XmcError):
    """A plugin registered something the registry rejects (wrong type, unknown kind, duplicate name)."""


class PluginLoadError(XmcError):
    """A plugin could not be loaded; the message is one line naming what is wrong."""


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
    """Typed tables of components, methods, datasets, data formats, training loggers, grid executors, metric
    families and label indexers, filled by the plugins' hooks."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Entry]] = {kind: {} for kind in COMPONENT_KINDS}
        self.component_options: dict[tuple[str, str], tuple] = {}   # (kind, name) -> its config.Options
        self.component_checks: dict[tuple[str, str], Callable] = {}   # (kind, name) -> check(config, label_info)
        self.conformance_options: dict[tuple[str, str], dict] = {}   # (kind, name) -> options the suite builds with
        self.retrievers: set[str] = set()   # recallers registered with retriever=True
        self.methods: dict[str, Entry] = {}
        self.datasets: dict[str, Entry] = {}
        self.formats: dict[str, Entry] = {}   # data formats (xmcbench.formats.DataFormat) by name
        self.loggers: dict[str, Entry] = {}   # training loggers (LoggerSpec) by name, for `--set loggers=...`
        self.executors: dict[str, Entry] = {}   # grid executors (ExecutorSpec) by name, for `compare --executor`
        self.metrics: dict[str, Entry] = {}   # metric families (xmcbench.metrics.MetricFamily) by name
        self.indexers: dict[str, Entry] = {}   # label indexers (IndexerSpec) by name, for `--set indexer=...`
        self.plugins: list[PluginInfo] = []
        # plugins not loaded, each with a one-line error, and names rejected (RejectedName) of loaded plugins
        self.failed: list[FailedPlugin] = []
        self.skipped: list[tuple[str, str]] = []   # (entry point, package) not loaded: autoloading is off
        self.requested: list[str] = []   # the entry points named in XMCBENCH_PLUGINS
        self._current: PluginInfo | None = None
        self._added: list[tuple[dict[str, Entry], str]] = []   # what the current plugin added, to roll back
        self._rejected: list[str] = []   # the current plugin's clashes, recorded once it has loaded

    # -- registration (called from hooks) ---------------------------------------------------------
    def add_component(self, kind: str, name: str, factory: Callable[..., Any], options: tuple = (),
                      check: Callable[..., None] | None = None, conformance_options: dict | None = None,
                      retriever: bool = False) -> None:
        """options: the `xmcbench.config.Option`s the component reads from config.options (checked before a
        run, listed by `xmcbench plugins --options`).

        check: `check(config, label_info)`, called while a run that uses the component is planned, before its
        output folder is touched: it raises `xmcbench.errors.XmcError` in one line when the component refuses
        the run's settings (`config`, a TrainConfig) or labels (`label_info`, an `xmcbench.interfaces.LabelInfo`
        of the run's training rows: `xmcbench.labels.label_info`), and returns None otherwise.

        conformance_options: {option name: value} that `tests/test_conformance.py` (and
        `xmcbench.testing.conformance_config`) build the component with: what a component with a required
        option needs to be checked; without them such a component is skipped there, with the reason.

        retriever: a recaller whose factory builds an `xmcbench.interfaces.Retriever` (labels found by
        nearest-neighbour search): with one label per cluster it still shortlists for the method's ranker, which
        the run checks before anything trains."""
        if retriever and kind != "recaller":
            raise RegistrationError(f"plugin {self._origin()} registers {kind} {name!r} as a retriever; only a "
                                    "recaller can be one")
        if kind not in COMPONENT_KINDS:
            raise RegistrationError(f"plugin {self._origin()} registers a component of unknown kind {kind!r}; "
                                    f"kinds are {', '.join(COMPONENT_KINDS)}")
        self._check_name(f"a {kind}", name)
        factory = self._callable(factory, f"{kind} {name!r}")
        if not all(isinstance(option, Option) for option in options):
            raise RegistrationError(f"plugin {self._origin()} registers {kind} {name!r} with options that are not "
                                    "xmcbench.config.Option objects")
        if isinstance(check, str) and LAZY_TARGET.fullmatch(check):
            check = LazyFactory(check, f"the check of {kind} {name!r} of plugin {self._origin()}")
        if check is not None and not callable(check):
            raise RegistrationError(f"plugin {self._origin()} registers {kind} {name!r} with a check that is not "
                                    f"callable: {_short_repr(check)}; give check(config, label_info), or None")
        if conformance_options is not None:
            if not isinstance(conformance_options, dict):
                raise RegistrationError(f"plugin {self._origin()} registers {kind} {name!r} with conformance_options "
                                        f"that are not a dict of option name -> value: "
                                        f"{_short_repr(conformance_options)}")
            declared = [option.name for option in options]
            undeclared = [key for key in conformance_options if key not in declared]
            if undeclared:
                raise RegistrationError(f"plugin {self._origin()} registers {kind} {name!r} with conformance_options "
                                        f"for {_short_repr(undeclared[0])}, which it does not declare: "
                                        f"{closest_names_hint(str(undeclared[0]), declared) if declared else 'it declares no option'}")
        if self._add(self.components[kind], f"{kind} {name!r}", name, factory):   # not when the name clashed
            self.component_options[(kind, name)] = tuple(options)
            if check is not None:
                self.component_checks[(kind, name)] = check
            if conformance_options is not None:
                self.conformance_options[(kind, name)] = dict(conformance_options)
            if retriever:
                self.retrievers.add(name)

    def add_method(self, method) -> None:
        if not isinstance(method, MethodSpec):
            raise RegistrationError(f"plugin {self._origin()} registers a method that is not a MethodSpec: "
                                    f"{_short_repr(method)}")
        if method.whole_method is not None:
            from xmcbench.whole_contract import WholeMethod

            if not (isinstance(method.whole_method, type) and issubclass(method.whole_method, WholeMethod)):
                raise RegistrationError(f"plugin {self._origin()} registers method {method.name!r} whose whole_method "
                                        f"is not a subclass of xmcbench.interfaces.WholeMethod: "
                                        f"{_short_repr(method.whole_method)}")
        self._check_name("a method", method.name)
        self._add(self.methods, f"method {method.name!r}", method.name, method)

    def add_dataset(self, dataset) -> None:
        from xmcbench.data import DatasetSpec

        if not isinstance(dataset, DatasetSpec):
            raise RegistrationError(f"plugin {self._origin()} registers a dataset that is not a DatasetSpec: "
                                    f"{_short_repr(dataset)}")
        self._check_name("a dataset", dataset.name)
        self._add(self.datasets, f"dataset {dataset.name!r}", dataset.name, dataset)

    def add_format(self, data_format) -> None:
        from xmcbench.formats import DataFormat

        if not isinstance(data_format, DataFormat):
            raise RegistrationError(f"plugin {self._origin()} registers a data format that is not a DataFormat: "
                                    f"{_short_repr(data_format)}")
        self._check_name("a data format", data_format.name)
        self._add(self.formats, f"format {data_format.name!r}", data_format.name, data_format)

    def add_logger(self, name: str, factory: Callable[..., Any], description: str,
                   extra: str | None = None) -> None:
        """A training logger users enable with `--set loggers=NAME`: `factory(run_dir, config)` returns an
        `xmcbench.callbacks.TrainingCallback` (see xmcbench/callbacks.py); `description` is one line for
        `xmcbench plugins`; `extra` names the pip extra providing its library, None if it needs none."""
        factory, description = self._check_named_factory("logger", name, factory, description, extra)
        spec = LoggerSpec(name, factory, description, extra)
        self._add(self.loggers, f"logger {name!r}", name, spec)

    def add_executor(self, name: str, factory: Callable[..., Any], description: str,
                     extra: str | None = None) -> None:
        """A grid executor users choose with `xmcbench compare --executor NAME`: `factory(options)` returns an
        `xmcbench.executors.Executor` (see xmcbench/executors.py); `description` is one line for `xmcbench
        plugins`; `extra` names the pip extra providing its engine, None if it needs none."""
        factory, description = self._check_named_factory("executor", name, factory, description, extra)
        spec = ExecutorSpec(name, factory, description, extra)
        self._add(self.executors, f"executor {name!r}", name, spec)

    def add_metric_family(self, family) -> None:
        """A family of metrics (`xmcbench.metrics.MetricFamily`) that evaluations compute, reports show and, when
        selectable, `selection_metric` may name."""
        from xmcbench.metrics import OTHER_KEYS, MetricFamily, parse_at_k

        if not isinstance(family, MetricFamily):
            raise RegistrationError(f"plugin {self._origin()} registers a metric family that is not an "
                                    f"xmcbench.metrics.MetricFamily: {_short_repr(family)}")
        self._check_name("a metric family", family.name)
        problem = None
        if parse_at_k(f"{family.name}@1") != (family.name, 1) or family.name in OTHER_KEYS:
            problem = (f"a name of letters, digits and '_' (its keys are NAME@K), none of {', '.join(OTHER_KEYS)}, "
                       f"not {family.name!r}")
        elif not callable(family.compute):
            problem = f"compute(ranking) that is callable, not {_short_repr(family.compute)}"
        elif not isinstance(family.description, str) or len(family.description.strip().splitlines()) != 1:
            problem = f"a description (one line of text), not {_short_repr(family.description)}"
        elif family.selectable and not family.at_k:
            problem = "at_k=True to be selectable (validation scores one cut-off)"
        if problem:
            raise RegistrationError(f"plugin {self._origin()} registers metric family {_short_repr(family.name)}: "
                                    f"give it {problem}")
        self._add(self.metrics, f"metric family {family.name!r}", family.name, family)

    def metric_families(self) -> tuple:
        """The registered `xmcbench.metrics.MetricFamily`s in the order they were registered (xmcbench's own
        first): the order of their keys in metrics.json and in tables. The `families` of metrics.evaluate,
        format_metrics, selection_metrics and the report's functions. A registry that loaded no metric plugin
        (a test's, or autoloading off without xmcbench-metrics named) scores with xmcbench's own families,
        metrics.BUILTIN_FAMILIES, the very objects that plugin registers: a run is never left unscorable."""
        if not self.metrics:
            from xmcbench.metrics import BUILTIN_FAMILIES   # numpy and scipy: only when a run scores

            return BUILTIN_FAMILIES
        return tuple(entry.value for entry in self.metrics.values())

    def add_indexer(self, name: str, index: Callable[..., Any], description: str) -> None:
        """A label indexer users pick with `--set indexer=NAME`: `index(label_features, num_clusters, seed,
        threads)` returns the (L,) cluster of each label (see xmcbench.indexing); `description` is one line for
        `xmcbench plugins`."""
        index, description = self._check_named_factory("indexer", name, index, description, None)
        spec = IndexerSpec(name, index, description)
        self._add(self.indexers, f"indexer {name!r}", name, spec)

    def _check_named_factory(self, what: str, name: str, factory: Any, description: Any,
                             extra: Any) -> tuple[Any, str]:
        """Check a registration of a named factory with a description and an optional pip extra (loggers,
        executors, indexers); return the factory (a LazyFactory for "module:attribute") and the description on
        one line."""
        self._check_name(f"{'an' if what[0] in 'aeiou' else 'a'} {what}", name)
        factory = self._callable(factory, f"{what} {name!r}")
        if not isinstance(description, str) or not description.strip():
            raise RegistrationError(f"plugin {self._origin()} registers {what} {name!r} without a description "
                                    f"(one line of text): {_short_repr(description)}")
        if extra is not None and (not isinstance(extra, str) or not extra or extra != extra.strip()):
            raise RegistrationError(f"plugin {self._origin()} registers {what} {name!r} with extra "
                                    f"{_short_repr(extra)}; give the name of a pip extra, or None")
        return factory, " ".join(description.split())

    def _callable(self, value: Any, what: str) -> Any:
        """A registered factory or check as given, or the LazyFactory of a "module:attribute" string; anything
        else that is not callable is refused with the plugin named."""
        if isinstance(value, str) and LAZY_TARGET.fullmatch(value):
            return LazyFactory(value, f"{what} of plugin {self._origin()}")
        if not callable(value):
            raise RegistrationError(f"plugin {self._origin()} registers {what} with a factory that is not callable: "
                                    f"{_short_repr(value)}; give a callable, or \"module:attribute\" naming one")
        return value

    def _origin(self) -> str:
        info = self._current
        if info is None:
            return "<in-process>"
        return f"{info.name} ({' '.join(part for part in (info.package, info.version) if part)})"

    def _check_name(self, what: str, name: Any) -> None:
        """A name must be usable on the command line: a non-empty string without whitespace, control
        characters or BAD_NAME_CHARACTERS, not starting with '-'."""
        if not isinstance(name, str) or not name:
            problem = "is not a non-empty string"
        elif any(character.isspace() for character in name):
            problem = "contains whitespace"
        elif any(character in BAD_NAME_CHARACTERS for character in name):
            problem = "contains " + " and ".join(repr(c) for c in BAD_NAME_CHARACTERS if c in name)
        elif not name.isprintable():
            problem = "contains a control character"
        elif name.startswith("-"):
            problem = "starts with '-', so it reads as an option"
        else:
            return
        raise RegistrationError(f"plugin {self._origin()} registers {what} named {_short_repr(name)}, which "
                                f"{problem}; names are typed on the command line: no whitespace, "
                                f"{', '.join(repr(c) for c in BAD_NAME_CHARACTERS)} or leading '-'")

    def _add(self, table: dict[str, Entry], what: str, name: str, value: Any) -> bool:
        """Add `name` to `table`; False when a plugin being loaded registers a name registered before (a
        clash: that name alone is rejected, recorded once the plugin has loaded)."""
        if name in table:
            first, origin = table[name].origin, self._origin()
            if self._current is None:
                raise RegistrationError(f"{what} is registered twice: by {first} and by {origin}; uninstall or "
                                        "rename one of them")
            # a clash rejects this one name; the rest of the plugin loads
            plugin = self._current.name
            if first == origin:
                self._rejected.append(f"plugin {origin} registers {what} twice; the second registration was "
                                      "not loaded")
            else:
                self._rejected.append(f"{what} is registered twice: by {first} and by {origin}; {plugin}'s "
                                      f"{name!r} was not loaded (the rest of {plugin} was); uninstall or rename "
                                      "one of them")
            return False
        table[name] = Entry(value, self._origin(), self._current)
        if self._current is not None:
            self._current.registered.append(what)
            self._added.append((table, name))
        return True

    # -- look-up ----------------------------------------------------------------------------------
    def failures_of(self, plugin: str) -> list[FailedPlugin]:
        """What went wrong with the plugin of that (entry-point) name, unlike `failed`, which holds every
        plugin's: its failure, or the names of it that were rejected; empty when it loaded in full. A plugin
        that was neither loaded nor failed (not installed, or skipped as autoloading is off) gives one entry
        saying so. A plugin's own test asserts `not registry.failures_of("mine")`, which does not depend on
        the other installed plugins."""
        found = [failure for failure in self.failed if failure.name == plugin]
        if found or any(info.name == plugin for info in self.plugins):
            return found
        skipped = next((package for name, package in self.skipped if name == plugin), None)
        if skipped is not None:
            return [FailedPlugin(plugin, skipped, f"not loaded: plugin autoloading is off ({DISABLE_AUTOLOAD_ENV});"
                                                  f" name it in {PLUGINS_ENV}")]
        loaded = [info.name for info in self.plugins]
        return [FailedPlugin(plugin, "<not installed>", f"no plugin named {plugin!r} was loaded or failed: is "
                             f"its package installed? loaded: {', '.join(loaded) if loaded else 'none'}")]

    def _missing_hint(self) -> str:
        """Why a name may be missing: plugins that failed to load, or were not loaded (autoloading off)."""
        notes = []
        not_loaded = [f.name for f in self.failed if not isinstance(f, RejectedName)]
        if not_loaded:
            notes.append("plugins that failed to load: " + ", ".join(not_loaded))
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
            raise UnknownName(f"unknown {kind} {name!r}: {closest_names_hint(name, table)} "
                              f"(`xmcbench plugins` lists them{self._missing_hint()})")
        return resolved(table[name].value)

    def default_dataset(self) -> str:
        """The dataset a run uses when none is named: the first registered one whose plugin marks it
        (DatasetSpec.is_default; xmcbench's own datasets plugin marks its smallest)."""
        for name, entry in self.datasets.items():
            if entry.value.is_default:
                return name
        raise XmcError("no dataset named and no installed plugin marks a default one: give --dataset NAME_OR_PATH "
                       "(`xmcbench datasets` lists them)")

    def method(self, name: str):
        if name not in self.methods:
            raise UnknownName(f"unknown method {name!r}: {closest_names_hint(name, self.methods)} "
                              f"(`xmcbench plugins` lists them{self._missing_hint()})")
        return self.methods[name].value

    def dataset(self, name: str):
        if name not in self.datasets:
            raise UnknownName(f"unknown dataset {name!r}: {closest_names_hint(name, self.datasets)} "
                              f"(`xmcbench datasets` lists them; a folder path works too{self._missing_hint()})")
        return self.datasets[name].value

    def format(self, name: str):
        if name not in self.formats:
            raise UnknownName(f"unknown data format {name!r}: {closest_names_hint(name, self.formats)} "
                              f"(`xmcbench formats` lists them{self._missing_hint()})")
        return self.formats[name].value

    def logger(self, name: str) -> Callable[..., Any]:
        """The factory of the training logger `name` (`factory(run_dir, config) -> TrainingCallback`)."""
        if name not in self.loggers:
            raise UnknownName(f"unknown logger {name!r} in loggers: {closest_names_hint(name, self.loggers)} "
                              f"(`xmcbench plugins` lists them{self._missing_hint()})")
        return resolved(self.loggers[name].value.factory)

    def executor(self, name: str) -> ExecutorSpec:
        """The grid executor `name` (`xmcbench compare --executor NAME`)."""
        if name not in self.executors:
            raise UnknownName(f"unknown executor {name!r} for --executor: {closest_names_hint(name, self.executors)} "
                              f"(`xmcbench plugins` lists them{self._missing_hint()})")
        return self.executors[name].value

    def indexer(self, name: str) -> IndexerSpec:
        """The label indexer `name` (`--set indexer=NAME`)."""
        if name not in self.indexers:
            raise UnknownName(f"unknown indexer {name!r} in indexer: the registered ones are "
                              f"{', '.join(sorted(self.indexers)) or 'none'} (`xmcbench plugins` lists them"
                              f"{self._missing_hint()})")
        spec = self.indexers[name].value
        return dataclasses.replace(spec, index=resolved(spec.index))

    # -- filling ----------------------------------------------------------------------------------
    def register_plugin(self, plugin_manager: pluggy.PluginManager, plugin: Any, name: str,
                        package: str = "", version: str = "",
                        distribution: importlib.metadata.Distribution | None = None) -> None:
        """Register one plugin object (a module, or any object with hook functions) and run its hooks into
        this registry. distribution: the installed distribution that ships it (None: given in-process), which
        says whether its version identifies its code (PluginInfo.released).

        On any failure nothing of the plugin stays: its registrations are removed, it is unregistered from
        `plugin_manager`, and an XmcError with a one-line message is raised (RegistrationError for what the
        registry rejects, PluginLoadError otherwise; for an exception, with where the plugin's code raised
        it). A name registered before (a clash) is not a failure: that name alone is not loaded, and a
        RejectedName in `failed` says so."""
        plugin = hookable(plugin)
        try:
            files, folders = _plugin_code(plugin)
        except Exception:   # code that cannot be located is identified by nothing but its version
            files, folders = set(), ()
        source = tuple(sorted({*folders, *(file for file in files if not file.startswith(folders))}))
        info = PluginInfo(name, package or "<in-process>", version, source=source,
                          released=_released(distribution, files))
        hooks = validate_plugin(plugin_manager, plugin, name)
        try:
            plugin_manager.register(plugin, name=name)
        except pluggy.PluginValidationError as error:
            raise PluginLoadError(f"plugin {name!r} does not match xmcbench/hookspecs.py: "
                                  f"{joined_line(error)}") from error
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
        self._current, self._added, self._rejected = info, [], []
        try:
            others = [p for p in plugin_manager.get_plugins() if p is not plugin]
            for hook in HOOK_NAMES:
                try:
                    plugin_manager.subset_hook_caller(hook, others)(registry=self)
                except RegistrationError as error:
                    raise RegistrationError(f"{error}{_raised_at(error, plugin)}") from error
                except Exception as error:
                    raise PluginLoadError(f"plugin {self._origin()}: hook {hook} raised {error_line(error)}"
                                          f"{_raised_at(error, plugin)}") from error
        except BaseException:
            for table, added in self._added:
                table.pop(added, None)
                for kind, components in self.components.items():
                    if table is components:
                        for per_component in (self.component_options, self.component_checks,
                                              self.conformance_options):
                            per_component.pop((kind, added), None)
                        if kind == "recaller":
                            self.retrievers.discard(added)
            self.plugins.remove(info)
            plugin_manager.unregister(plugin)
            raise
        else:
            label = " ".join(part for part in (package or "<in-process>", version) if part)
            self.failed.extend(RejectedName(name, label, message) for message in self._rejected)
        finally:
            self._current, self._added, self._rejected = None, [], []


# -- plugins that are not modules -----------------------------------------------------------------------

class ObjectPlugin:
    """The stand-in registered with pluggy for a plugin that is not a module (a `types.SimpleNamespace`, an
    instance of any class, a class): pluggy needs a hashable object whose hook functions carry @hookimpl
    markers. Each of the object's hook attributes becomes a marked function calling it: those already marked
    keep their options, plain callables named `xmcbench_*` get default ones (a misspelled one is then
    reported as an unknown hook). `target` is the object, `originals` its hook attributes by name."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._originals: dict[str, Callable] = {}

    def __repr__(self) -> str:
        return f"<plugin object {_short_repr(self._target)}>"


def _marker(value: Any) -> dict | None:
    try:
        options = getattr(value, hookspecs.PROJECT_NAME + "_impl", None)
    except Exception:
        return None
    return options if isinstance(options, dict) else None


def _call_like_pluggy(target: Callable) -> Callable:
    """A plain function taking `registry` that calls `target` with the arguments pluggy would pass it (its
    arguments without defaults; `validate_plugin` rejects any but `registry`)."""
    argnames = _hook_argnames(target)
    passes_registry = argnames is None or "registry" in argnames

    def hook(registry):
        return target(registry) if passes_registry else target()

    hook.__name__ = hook.__qualname__ = getattr(target, "__name__", "hook")
    return hook


def hookable(plugin: Any) -> Any:
    """`plugin` itself when it is a module or already a stand-in, else an ObjectPlugin for it."""
    if inspect.ismodule(plugin) or isinstance(plugin, ObjectPlugin):
        return plugin
    proxy = ObjectPlugin(plugin)
    for attribute in dir(plugin):
        if attribute.startswith("_"):
            continue
        try:
            value = getattr(plugin, attribute)
        except Exception:   # an attribute that raises on access is not a hook
            continue
        options = _marker(value)
        if not callable(value) or (options is None and not attribute.startswith(hookspecs.PROJECT_NAME + "_")):
            continue
        hook = _call_like_pluggy(value)
        if options is None:
            hookspecs.hookimpl(hook)
        else:   # keep its options (tryfirst, specname, ...)
            setattr(hook, hookspecs.PROJECT_NAME + "_impl", dict(options))
        setattr(proxy, attribute, hook)
        proxy._originals[attribute] = value
    return proxy


def _original(plugin: Any, attribute: str) -> Any:
    """The plugin's own attribute (for a stand-in, what it stands for)."""
    if isinstance(plugin, ObjectPlugin) and attribute in plugin._originals:
        return plugin._originals[attribute]
    return getattr(plugin, attribute)


# -- where a hook raised --------------------------------------------------------------------------------

def _code_file(value: Any) -> str | None:
    """The source file of a function, method or callable object, if it has one."""
    value = inspect.unwrap(value) if callable(value) else value
    value = getattr(value, "__func__", value)
    code = getattr(value, "__code__", None)
    if code is None and not inspect.isroutine(value):
        code = getattr(getattr(type(value).__call__, "__func__", type(value).__call__), "__code__", None)
    return code.co_filename if code is not None else None


def _plugin_code(plugin: Any) -> tuple[set[str], tuple[str, ...]]:
    """The files and folders of the plugin's code: its hook functions' files, and the top-level package (or
    the module) that defines it; never the standard library's."""
    files: set[str] = set()
    folders: list[str] = []
    target = plugin._target if isinstance(plugin, ObjectPlugin) else plugin
    for attribute in dir(plugin):
        if attribute.startswith("_"):
            continue
        try:
            value = _original(plugin, attribute)
        except Exception:
            continue
        if callable(value) and (_marker(value) is not None or isinstance(plugin, ObjectPlugin)):
            with contextlib.suppress(Exception):
                if (filename := _code_file(value)) is not None:
                    files.add(os.path.realpath(filename))
    module_name = target.__name__ if inspect.ismodule(target) else getattr(type(target), "__module__", "")
    top_name = (module_name or "").partition(".")[0]
    if top_name and top_name not in sys.stdlib_module_names and top_name not in ("builtins", "__main__"):
        module = sys.modules.get(module_name)
        if inspect.ismodule(target) and getattr(target, "__file__", None):
            module = target
        top = sys.modules.get(top_name)
        if module is not None and getattr(module, "__file__", None):
            files.add(os.path.realpath(module.__file__))
            if top is not None and getattr(top, "__path__", None):
                folders.extend(os.path.realpath(folder) for folder in top.__path__)
    return files, tuple(folder.rstrip(os.sep) + os.sep for folder in folders)


def _raised_at(error: BaseException, plugin: Any) -> str:
    """` (at FILE:LINE in FUNCTION)`: the innermost frame of the traceback in the plugin's code, else the
    last one; FILE relative to the working directory when inside it. Empty without a traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    try:
        files, folders = _plugin_code(plugin)
    except Exception:
        files, folders = set(), ()

    def inside(filename: str) -> bool:
        path = os.path.realpath(filename)
        return path in files or path.startswith(folders)

    frame = next((frame for frame in reversed(frames) if inside(frame.filename)), frames[-1])
    path = os.path.abspath(frame.filename)
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(path)
        if not relative.startswith(os.pardir + os.sep):
            path = relative
    return f" (at {path}:{frame.lineno} in {frame.name})"


# -- which code made a result -----------------------------------------------------------------------------

def _released(distribution: importlib.metadata.Distribution | None, files: set[str]) -> bool:
    """Whether the plugin's code `files` were installed by `distribution` from a built package, so that its
    version identifies them: a versioned, non-editable distribution (no "editable" in direct_url.json) whose
    RECORD lists every one of them. An editable install, a source checkout on the path (an .egg-info, which
    has no RECORD) or code found elsewhere than where the distribution installed it is not released."""
    if distribution is None or not distribution.version or not files:
        return False
    try:
        direct_url = json.loads(distribution.read_text("direct_url.json") or "{}")
        if (direct_url.get("dir_info") or {}).get("editable") or distribution.read_text("RECORD") is None:
            return False
        installed = {os.path.realpath(distribution.locate_file(path)) for path in distribution.files or ()}
    except (OSError, ValueError, AttributeError):
        return False
    return files <= installed


SOURCE_SUFFIX = ".py"   # the source files a digest covers


def source_digest(source: tuple[str, ...]) -> str:
    """sha256 over the Python files of `source` (folders: every *.py below them, caches left out; files:
    themselves), each named relative to its folder's parent, so the same code gives the same digest
    wherever it is checked out. A file that vanished counts as missing."""
    digest = hashlib.sha256()
    for root in map(Path, source):
        files = sorted(path for path in root.rglob("*" + SOURCE_SUFFIX) if "__pycache__" not in path.parts) \
            if root.is_dir() else [root]
        for path in files:
            name = f"{root.name}/{path.relative_to(root).as_posix()}" if root.is_dir() else root.name
            try:
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                content = "missing"
            digest.update(f"{name}\0{content}\n".encode())
    return digest.hexdigest()


def code_record(entry: Entry) -> dict:
    """Which code a registered entry (a method or a component) is, as a result key hashes it and config.json
    records it: its plugin, the distribution and version that ship it, and, where that version does not
    identify the code (an editable or development install, a plugin given in-process: not
    PluginInfo.released), "source_sha256", the source_digest of the plugin's files. An entry registered
    outside plugin loading has no plugin: the digest is of the file that defines it, if there is one."""
    info = entry.plugin
    if info is None:
        file = _code_file(entry.value) if callable(entry.value) else None
        return {"plugin": None, **({"source_sha256": source_digest((file,))} if file else {})}
    record = {"plugin": info.name, "distribution": info.package, "version": info.version}
    return record if info.released else {**record, "source_sha256": source_digest(info.source)}


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
        argnames = _hook_argnames(_original(plugin, attribute))
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

    def load(name: str, package: str, version: str, get_plugin: Callable[[], Any], distribution=None) -> None:
        label = " ".join(part for part in (package, version) if part)
        # a plugin's prints go to stderr, never into a command's output (predict writes JSON to stdout)
        with contextlib.redirect_stdout(sys.stderr):
            try:
                plugin = get_plugin()
            # a broken third-party plugin must not break unrelated commands, not even by exiting
            except (Exception, SystemExit, KeyboardInterrupt) as error:
                registry.failed.append(FailedPlugin(name, label, f"import failed: {error_line(error)}"))
                return
            try:
                registry.register_plugin(plugin_manager, plugin, name, package, version, distribution)
            except (Exception, SystemExit, KeyboardInterrupt) as error:
                message = joined_line(error) if isinstance(error, XmcError) else error_line(error)
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
            load(entry_point.name, package, version, entry_point.load, getattr(entry_point, "dist", None))
    for name, plugin in extra_plugins:
        load(name, "<in-process>", "", lambda plugin=plugin: plugin)
    return registry
