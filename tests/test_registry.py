import hashlib
import importlib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from xmcbench.config import MethodSpec, Option
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import COMPONENT_KINDS, RejectedName, Registry, build_registry, code_record, \
    new_plugin_manager
from xmcbench.formats import open_dataset
from xmcbench.runs.component import check_components
from xmcbench.runs.plan import plan_run
from xmcbench.runs.splits import split_train_rows
from xmcbench.scoring import propensities


def install_plugin(site: Path, package: str, plugin_code: str, version: str = "1.0", editable: bool = False) -> Path:
    """A plugin distribution laid out as pip leaves one in site-packages: the package `package` (plugin.py holding
    `plugin_code`) and `<package>-<version>.dist-info` with METADATA, an `xmcbench` entry point named like the
    package and a RECORD listing the package's files; editable: direct_url.json says so, as `pip install -e`
    writes it. With `site` on sys.path (or PYTHONPATH), build_registry() loads it like any installed plugin.
    Returns the package folder."""
    folder = site / package
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    (folder / "plugin.py").write_text(plugin_code)
    dist_info = site / f"{package}-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[xmcbench]\n{package} = {package}.plugin\n")
    files = [f"{package}/__init__.py", f"{package}/plugin.py", f"{dist_info.name}/METADATA",
             f"{dist_info.name}/entry_points.txt", f"{dist_info.name}/RECORD"]
    (dist_info / "RECORD").write_text("".join(f"{name},,\n" for name in files))
    if editable:
        (dist_info / "direct_url.json").write_text(json.dumps({"url": folder.as_uri(), "dir_info": {"editable": True}}))
    importlib.invalidate_caches()
    return folder


def plugin_registering(component_name: str, method_name: str | None = None):
    module = types.ModuleType(f"plugin_{component_name}")

    @hookimpl
    def xmcbench_register_components(registry):
        registry.add_component("recaller", component_name, lambda config, in_dim, num_clusters: None)

    @hookimpl
    def xmcbench_register_methods(registry):
        if method_name:
            registry.add_method(MethodSpec(method_name, "test method"))

    module.xmcbench_register_components = xmcbench_register_components
    module.xmcbench_register_methods = xmcbench_register_methods
    return module


def test_builtin_plugin_registers_through_the_entry_point():
    registry = build_registry()
    builtin = next(p for p in registry.plugins if p.name == "lightxml")
    assert builtin.package == "xmcbench"
    for kind in COMPONENT_KINDS:
        assert registry.components[kind], kind
    assert "lightxml" in registry.methods
    assert {"debian-debtags-mini", "debian-debtags", "debian-builddeps", "eurlex4k", "wiki10-31k",
            "amazoncat13k", "wiki500k", "amazon670k"} <= set(registry.datasets)


def test_duplicate_names_are_rejected_with_both_origins():
    registry, manager = Registry(), new_plugin_manager()
    registry.register_plugin(manager, plugin_registering("same"), "first", "pkg-a", "1.0")
    registry.register_plugin(manager, plugin_registering("same", "second-method"), "second", "pkg-b", "2.0")
    assert registry.failed == [RejectedName(
        "second", "pkg-b 2.0", "recaller 'same' is registered twice: by first (pkg-a 1.0) and by second (pkg-b 2.0); "
        "second's 'same' was not loaded (the rest of second was); uninstall or rename one of them")]
    assert registry.components["recaller"]["same"].origin == "first (pkg-a 1.0)"
    assert registry.methods["second-method"].origin == "second (pkg-b 2.0)"
    assert registry.failures_of("first") == [] and registry.failures_of("second") == registry.failed
    with pytest.raises(XmcError, match="recaller 'same' is registered twice: by first .* and by <in-process>"):
        registry.add_component("recaller", "same", lambda config, in_dim, num_clusters: None)   # outside a plugin


def test_in_process_plugins_register_beside_the_builtins():
    registry = build_registry(extra_plugins=[("extra", plugin_registering("my-recaller", "my-method"))])
    assert "my-recaller" in registry.components["recaller"]
    assert registry.methods["my-method"].origin.startswith("extra")


def test_a_clashing_components_options_do_not_replace_the_first_ones_and_a_failed_plugins_go():
    from xmcbench.config import Option

    option = Option("clash_width", int, 3, "a width")

    def registering(*, fail: bool):
        def xmcbench_register_components(registry):
            registry.add_component("encoder", "transformer-cls", lambda config: None, options=(option,))
            registry.add_component("recaller", "mine", lambda config, in_dim, num_clusters: None, options=(option,))
            if fail:
                raise RuntimeError("after registering")
        return types.SimpleNamespace(xmcbench_register_components=xmcbench_register_components)

    before = build_registry().component_options
    registry = build_registry(extra_plugins=[("clashing", registering(fail=False))])
    assert registry.component_options[("encoder", "transformer-cls")] == before[("encoder", "transformer-cls")]
    assert option not in before[("encoder", "transformer-cls")]
    assert registry.component_options[("recaller", "mine")] == (option,)
    registry = build_registry(extra_plugins=[("failing", registering(fail=True))])
    assert registry.component_options == before and "mine" not in registry.components["recaller"]


# -- plugins that are not modules: any object with hook functions, marked with @hookimpl or not ------------

def add_method_named(name: str):
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec(name, "test method"))
    return xmcbench_register_methods


class PlainPlugin:
    """A plain class: its instances' hook methods carry no @hookimpl."""

    def __init__(self, name: str) -> None:
        self.name = name

    def xmcbench_register_components(self, registry):
        registry.add_component("recaller", f"{self.name}-recaller", lambda config, in_dim, num_clusters: None)

    def xmcbench_register_methods(self, registry):
        registry.add_method(MethodSpec(self.name, "test method", defaults={"recaller": f"{self.name}-recaller"}))

    def helper(self):   # not a hook
        raise AssertionError("never called")


class MarkedPlugin:
    @hookimpl
    def xmcbench_register_methods(self, registry):
        registry.add_method(MethodSpec("marked-instance", "test method"))


@pytest.mark.parametrize("make", [
    lambda: types.SimpleNamespace(xmcbench_register_methods=add_method_named("namespace")),
    lambda: types.SimpleNamespace(xmcbench_register_methods=hookimpl(add_method_named("namespace"))),
    lambda: types.SimpleNamespace(xmcbench_register_methods=lambda registry: registry.add_method(
        MethodSpec("namespace", "a lambda"))),
], ids=["plain-function", "marked-function", "lambda"])
def test_a_simple_namespace_with_hook_functions_is_a_plugin(make):
    registry = build_registry(extra_plugins=[("ns", make())], load_entry_points=False)
    assert registry.failed == []
    assert registry.methods["namespace"].origin == "ns (<in-process>)"
    assert [(p.name, p.hooks) for p in registry.plugins] == [("ns", ["xmcbench_register_methods"])]


def test_a_plain_class_instance_is_a_plugin():
    registry = build_registry(extra_plugins=[("one", PlainPlugin("one")), ("two", PlainPlugin("two")),
                                             ("marked", MarkedPlugin())])
    assert registry.failed == []
    assert registry.method("one").defaults["recaller"] == "one-recaller" and "two-recaller" in \
        registry.components["recaller"]
    assert "marked-instance" in registry.methods and "lightxml" in registry.methods
    assert next(p for p in registry.plugins if p.name == "one").hooks == ["xmcbench_register_components",
                                                                         "xmcbench_register_methods"]


def test_a_module_still_needs_hookimpl_as_its_entry_point_would():
    module = types.ModuleType("unmarked_module")
    module.xmcbench_register_methods = add_method_named("unmarked")
    registry = build_registry(extra_plugins=[("unmarked", module)], load_entry_points=False)
    assert "defines xmcbench_register_methods without @hookimpl" in registry.failed[0].error


@pytest.mark.parametrize("namespace, message", [
    (types.SimpleNamespace(xmcbench_register_method=add_method_named("x")),
     "plugin 'ns' implements unknown hook 'xmcbench_register_method': did you mean 'xmcbench_register_methods'"),
    (types.SimpleNamespace(xmcbench_register_methods=lambda reg, other: None),
     "plugin 'ns': hook xmcbench_register_methods takes argument(s) reg, other, which the hookspec does not pass"),
    (types.SimpleNamespace(helper=print), "plugin 'ns' implements no xmcbench hook"),
], ids=["misspelled", "wrong-arguments", "no-hooks"])
def test_an_object_plugin_is_checked_like_a_module(namespace, message):
    registry = build_registry(extra_plugins=[("ns", namespace)], load_entry_points=False)
    assert [f.name for f in registry.failed] == ["ns"] and message in registry.failed[0].error
    assert registry.plugins == [] and registry.methods == {}


def test_an_object_plugins_hook_that_raises_says_where():
    class Raising:
        def xmcbench_register_methods(self, registry):
            raise KeyError("x")

    registry = build_registry(extra_plugins=[("raising", Raising())], load_entry_points=False)
    line = Raising.xmcbench_register_methods.__code__.co_firstlineno + 1
    assert registry.failed[0].error.startswith("plugin raising (<in-process>): hook xmcbench_register_methods raised "
                                               "KeyError: 'x' (at ")
    assert registry.failed[0].error.endswith(f"test_registry.py:{line} in xmcbench_register_methods)")


def test_unknown_names_suggest_the_closest():
    registry = build_registry()
    with pytest.raises(XmcError, match="did you mean 'lightxml'"):
        registry.method("lightxm")
    with pytest.raises(XmcError, match="did you mean 'wiki500k'"):
        registry.dataset("wiki-500k")
    with pytest.raises(XmcError, match="unknown sampler 'dynamc'.*'dynamic'"):
        registry.component("sampler", "dynamc")


def test_bad_registrations_are_rejected():
    registry = Registry()
    with pytest.raises(XmcError, match="unknown kind"):
        registry.add_component("scorer", "x", lambda config: None)
    with pytest.raises(XmcError, match="not a MethodSpec"):
        registry.add_method({"name": "x"})


def test_importing_the_package_loads_no_plugin():
    code = ("import sys, xmcbench.cli, xmcbench.registry, xmcbench.runs.launch, xmcbench.saved; "
            "print('xmcbench_lightxml.plugin' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# -- installed plugins -----------------------------------------------------------------------------------------

@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path to install plugins into (install_plugin); only the plugins named in XMCBENCH_PLUGINS
    load. Modules imported from it are forgotten afterwards."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("XMCBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    yield folder
    for name in [name for name, module in sys.modules.items()
                 if str(getattr(module, "__file__", None) or "").startswith(str(folder))]:
        del sys.modules[name]


def unique_package(folder: Path) -> str:
    """A package name no other test imports (modules stay in sys.modules for the session)."""
    return "xmcb_test_" + hashlib.sha256(str(folder).encode()).hexdigest()[:10]


# -- which code a registration is: the plugin, its distribution, and its version or source ------------------

INSTALLED_PLUGIN = '''
from xmcbench.config import MethodSpec
from xmcbench.hookspecs import hookimpl


@hookimpl
def xmcbench_register_methods(registry):
    registry.add_method(MethodSpec("installed-method", "a method of an installed plugin"))
'''


def test_a_released_plugin_is_identified_by_its_version_an_editable_one_by_its_source(site, monkeypatch):
    package = unique_package(site)
    monkeypatch.setenv("XMCBENCH_PLUGINS", package)
    folder = install_plugin(site, package, INSTALLED_PLUGIN, version="1.0")
    registry = build_registry()
    entry = registry.methods["installed-method"]
    assert entry.plugin.name == package and entry.plugin.released
    assert code_record(entry) == {"plugin": package, "distribution": package, "version": "1.0"}

    install_plugin(site, package, INSTALLED_PLUGIN, version="1.0", editable=True)   # pip install -e
    editable = code_record(build_registry().methods["installed-method"])
    assert set(editable) == {"plugin", "distribution", "version", "source_sha256"}
    (folder / "plugin.py").write_text(INSTALLED_PLUGIN + "# a comment changes the code\n")
    changed = code_record(build_registry().methods["installed-method"])["source_sha256"]
    assert changed != editable["source_sha256"]
    (folder / "__pycache__").mkdir(exist_ok=True)   # what is not Python source does not count
    (folder / "notes.txt").write_text("not source")
    (folder / "__pycache__" / "plugin.cpython-311.pyc").write_bytes(b"compiled")
    assert code_record(build_registry().methods["installed-method"])["source_sha256"] == changed


def test_development_and_in_process_plugins_are_identified_by_their_source():
    registry = build_registry(extra_plugins=[("extra", plugin_registering("my-recaller", "my-method"))])
    # xmcbench's own plugins in this checkout: an editable install or a source tree (.egg-info)
    lightxml = code_record(registry.methods["lightxml"])
    assert lightxml["plugin"] == "lightxml" and lightxml["distribution"] == "xmcbench" and "source_sha256" in lightxml
    extra = code_record(registry.methods["my-method"])   # its hooks are in this file
    assert extra["distribution"] == "<in-process>" and len(extra["source_sha256"]) == 64
    assert registry.methods["my-method"].plugin.source == (str(Path(__file__).resolve()),)


# -- a component's check and conformance options ----------------------------------------------------------

def recaller_factory(config, in_dim, num_clusters):
    from xmcbench_lightxml.recaller import build_cluster_linear

    return build_cluster_linear(config, in_dim, num_clusters)


def test_a_check_or_conformance_options_that_cannot_work_are_refused_when_registered():
    scale = Option("scale", float, None, "a scale", required=True)
    registry = Registry()
    with pytest.raises(XmcError, match="registers recaller 'r' with a check that is not callable"):
        registry.add_component("recaller", "r", recaller_factory, check="always")
    with pytest.raises(XmcError, match="conformance_options that are not a dict"):
        registry.add_component("recaller", "r", recaller_factory, options=(scale,), conformance_options=[("scale", 1)])
    with pytest.raises(XmcError, match="conformance_options for 'scal', which it does not declare: did you mean "
                                       "'scale'"):
        registry.add_component("recaller", "r", recaller_factory, options=(scale,), conformance_options={"scal": 1})
    registry.add_component("recaller", "r", recaller_factory, options=(scale,), check=print,
                           conformance_options={"scale": 2})
    assert registry.component_checks[("recaller", "r")] is print
    assert registry.conformance_options[("recaller", "r")] == {"scale": 2}


def test_a_failed_plugins_checks_and_conformance_options_go_with_it():
    def xmcbench_register_components(registry):
        registry.add_component("recaller", "checked", recaller_factory, check=print,
                               options=(Option("scale", float, 1.0, "a scale"),), conformance_options={"scale": 2})
        raise RuntimeError("after registering")

    registry = build_registry(extra_plugins=[("failing", types.SimpleNamespace(
        xmcbench_register_components=xmcbench_register_components))], load_entry_points=False)
    assert registry.failures_of("failing") and not registry.component_checks and not registry.conformance_options


def test_a_components_check_gets_the_runs_settings_and_labels(tiny_dataset, tiny_model_dir):

    seen = []

    def xmcbench_register_components(registry):
        registry.add_component("recaller", "watching", recaller_factory,
                               check=lambda config, label_info: seen.append(("recaller", config, label_info)))
        registry.add_component("ranker", "watching", lambda config, in_dim, num_labels: None,
                               check=lambda config, label_info: seen.append(("ranker", config, label_info)))

    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("watched", "checks what it is given", defaults={
            "encoder": "transformer-cls", "recaller": "watching", "ranker": "watching", "sampler": "dynamic"}))

    registry = build_registry(extra_plugins=[("watching", types.SimpleNamespace(
        xmcbench_register_components=xmcbench_register_components,
        xmcbench_register_methods=xmcbench_register_methods))])
    dataset = open_dataset(registry, str(tiny_dataset))
    settings = [f"model_name={tiny_model_dir}", "validation_size=8", "max_train_docs=40"]
    flat = plan_run(registry, "watched", str(tiny_dataset), set_options=settings)
    check_components(registry, flat, dataset)
    assert [kind for kind, _, _ in seen] == ["recaller"]   # a flat run uses no ranker, so it is not asked
    config, info = seen[0][1:]
    assert config is flat.config
    train_rows = split_train_rows(dataset, config)[0]
    num_labels = dataset.num_labels
    assert len(train_rows) == 32 and info.names == tuple(dataset.label_names[:num_labels]) and info.texts is None
    assert info.counts.tolist() == np.asarray(dataset.train_labels[train_rows].sum(axis=0)).ravel()[:num_labels].tolist()
    assert np.array_equal(info.inverse_propensities, propensities(dataset, config).inverse[:num_labels])

    seen.clear()
    check_components(registry, plan_run(registry, "watched", str(tiny_dataset),
                                                      set_options=settings + ["cluster_size=2"]), dataset)
    assert [kind for kind, _, _ in seen] == ["recaller", "ranker"]
