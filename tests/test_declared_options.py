"""Options a component or method declares (xmcbench.config.Option) are checked like core settings: a typo gets
"did you mean", a bad value one line, before anything runs; `xmcbench plugins --options` lists them."""

from __future__ import annotations

import types

import pytest
from typer.testing import CliRunner

from tests.test_bad_input import assert_one_line_error, xmcbench
from xmcbench import runner
from xmcbench.cli import app
from xmcbench.config import MethodSpec, Option, check_options
from xmcbench.errors import XmcError
from xmcbench.hookspecs import hookimpl
from xmcbench.registry import build_registry


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
        runner.plan_run(registry, "lightxml-cosine", str(tiny_dataset), set_options=[setting])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_good_option_is_typed(registry, tiny_dataset):
    plan = runner.plan_run(registry, "lightxml-cosine", str(tiny_dataset), set_options=["options.cosine_scale=5"])
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
