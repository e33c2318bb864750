import subprocess
import sys
import types

import pytest

from xmcbench.config import MethodSpec
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import COMPONENT_KINDS, RejectedName, Registry, build_registry, new_plugin_manager


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
    assert registry.component_options[("encoder", "transformer-cls")] == before[("encoder", "transformer-cls")] == ()
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
    code = ("import sys, xmcbench.cli, xmcbench.registry, xmcbench.runner; "
            "print('xmcbench_lightxml.plugin' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
