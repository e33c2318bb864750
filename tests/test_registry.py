import subprocess
import sys
import types

import pytest

from xmcbench.config import MethodSpec
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import COMPONENT_KINDS, Registry, build_registry, new_plugin_manager


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
    with pytest.raises(XmcError) as caught:
        registry.register_plugin(manager, plugin_registering("same"), "second", "pkg-b", "2.0")
    assert "first (pkg-a 1.0)" in str(caught.value) and "second (pkg-b 2.0)" in str(caught.value)


def test_in_process_plugins_register_beside_the_builtins():
    registry = build_registry(extra_plugins=[("extra", plugin_registering("my-recaller", "my-method"))])
    assert "my-recaller" in registry.components["recaller"]
    assert registry.methods["my-method"].origin.startswith("extra")


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
