"""Options a component or method declares (xmcbench.config.Option) are checked like core settings: a typo gets
"did you mean", a bad value one line, before anything runs; `xmcbench plugins --options` lists them."""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from tests.test_bad_input import assert_one_line_error, xmcbench
from tests.test_registry import install_plugin, site, unique_package  # noqa: F401  (site: a fixture)
from xmcbench.cli import app
from xmcbench.config import MethodSpec, Option, TrainConfig, check_options
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import build_registry
from xmcbench.runs.plan import plan_run


def cosine_plugin():
    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("lightxml-cosine", "LightXML, scaled", defaults={"encoder": "transformer-cls",
                                       "recaller": "cluster-linear", "ranker": "bottleneck", "sampler": "dynamic"},
                                       options=(Option("cosine_scale", float, 10.0, "logit scale", minimum=0),
                                                Option("cosine_mode", str, "soft", "how", choices=("soft", "hard")))))
    return types.SimpleNamespace(xmcbench_register_methods=xmcbench_register_methods)


@pytest.fixture(scope="module")
def registry():
    return build_registry(extra_plugins=[("cosine", cosine_plugin())])


@pytest.mark.parametrize("setting, message", [
    ("options.cosin_scale=5", "unknown setting options.cosin_scale: did you mean options.cosine_scale "
                              "(method lightxml-cosine)?"),
    ("options.cosine_scale=abc", "options.cosine_scale must be float, got 'abc'"),
    ("options.cosine_scale=-1", "options.cosine_scale='-1' is out of range; it must be at least 0"),
    ("options.cosine_mode=medium", "options.cosine_mode='medium' is not one of soft, hard"),
    ("cosine_scale=5", "cosine_scale is an option of the method lightxml-cosine: --set options.cosine_scale=VALUE"),
])
def test_a_bad_option_is_refused_in_one_line_before_anything_runs(registry, tiny_dataset, setting, message):
    with pytest.raises(XmcError) as error:
        plan_run(registry, "lightxml-cosine", str(tiny_dataset), set_options=[setting])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_good_option_is_typed(registry, tiny_dataset):
    plan = plan_run(registry, "lightxml-cosine", str(tiny_dataset), set_options=["options.cosine_scale=5"])
    assert plan.config.options == {"cosine_scale": 5.0}


def test_xml_cnn_declares_its_options_and_the_cli_checks_them(tmp_path):
    assert_one_line_error(xmcbench("config", "xmlcnn", "--set", "options.xmlcnn_emb_dims=8"),
                          "did you mean options.xmlcnn_emb_dim (encoder xml-cnn)?")
    assert_one_line_error(xmcbench("config", "xmlcnn", "--set", "options.xmlcnn_filter_sizes=2,x"),
                          "options.xmlcnn_filter_sizes must be a list of positive integers")
    listed = CliRunner().invoke(app, ["plugins", "--options"])
    assert listed.exit_code == 0
    assert "encoder xml-cnn: options.xmlcnn_emb_dim (int, default 300, at least 1): E, word-embedding size" \
        in listed.output


def test_check_options_parses_lists_and_keeps_only_what_was_given():
    sizes = Option("sizes", tuple[int, ...], (2, 4), "widths", minimum=1, maximum=9)
    assert check_options({"sizes": "3,5"}, {"sizes": (sizes, "encoder e")}, "--set") == {"sizes": (3, 5)}
    assert check_options({}, {"sizes": (sizes, "encoder e")}, "--set") == {}
    with pytest.raises(XmcError, match="out of range"):
        check_options({"sizes": [3, 12]}, {"sizes": (sizes, "encoder e")}, "--set")


# -- required options and file paths ------------------------------------------------------------------------

def needy_plugin():
    options = (Option("label_file", "path", None, "one text per label, in label-id order", required=True),
               Option("temperature", float, 0.05, "softmax temperature", minimum=0))

    @hookimpl
    def xmcbench_register_components(registry):
        registry.add_component("ranker", "needy", lambda config, in_dim, num_labels: None, options=options)

    @hookimpl
    def xmcbench_register_methods(registry):
        registry.add_method(MethodSpec("lightxml-needy", "LightXML with a ranker that needs a file", defaults={
            "encoder": "transformer-cls", "recaller": "cluster-linear", "ranker": "needy", "sampler": "dynamic"}))
    return types.SimpleNamespace(xmcbench_register_components=xmcbench_register_components,
                                 xmcbench_register_methods=xmcbench_register_methods)


@pytest.fixture(scope="module")
def needy_registry():
    return build_registry(extra_plugins=[("needy", needy_plugin())])


def test_a_required_option_that_is_not_set_is_refused_while_planning(needy_registry, tiny_dataset):
    with pytest.raises(XmcError) as error:
        plan_run(needy_registry, "lightxml-needy", str(tiny_dataset))
    assert str(error.value) == ("ranker needy needs options.label_file (one text per label, in label-id order), which "
                                "has no default: add --set options.label_file=VALUE")


def test_a_path_option_is_checked_and_kept_as_its_absolute_path(needy_registry, tiny_dataset, tmp_path,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts.txt").write_text("a text\n")
    plan = plan_run(needy_registry, "lightxml-needy", str(tiny_dataset),
                           set_options=["options.label_file=texts.txt"])
    assert plan.config.options == {"label_file": str(tmp_path / "texts.txt")}
    for value, message in (("missing.txt", "--set / --config: options.label_file=missing.txt: no such file; give the "
                                           "path of an existing file"),
                           (".", "--set / --config: options.label_file=. is a folder; give the path of a file"),
                           ("", "--set / --config: options.label_file must be the path of a file, got ''")):
        with pytest.raises(XmcError) as error:
            plan_run(needy_registry, "lightxml-needy", str(tiny_dataset),
                            set_options=[f"options.label_file={value}"])
        assert str(error.value) == message


def test_an_option_of_an_unknown_kind_is_refused_and_a_required_one_has_no_default_to_read():
    with pytest.raises(ValueError, match="option 'label_file' has kind 'file'; a kind is bool, int, float, str, "
                                         "tuple\\[int, ...\\] or 'path'"):
        Option("label_file", "file", None, "texts")
    required = Option("label_file", "path", None, "texts", required=True)
    with pytest.raises(XmcError, match="needs options.label_file .*: add --set options.label_file=VALUE"):
        required.value_of(TrainConfig())


def test_plugins_lists_required_options_as_required(site, monkeypatch):  # noqa: F811
    package = unique_package(site)
    monkeypatch.setenv("XMCBENCH_PLUGINS", package)
    install_plugin(site, package, NEEDY_INSTALLED)
    listed = CliRunner().invoke(app, ["plugins", "--options"])
    assert listed.exit_code == 0, listed.output
    assert "ranker needy-installed: options.label_file (path of a file, required): one text per label" in listed.output
    assert "ranker needy-installed: options.temperature (float, default 0.05, at least 0): softmax temperature" \
        in listed.output


NEEDY_INSTALLED = '''
from xmcbench.config import Option
from xmcbench.hookspecs import hookimpl


@hookimpl
def xmcbench_register_components(registry):
    registry.add_component("ranker", "needy-installed", lambda config, in_dim, num_labels: None, options=(
        Option("label_file", "path", None, "one text per label", required=True),
        Option("temperature", float, 0.05, "softmax temperature", minimum=0)))
'''


def test_a_path_options_default_must_name_a_readable_file(tmp_path):
    shipped = tmp_path / "shipped.txt"
    declared = {"vocabulary": (Option("vocabulary", "path", str(shipped), "the words"), "encoder e")}
    with pytest.raises(XmcError) as error:
        check_options({}, declared, "--set")
    assert str(error.value) == (f"the default of encoder e: options.vocabulary={shipped}: no such file; give the path "
                                "of an existing file")
    shipped.write_text("word\n")
    assert check_options({}, declared, "--set") == {}
