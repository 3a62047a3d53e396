"""Config loading: defaults < YAML < key=value, and one-line errors for mistakes."""

import pytest

from ddplab.config import Config, dist_overrides, load_config, split_overrides
from ddplab.errors import ConfigError


def test_overrides_are_typed_and_win_over_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\ntrainer:\n  max_steps: 7\n  log_every: 2\n")
    cfg = load_config(Config, ["trainer.max_steps=9", "dist.timeout_s=5"], str(path))
    assert (cfg.seed, cfg.trainer.max_steps, cfg.trainer.log_every, cfg.dist.timeout_s) == (3, 9, 2, 5.0)
    assert isinstance(cfg.dist.timeout_s, float)


def test_unknown_key_names_the_closest_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.max_step'; did you mean trainer.max_steps"):
        load_config(Config, ["trainer.max_step=5"])


def test_unknown_key_in_yaml_is_caught_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dist:\n  backnd: gloo\n")
    with pytest.raises(ConfigError, match="dist.backnd.*dist.backend"):
        load_config(Config, [], str(path))


@pytest.mark.parametrize("override,words", [
    ("trainer.max_steps=abc", "an integer"),
    ("dist.timeout_s=soon", "a number"),
    ("trainer.progress=maybe", "true or false"),
])
def test_wrong_type_names_the_key_and_expected_type(override, words):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"'{key}' expects {words}"):
        load_config(Config, [override])


def test_group_given_a_value_is_rejected():
    with pytest.raises(ConfigError, match="group of keys"):
        load_config(Config, ["trainer=3"])


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Config, [], "/nonexistent/config.yaml")


def test_split_overrides_keeps_flags_and_arguments_apart():
    assert split_overrides(["a.b=1", "--lr", "0.1", "x=y=z", "-n=2"]) == (["a.b=1", "x=y=z"], ["--lr", "0.1", "-n=2"])


def test_dist_overrides_ignore_other_groups():
    d = dist_overrides(["dist.rank=1", "dist.world_size=2", "model.width=3"])
    assert (d.rank, d.world_size) == (1, 2)
