import pytest

from xmcbench.config import MethodSpec, TrainConfig, apply_overrides, parse_set_options, resolve_config
from xmcbench.errors import XmcError

METHOD = MethodSpec("m", "test", defaults={"epochs": 3, "lr": 2e-4}, presets={"ds": {"epochs": 7, "batch_size": 4}})


def test_resolution_order_defaults_method_preset_file_set(tmp_path):
    config_file = tmp_path / "settings.toml"
    config_file.write_text("batch_size = 8\nhidden_size = 64\n")
    config = resolve_config(METHOD, "ds", config_file, ["hidden_size=128", "options.kernel=3"])
    assert config.lr == 2e-4                  # method default
    assert config.epochs == 7                 # preset beats method default
    assert config.batch_size == 8             # file beats preset
    assert config.hidden_size == 128          # --set beats file
    assert config.options == {"kernel": "3"}
    assert resolve_config(METHOD, "other").epochs == 3


def test_values_are_typed():
    config = apply_overrides(TrainConfig(), parse_set_options(["swa=false", "lr=3e-5", "epochs=2"]), "--set")
    assert config.swa is False and config.lr == 3e-5 and config.epochs == 2


@pytest.mark.parametrize("pairs, message", [
    (["epoch=2"], "unknown setting 'epoch': did you mean 'epochs'"),
    (["swa=maybe"], "swa must be bool"),
    (["lr=fast"], "lr must be float"),
    (["epochs"], "--set expects key=value"),
])
def test_bad_settings_end_in_one_line(pairs, message):
    with pytest.raises(XmcError, match=message) as caught:
        resolve_config(METHOD, "ds", None, pairs)
    assert "\n" not in str(caught.value)


def test_bad_config_file(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("epochs = \n")
    with pytest.raises(XmcError, match="not valid TOML"):
        resolve_config(METHOD, "ds", broken)
    with pytest.raises(XmcError, match="cannot read config file"):
        resolve_config(METHOD, "ds", tmp_path / "missing.toml")


def test_round_trip_through_a_dict():
    config = TrainConfig(epochs=9, options={"a": 1})
    assert TrainConfig.from_dict(config.to_dict()) == config
