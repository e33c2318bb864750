"""Plugin loading fails safe: a throwaway plugin broken in each documented way is reported with its package
and a one-line error, leaves nothing registered, and never breaks commands that do not need it; a name clash
rejects only the clashing name. Plus the environment variables that control autoloading, and the hook
documentation."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xmcbench import hookspecs
from xmcbench.cli import app
from xmcbench.config import MethodSpec
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import HOOK_NAMES, FailedPlugin, RejectedName, build_registry

cli = CliRunner()
CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"


@pytest.fixture(autouse=True)
def default_loading(monkeypatch):
    """Autoloading on and no plugin named, whatever the environment running the tests says."""
    monkeypatch.delenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("XMCBENCH_PLUGINS", raising=False)


def plugin(name: str, **hooks) -> types.ModuleType:
    """A throwaway plugin module: each keyword is a hook (or any attribute) it defines."""
    module = types.ModuleType(name)
    for attribute, value in hooks.items():
        setattr(module, attribute, value)
    return module


def components(*registrations):
    @hookimpl
    def xmcbench_register_components(registry):
        for kind, name, factory in registrations:
            registry.add_component(kind, name, factory)
    return xmcbench_register_components


def recaller_factory(config, in_dim, num_clusters):
    raise NotImplementedError


@hookimpl
def raising_methods_hook(registry):
    registry.add_method(MethodSpec("half-registered", "registered before the hook raises"))
    raise RuntimeError("boom\nsecond line of the message")


@hookimpl
def misspelled(registry):
    pass


@hookimpl
def wrong_argument(reg):
    pass


def unmarked(registry):
    pass


@hookimpl
def wrong_type_methods(registry):
    registry.add_method({"name": "not-a-spec"})


@hookimpl
def wrong_type_datasets(registry):
    registry.add_dataset("debian-debtags-mini")


@hookimpl
def badly_named_method(registry):
    registry.add_method(MethodSpec("my method", "a name with a space"))


# (plugin name, plugin module, what registry.failed must say). Every plugin also registers a recaller of
# its own first where it can, to show that its partial registrations are rolled back.
BROKEN = [
    ("raiser", plugin("raiser", xmcbench_register_components=components(("recaller", "raiser-own", recaller_factory)),
                      xmcbench_register_methods=raising_methods_hook),
     "plugin raiser (broken-raiser 9.9): hook xmcbench_register_methods raised RuntimeError: boom"),
    ("misspelled", plugin("misspelled", xmcbench_register_components=components(("recaller", "misspelled-own",
                                                                                 recaller_factory)),
                          xmcbench_register_method=misspelled),
     "plugin 'misspelled' implements unknown hook 'xmcbench_register_method': did you mean "
     "'xmcbench_register_methods'"),
    ("wrong-argument", plugin("wrong-argument", xmcbench_register_components=wrong_argument),
     "plugin 'wrong-argument': hook xmcbench_register_components takes argument(s) reg, which the hookspec does "
     "not pass (it passes: registry)"),
    ("unmarked", plugin("unmarked", xmcbench_register_components=components(("recaller", "unmarked-own",
                                                                             recaller_factory)),
                        xmcbench_register_datasets=unmarked),
     "plugin 'unmarked' defines xmcbench_register_datasets without @hookimpl"),
    ("wrong-kind", plugin("wrong-kind", xmcbench_register_components=components(
        ("recaller", "wrong-kind-own", recaller_factory), ("scorer", "x", recaller_factory))),
     "plugin wrong-kind (broken-wrong-kind 9.9) registers a component of unknown kind 'scorer'"),
    ("not-callable", plugin("not-callable", xmcbench_register_components=components(
        ("recaller", "not-callable-own", recaller_factory), ("ranker", "x", 42))),
     "registers ranker 'x' with a factory that is not callable: 42"),
    ("wrong-method", plugin("wrong-method", xmcbench_register_components=components(
        ("recaller", "wrong-method-own", recaller_factory)), xmcbench_register_methods=wrong_type_methods),
     "registers a method that is not a MethodSpec: {'name': 'not-a-spec'}"),
    ("wrong-dataset", plugin("wrong-dataset", xmcbench_register_components=components(
        ("recaller", "wrong-dataset-own", recaller_factory)), xmcbench_register_datasets=wrong_type_datasets),
     "registers a dataset that is not a DatasetSpec: 'debian-debtags-mini'"),
    ("bad-name", plugin("bad-name", xmcbench_register_components=components(("recaller", "bad-name-own",
                                                                             recaller_factory)),
                        xmcbench_register_methods=badly_named_method),
     "plugin bad-name (broken-bad-name 9.9) registers a method named 'my method', which contains whitespace"),
    ("no-hooks", plugin("no-hooks", helper=lambda: None),
     "plugin 'no-hooks' implements no xmcbench hook (is its entry point the module with the @hookimpl functions?"),
]


BROKEN_MODULES = {name: module for name, module, _ in BROKEN}


class FakeEntryPoint:
    """What importlib.metadata returns for an installed plugin, without installing one."""

    group = hookspecs.PROJECT_NAME

    def __init__(self, name: str, target, package: str | None = None, version: str = "9.9") -> None:
        self.name, self.value, self._target = name, f"{name.replace('-', '_')}.plugin", target
        self.dist = types.SimpleNamespace(name=package or f"broken-{name}", version=version)

    def load(self):
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


def install(monkeypatch, *fakes: FakeEntryPoint) -> None:
    """Make the fake entry points look installed, beside the real ones."""
    real = importlib.metadata.entry_points

    def entry_points(**selection):
        found = list(real(**selection))
        return found + [fake for fake in fakes if selection.get("group", fake.group) == fake.group]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


# A plugin that registers a name lightxml registered first: that name alone is rejected, the rest loads.
CLASH = plugin("clash", xmcbench_register_components=components(
    ("recaller", "clash-recaller", recaller_factory), ("encoder", "transformer-cls", recaller_factory)))
CLASH_MESSAGE = ("encoder 'transformer-cls' is registered twice: by lightxml (xmcbench 0.1.0) and by clash "
                 "(broken-clash 9.9); clash's 'transformer-cls' was not loaded (the rest of clash was)")

IMPORT_ERROR = FakeEntryPoint("unimportable", ModuleNotFoundError("No module named 'missing_dependency'"))
IMPORT_ERROR_MESSAGE = "import failed: ModuleNotFoundError: No module named 'missing_dependency'"
ALL_BROKEN = [IMPORT_ERROR] + [FakeEntryPoint(name, module) for name, module, _ in BROKEN]
EXPECTED = {"unimportable": ("broken-unimportable 9.9", IMPORT_ERROR_MESSAGE),
            **{name: (f"broken-{name} 9.9", message) for name, _, message in BROKEN}}


def assert_unharmed(registry) -> None:
    """The built-in plugin loaded in full, nothing of a broken plugin stayed."""
    assert "lightxml" in [p.name for p in registry.plugins]
    assert registry.method("lightxml").name == "lightxml"
    assert registry.component("encoder", "transformer-cls").__module__ == "xmcbench_lightxml.encoder"
    assert "debian-debtags-mini" in registry.datasets
    assert not set(EXPECTED) & {p.name for p in registry.plugins}
    assert not any(name.endswith("-own") for name in registry.components["recaller"])
    assert "half-registered" not in registry.methods and "my method" not in registry.methods


def line_of(function, text: str) -> int:
    """The line number of the line of `function` containing `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def at(function, text: str) -> str:
    """What an error says about where `function`'s line containing `text` raised."""
    return f"test_plugin_loading.py:{line_of(function, text)} in {function.__name__})"


@pytest.mark.parametrize("name, module, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_in_process_plugin_is_reported_and_rolled_back(name, module, message):
    registry = build_registry(extra_plugins=[(name, module)])
    assert [(f.name, f.package) for f in registry.failed] == [(name, "<in-process>")]
    error = registry.failed[0].error
    assert "\n" not in error
    assert message.replace(f"broken-{name} 9.9", "<in-process>") in error
    assert_unharmed(registry)


def test_a_plugin_that_fails_to_import_is_reported_with_its_package(monkeypatch):
    install(monkeypatch, IMPORT_ERROR)
    registry = build_registry()
    assert registry.failed == [("unimportable", "broken-unimportable 9.9", IMPORT_ERROR_MESSAGE)]
    assert_unharmed(registry)


def test_every_broken_entry_point_at_once(monkeypatch):
    install(monkeypatch, *ALL_BROKEN, FakeEntryPoint("clash", CLASH))
    registry = build_registry()
    assert {f.name for f in registry.failed} == EXPECTED.keys() | {"clash"}
    for failed in registry.failed:
        package, message = EXPECTED.get(failed.name, ("broken-clash 9.9", CLASH_MESSAGE))
        assert failed.package == package and message in failed.error and "\n" not in failed.error, failed
        assert isinstance(failed, RejectedName) == (failed.name == "clash")
    assert_unharmed(registry)
    assert registry.components["recaller"]["clash-recaller"].origin == "clash (broken-clash 9.9)"


# -- a name clash rejects only that name -----------------------------------------------------------------

def test_a_clash_rejects_only_the_clashing_name():
    registry = build_registry(extra_plugins=[("clash", CLASH)])
    assert registry.failed == [("clash", "<in-process>", CLASH_MESSAGE.replace("broken-clash 9.9", "<in-process>")
                                + "; uninstall or rename one of them")]
    assert isinstance(registry.failed[0], RejectedName) and isinstance(registry.failed[0], FailedPlugin)
    info = next(p for p in registry.plugins if p.name == "clash")
    assert info.registered == ["recaller 'clash-recaller'"]
    assert registry.components["recaller"]["clash-recaller"].origin == "clash (<in-process>)"
    assert_unharmed(registry)   # transformer-cls is still lightxml's
    with pytest.raises(XmcError) as missing:   # a clash is not a plugin that failed to load
        registry.method("magic")
    assert "failed to load" not in str(missing.value)


def test_a_clash_keeps_the_plugins_methods_and_datasets_and_rejects_each_clash():
    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("lightxml", "a second lightxml"))
        registry.add_method(MethodSpec("mine", "my own method"))
        registry.add_method(MethodSpec("mine", "my own method, again"))

    @hookimpl
    def xmcbench_register_datasets(registry):
        registry.add_dataset(registry.dataset("debian-debtags-mini"))

    module = plugin("several", xmcbench_register_methods=xmcbench_register_methods,
                    xmcbench_register_datasets=xmcbench_register_datasets)
    registry = build_registry(extra_plugins=[("several", module)])
    assert [type(f) for f in registry.failed] == [RejectedName] * 3
    errors = [f.error for f in registry.failed]
    assert errors[0].startswith("method 'lightxml' is registered twice: by lightxml (xmcbench 0.1.0) and by "
                                "several (<in-process>); several's 'lightxml' was not loaded")
    assert errors[1] == ("plugin several (<in-process>) registers method 'mine' twice; the second registration "
                         "was not loaded")
    assert errors[2].startswith("dataset 'debian-debtags-mini' is registered twice: by xmcbench-datasets")
    assert registry.methods["mine"].value.description == "my own method"
    assert registry.methods["lightxml"].origin.startswith("lightxml (")
    assert_unharmed(registry)


def test_a_plugin_that_clashes_and_then_fails_is_reported_once_and_rolled_back():
    module = plugin("clash-then-raise", xmcbench_register_components=CLASH.xmcbench_register_components,
                    xmcbench_register_methods=raising_methods_hook)
    registry = build_registry(extra_plugins=[("clash-then-raise", module)])
    assert [type(f) for f in registry.failed] == [FailedPlugin]
    assert "hook xmcbench_register_methods raised RuntimeError: boom" in registry.failed[0].error
    assert "clash-recaller" not in registry.components["recaller"]
    assert_unharmed(registry)


def test_xmcbench_plugins_prints_a_clash_on_one_line_and_lists_the_plugin(monkeypatch):
    install(monkeypatch, FakeEntryPoint("clash", CLASH))
    result = cli.invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if "transformer-cls' is registered twice" in line] == \
        [f"warning: clash (broken-clash 9.9): {CLASH_MESSAGE}; uninstall or rename one of them"]
    assert re.search(r"^clash\s+broken-clash\s+9\.9\s+xmcbench_register_components\s+recaller 'clash-recaller'",
                     result.output, re.MULTILINE), result.output


# -- where a hook raised ---------------------------------------------------------------------------------

def test_a_hook_that_raises_is_reported_with_its_file_and_line():
    registry = build_registry(extra_plugins=[("raiser", BROKEN_MODULES["raiser"])], load_entry_points=False)
    error = registry.failed[0].error
    assert error.startswith("plugin raiser (<in-process>): hook xmcbench_register_methods raised RuntimeError: "
                            "boom (at ")
    assert error.endswith(at(raising_methods_hook, "raise RuntimeError")), error
    assert os.path.relpath(__file__) in error


def test_the_innermost_frame_in_the_plugins_code_is_named_not_xmcbenchs():
    @hookimpl
    def xmcbench_register_methods(registry):
        registry.method("no-such-method")   # raises inside xmcbench/registry.py

    registry = build_registry(extra_plugins=[("lookup", plugin("lookup", xmcbench_register_methods=
                                                              xmcbench_register_methods))], load_entry_points=False)
    error = registry.failed[0].error
    assert "raised UnknownName: unknown method 'no-such-method'" in error   # an XmcError, named by its kind
    assert error.endswith(at(xmcbench_register_methods, "no-such-method")), error


def test_a_rejected_registration_says_where_the_plugin_made_it():
    registry = build_registry(extra_plugins=[("wrong-method", BROKEN_MODULES["wrong-method"])], load_entry_points=False)
    assert "registers a method that is not a MethodSpec" in registry.failed[0].error
    assert registry.failed[0].error.endswith(at(wrong_type_methods, "add_method")), registry.failed[0].error


def test_an_installed_packages_innermost_frame_wins_over_the_standard_librarys(tmp_path, monkeypatch):
    package = tmp_path / "raising_package_for_xmcbench_tests"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("import json\n\n\ndef load():\n    return json.loads('{')\n")
    (package / "plugin.py").write_text("from xmcbench.hookspecs import hookimpl\n\nfrom . import helpers\n\n\n"
                                       "@hookimpl\ndef xmcbench_register_datasets(registry):\n    helpers.load()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    install(monkeypatch, FakeEntryPoint("raising", importlib.import_module(package.name + ".plugin")))
    try:
        registry = build_registry()
    finally:
        for name in [name for name in sys.modules if name.startswith(package.name)]:
            del sys.modules[name]
    (failed,) = registry.failed
    assert failed.error.startswith("plugin raising (broken-raising 9.9): hook xmcbench_register_datasets raised "
                                   "JSONDecodeError: Expecting property name")
    assert failed.error.endswith(f"{package / 'helpers.py'}:5 in load)"), failed.error


# -- names usable on the command line -------------------------------------------------------------------

@pytest.mark.parametrize("bad, problem", [
    ("", "is not a non-empty string"), ("my method", "contains whitespace"), ("tab\tname", "contains whitespace"),
    ("a/b", "contains '/'"), ("k=v", "contains '='"), ("a,b", "contains ','"), ("-x", "starts with '-'"),
    ("bell\x07", "contains a control character")])
def test_names_a_command_line_cannot_take_fail_the_plugin(bad, problem):
    @hookimpl
    def xmcbench_register_components(registry):
        registry.add_component("recaller", "named-own", recaller_factory)
        registry.add_component("ranker", bad, recaller_factory)

    registry = build_registry(extra_plugins=[("named", plugin("named", xmcbench_register_components=
                                                              xmcbench_register_components))])
    (failed,) = registry.failed
    assert failed.name == "named" and "\n" not in failed.error
    assert failed.error.startswith(f"plugin named (<in-process>) registers a ranker named {bad!r}, which {problem}")
    assert "named-own" not in registry.components["recaller"]
    assert_unharmed(registry)


@pytest.mark.parametrize("kind", ["method", "dataset", "format"])
def test_every_kind_of_name_is_checked(kind):
    from xmcbench.formats import DataFormat

    bad = "two words"
    add = {"method": lambda registry: registry.add_method(MethodSpec(bad, "x")),
           "dataset": lambda registry: registry.add_dataset(
               dataclasses.replace(registry.dataset("debian-debtags-mini"), name=bad)),
           "format": lambda registry: registry.add_format(DataFormat(bad, "x", detect=lambda path: False,
                                                                     read=lambda path, options: None))}[kind]
    hook = {"method": "xmcbench_register_methods", "dataset": "xmcbench_register_datasets",
            "format": "xmcbench_register_formats"}[kind]
    registry = build_registry(extra_plugins=[("named", plugin("named", **{hook: hookimpl(add)}))])
    assert [f.name for f in registry.failed] == ["named"]
    assert f"named 'two words', which contains whitespace" in registry.failed[0].error


# -- one plugin's failures, whatever else is installed ---------------------------------------------------

def test_failures_of_one_plugin_ignore_the_other_broken_plugins(monkeypatch):
    install(monkeypatch, *ALL_BROKEN, FakeEntryPoint("clash", CLASH))
    good = plugin("good", xmcbench_register_components=components(("recaller", "good-recaller", recaller_factory)))
    registry = build_registry(extra_plugins=[("good", good)])
    assert registry.failed and registry.failures_of("good") == [] and registry.failures_of("lightxml") == []
    assert registry.failures_of("raiser") == [f for f in registry.failed if f.name == "raiser"] != []
    assert [type(f) for f in registry.failures_of("clash")] == [RejectedName]
    (missing,) = registry.failures_of("not-installed")
    assert missing.package == "<not installed>" and "no plugin named 'not-installed' was loaded or failed" in \
        missing.error


def test_failures_of_a_plugin_skipped_because_autoloading_is_off(monkeypatch):
    install(monkeypatch, FakeEntryPoint("good", plugin("good", xmcbench_register_components=components(
        ("recaller", "good-recaller", recaller_factory)))))
    monkeypatch.setenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    (skipped,) = build_registry().failures_of("good")
    assert skipped.package == "broken-good 9.9" and "autoloading is off" in skipped.error


def test_a_third_party_clash_is_blamed_on_the_third_party_whatever_its_name(monkeypatch):
    early = plugin("aaa", xmcbench_register_components=components(("sampler", "dynamic", recaller_factory)))
    install(monkeypatch, FakeEntryPoint("aaa", early))   # sorts before lightxml, still loads after it
    registry = build_registry()
    assert [f.name for f in registry.failed] == ["aaa"]
    assert "sampler 'dynamic' is registered twice: by lightxml (xmcbench 0.1.0) and by aaa" in registry.failed[0].error
    assert "aaa's 'dynamic' was not loaded" in registry.failed[0].error
    assert registry.components["sampler"]["dynamic"].origin.startswith("lightxml (")
    assert_unharmed(registry)


def test_a_plugin_name_taken_by_an_installed_plugin():
    module = plugin("again", xmcbench_register_components=components(("recaller", "again-own", recaller_factory)))
    registry = build_registry(extra_plugins=[("lightxml", module)])
    assert registry.failed == [("lightxml", "<in-process>",
                                "another plugin named 'lightxml' from xmcbench 0.1.0 is already loaded; rename one "
                                "of the entry points")]
    assert_unharmed(registry)


def test_good_in_process_plugins_load_beside_broken_ones():
    good = plugin("good", xmcbench_register_components=components(("recaller", "good-recaller", recaller_factory)))
    registry = build_registry(extra_plugins=[("raiser", BROKEN_MODULES["raiser"]), ("good", good)])
    assert [f.name for f in registry.failed] == ["raiser"]
    assert registry.components["recaller"]["good-recaller"].origin == "good (<in-process>)"
    info = next(p for p in registry.plugins if p.name == "good")
    assert info.hooks == ["xmcbench_register_components"] and info.registered == ["recaller 'good-recaller'"]


def test_lookups_of_missing_names_mention_the_failed_plugins(monkeypatch):
    install(monkeypatch, IMPORT_ERROR)
    registry = build_registry()
    for lookup in (lambda: registry.method("xml-magic"), lambda: registry.dataset("magic-data"),
                   lambda: registry.component("encoder", "magic")):
        with pytest.raises(XmcError, match="plugins that failed to load: unimportable"):
            lookup()


# -- the command line ----------------------------------------------------------------------------------

def test_xmcbench_plugins_prints_each_failure_on_one_line(monkeypatch):
    install(monkeypatch, *ALL_BROKEN)
    result = cli.invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name, (package, message) in EXPECTED.items():
        line = next((line for line in lines if line.startswith(f"not loaded: {name} ({package}): ")), None)
        assert line is not None and message in line, (name, result.output)
    assert re.search(r"^lightxml\s+xmcbench\s+0\.1\.0\s+xmcbench_register_components\s+encoder 'transformer-cls'",
                     result.output, re.MULTILINE), result.output
    assert "xmcbench_register_datasets" in result.output


def test_commands_that_do_not_need_a_broken_plugin_still_work(monkeypatch):
    install(monkeypatch, *ALL_BROKEN)
    result = cli.invoke(app, ["config", "lightxml"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["method"] == "lightxml"
    missing = cli.invoke(app, ["config", "half-registered"])
    assert isinstance(missing.exception, XmcError)
    assert re.search(r"plugins that failed to load: .*bad-name.*unimportable", str(missing.exception))


# -- environment variables -----------------------------------------------------------------------------

def test_disabling_autoload_loads_no_entry_point(monkeypatch):
    monkeypatch.setenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = build_registry()
    assert registry.plugins == [] and registry.methods == {} and registry.failed == []
    assert "lightxml" in [name for name, _ in registry.skipped]
    with pytest.raises(XmcError, match="autoloading is off .*XMCBENCH_PLUGINS=lightxml"):
        registry.method("lightxml")
    result = cli.invoke(app, ["plugins"])
    assert result.exit_code == 0
    assert "no plugin loaded" in result.output
    assert "not loaded (XMCBENCH_DISABLE_PLUGIN_AUTOLOAD is set): lightxml (xmcbench 0.1.0)" in result.output


def test_named_plugins_load_with_autoload_disabled(monkeypatch):
    install(monkeypatch, IMPORT_ERROR)
    monkeypatch.setenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", "true")
    monkeypatch.setenv("XMCBENCH_PLUGINS", " lightxml , ")
    registry = build_registry()
    assert [p.name for p in registry.plugins] == ["lightxml"] and "lightxml" in registry.methods
    assert registry.failed == []   # the broken plugin is not named, so it is not even imported
    assert "unimportable" in [name for name, _ in registry.skipped]
    assert cli.invoke(app, ["config", "lightxml", "--dataset", "wiki500k"]).exit_code == 0   # a preset: no data read


def test_in_process_plugins_load_with_autoload_disabled(monkeypatch):
    monkeypatch.setenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    good = plugin("good", xmcbench_register_components=components(("recaller", "good-recaller", recaller_factory)))
    registry = build_registry(extra_plugins=[("good", good)])
    assert [p.name for p in registry.plugins] == ["good"]


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_falsy_values_keep_autoload_on(monkeypatch, value):
    monkeypatch.setenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", value)
    assert "lightxml" in [p.name for p in build_registry().plugins]


def test_a_named_plugin_that_is_not_installed_is_reported(monkeypatch):
    monkeypatch.setenv("XMCBENCH_PLUGINS", "lightxm")
    registry = build_registry()
    assert [(f.name, f.package) for f in registry.failed] == [("lightxm", "<not installed>")]
    assert ("XMCBENCH_PLUGINS names 'lightxm', but no installed package has an entry point of that name in the "
            "'xmcbench' group: did you mean 'lightxml'?") in registry.failed[0].error
    assert "lightxml" in [p.name for p in registry.plugins]
    result = cli.invoke(app, ["plugins"])
    assert "not loaded: lightxm (<not installed>): XMCBENCH_PLUGINS names 'lightxm'" in result.output


def test_no_entry_points_at_all():
    registry = build_registry(load_entry_points=False)
    assert registry.plugins == [] and registry.skipped == [] and registry.failed == []


# -- the hooks are documented --------------------------------------------------------------------------

def declared_hooks() -> list[str]:
    return [name for name, value in vars(hookspecs).items()
            if inspect.isfunction(value) and hasattr(value, hookspecs.PROJECT_NAME + "_spec")]


def test_every_hook_is_run_by_the_registry():
    assert declared_hooks() and list(HOOK_NAMES) == declared_hooks()


@pytest.mark.parametrize("hook", declared_hooks())
def test_every_hook_has_a_docstring_and_a_section_in_contributing(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert len(doc.split()) >= 8, f"{hook} in xmcbench/hookspecs.py needs a docstring"
    headings = [line for line in CONTRIBUTING.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    assert any(f"`{hook}" in line for line in headings), f"CONTRIBUTING.md needs a section on {hook}"
