"""A factory registered as "module:attribute" is imported when a run uses it, not when its plugin loads: loading
every installed plugin imports neither torch nor scikit-learn, so `xmcbench plugins` and `datasets` answer fast."""

import subprocess
import sys
import types

import pytest

from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.interfaces import call_factory, declared_keywords
from xmcbench.registry import LazyFactory, build_registry

MODULE = "tests_lazy_target_module"   # made up in sys.modules by the fixture: its import is what the tests watch


@pytest.fixture
def target(monkeypatch):
    """A module whose import is recorded, holding a factory with a keyword-only parameter."""
    imported = []

    def build(config, in_dim, num_labels, *, label_info=None):
        return ("built", in_dim, num_labels, label_info)

    class Finder:   # imports MODULE on request, as if it were installed
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != MODULE:
                return None
            import importlib.machinery

            class Loader:
                @staticmethod
                def create_module(spec):
                    return types.ModuleType(MODULE)

                @staticmethod
                def exec_module(module):
                    imported.append(MODULE)
                    module.build = build
                    module.not_callable = 42

            return importlib.machinery.ModuleSpec(MODULE, Loader())

    monkeypatch.setattr(sys, "meta_path", [Finder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return imported, build


def registry_with(factory, check=None):
    plugin = types.ModuleType("lazy")
    plugin.xmcbench_register_components = hookimpl(
        lambda registry: registry.add_component("ranker", "lazy", factory, check=check))
    return build_registry(extra_plugins=[("lazy", plugin)], load_entry_points=False)


def test_a_named_factory_is_imported_on_first_use_with_its_signature(target):
    imported, build = target
    registry = registry_with(f"{MODULE}:build")
    stored = registry.components["ranker"]["lazy"].value
    assert isinstance(stored, LazyFactory) and imported == []          # registering imported nothing
    assert (stored.__module__, stored.__qualname__) == (MODULE, "build")
    assert declared_keywords(stored) == {"label_info"} and imported == [MODULE]   # its signature is the factory's
    assert call_factory(stored, None, 8, 5, label_info="info", encoder="not declared") == ("built", 8, 5, "info")
    assert registry.component("ranker", "lazy") is build   # a lookup gives the plugin's own object


@pytest.mark.parametrize("name, error", [(f"{MODULE}:missing", "AttributeError"),
                                         ("tests_no_such_module_anywhere:build", "ModuleNotFoundError"),
                                         (f"{MODULE}:not_callable", "is not callable")])
def test_a_named_factory_that_cannot_be_imported_is_one_line_naming_the_plugin(target, name, error):
    registry = registry_with(name)
    assert registry.failed == []   # the plugin loads: the name is only checked when a run needs it
    with pytest.raises(XmcError) as raised:
        registry.component("ranker", "lazy")
    message = str(raised.value)
    assert "\n" not in message and "ranker 'lazy' of plugin lazy" in message and error in message


def test_a_check_may_be_named_too(target):
    imported, _ = target
    registry = registry_with(f"{MODULE}:build", check=f"{MODULE}:build")
    assert isinstance(registry.component_checks[("ranker", "lazy")], LazyFactory) and imported == []


def test_something_neither_callable_nor_a_name_is_refused_at_registration():
    registry = registry_with("not a module path")
    assert registry.failed and "with a factory that is not callable: 'not a module path'; give a callable, or " \
        "\"module:attribute\" naming one" in registry.failed[0].error


def test_loading_every_installed_plugin_imports_neither_torch_nor_scikit_learn():
    code = ("import sys; from xmcbench.registry import build_registry; registry = build_registry(); "
            "assert not registry.failed, registry.failed; "
            "print(sorted(m for m in ('torch', 'sklearn', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
