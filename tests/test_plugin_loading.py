"""Plugin loading fails safe: a throwaway plugin broken in each documented way is reported with its package
and a one-line error, leaves nothing registered, and never breaks commands that do not need it. Plus the
environment variables that control autoloading, and the hook documentation."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import re
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xmcbench import hookspecs
from xmcbench.cli import app
from xmcbench.config import MethodSpec
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import HOOK_NAMES, build_registry

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


# (plugin name, plugin module, what registry.failed must say). Every plugin also registers a recaller of
# its own first where it can, to show that its partial registrations are rolled back.
BROKEN = [
    ("duplicate", plugin("duplicate", xmcbench_register_components=components(
        ("recaller", "duplicate-own", recaller_factory), ("encoder", "transformer-cls", recaller_factory))),
     "encoder 'transformer-cls' is registered twice: by lightxml (xmcbench 0.1.0) and by duplicate "
     "(broken-duplicate 9.9); uninstall or rename one of them"),
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
    ("no-hooks", plugin("no-hooks", helper=lambda: None),
     "plugin 'no-hooks' implements no xmcbench hook (is its entry point the module with the @hookimpl functions?"),
]


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
    assert "half-registered" not in registry.methods


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
    install(monkeypatch, *ALL_BROKEN)
    registry = build_registry()
    assert {f.name: (f.package, f.error) for f in registry.failed}.keys() == EXPECTED.keys()
    for failed in registry.failed:
        package, message = EXPECTED[failed.name]
        assert failed.package == package and message in failed.error and "\n" not in failed.error, failed
    assert_unharmed(registry)


def test_a_third_party_clash_is_blamed_on_the_third_party_whatever_its_name(monkeypatch):
    early = plugin("aaa", xmcbench_register_components=components(("sampler", "dynamic", recaller_factory)))
    install(monkeypatch, FakeEntryPoint("aaa", early))   # sorts before lightxml, still loads after it
    registry = build_registry()
    assert [f.name for f in registry.failed] == ["aaa"]
    assert "sampler 'dynamic' is registered twice: by lightxml (xmcbench 0.1.0) and by aaa" in registry.failed[0].error
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
    registry = build_registry(extra_plugins=[("raiser", BROKEN[1][1]), ("good", good)])
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
    assert re.search(r"plugins that failed to load: .*duplicate.*unimportable", str(missing.exception))


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
    assert cli.invoke(app, ["config", "lightxml"]).exit_code == 0


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
