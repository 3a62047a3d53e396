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
    with pytest.raises(ConfigError, match=r"dist.backnd.*dist.backend"):
        load_config(Config, [], str(path))


@pytest.mark.parametrize(
    "override,words",
    [
        ("trainer.max_steps=abc", "an integer"),
        ("dist.timeout_s=soon", "a number"),
        ("trainer.progress=maybe", "true or false"),
    ],
)
def test_wrong_type_names_the_key_and_expected_type(override, words):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}' expects {words}"):
        load_config(Config, [override])


def test_group_given_a_value_is_rejected():
    with pytest.raises(ConfigError, match=r"group of keys"):
        load_config(Config, ["trainer=3"])


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(Config, [], "/nonexistent/config.yaml")


def test_split_overrides_keeps_flags_and_arguments_apart():
    assert split_overrides(["a.b=1", "--lr", "0.1", "x=y=z", "-n=2"]) == (["a.b=1", "x=y=z"], ["--lr", "0.1", "-n=2"])


def test_dist_overrides_ignore_other_groups():
    d = dist_overrides(["dist.rank=1", "dist.world_size=2", "model.width=3"])
    assert (d.rank, d.world_size) == (1, 2)


def _documented_defaults() -> dict:
    """The defaults table of docs/experiments.md, the settings' user-facing specification."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text()
    table = text[text.index("| key | default | meaning |") :].split("\n\n")[0]
    words = {"true": True, "false": False, "unset": None, "start time": None, '""': ""}
    out = {}
    for row in table.splitlines()[2:]:
        keys, defaults = (cell.strip() for cell in row.split("|")[1:3])
        keys = re.findall(r"`([a-z_.]+)`", keys)
        values = [v.strip().strip("`").removesuffix(" (off)") for v in re.split(r" / |, ", defaults)]
        assert len(keys) == len(values), row
        for key, value in zip(keys, values, strict=True):
            out[key] = words[value] if value in words else (float(value) if value.replace(".", "").isdigit() else value)
    return out


def test_every_default_is_the_one_the_docs_give():
    from omegaconf import OmegaConf

    from ddplab.config import _field_types

    documented, defaults = _documented_defaults(), OmegaConf.structured(Config)
    assert sorted(documented) == sorted(_field_types(Config)), "every setting has a row in docs/experiments.md"
    for key, value in documented.items():
        # a text setting whose words include true/false or numbers (trainer.accumulate: 1 or auto): as text
        actual = OmegaConf.select(defaults, key)
        if isinstance(actual, str) and isinstance(value, float):
            value = f"{value:g}"
        assert actual == (str(value).lower() if isinstance(actual, str) and isinstance(value, bool) else value), key


def test_override_values_may_hold_equals_signs_and_be_empty():
    cfg = load_config(Config, ["run.name=a=b", "checkpoint.preempt_signals=", "dist.init_method=file:///tmp/x=1"])
    assert (cfg.run.name, cfg.checkpoint.preempt_signals, cfg.dist.init_method) == ("a=b", "", "file:///tmp/x=1")


def test_messages_name_the_closest_keys_the_range_and_the_meaning():
    with pytest.raises(ConfigError) as e:
        load_config(Config, ["trainer.max_step=5"])
    assert str(e.value) == (
        "unknown config key 'trainer.max_step'; did you mean trainer.max_steps or "
        # as docs/reliability.md shows it
        "trainer.max_epochs or trainer.ema_decay?"
    )
    with pytest.raises(
        ConfigError,
        match=r"'dist.master_port' is 65536, but it must be an integer >= 1 and <= 65535 "
        r"\(the key's meaning: port of rank 0's rendezvous store\)",
    ):
        load_config(Config, ["dist.master_port=65536"])
    with pytest.raises(ConfigError, match=r"'dist.timeout_s' is 0.0, but it must be a number > 0 \(the key's meaning"):
        load_config(Config, ["dist.timeout_s=0"])
    with pytest.raises(
        ConfigError,
        match=r"'seed' is 9223372036854775808, but it must be an integer >= 0 and "
        r"<= 9223372036854775807",
    ):
        load_config(Config, ["seed=9223372036854775808"])
    with pytest.raises(ConfigError, match=r"set one of its keys, e.g. trainer.accumulate=\.\.\."):
        load_config(Config, ["trainer=5"])
    with pytest.raises(ConfigError, match=r"config key 'dist.rank' expects an integer, got 'abc'"):
        # an Optional[int]
        load_config(Config, ["dist.rank=abc"])


def test_the_edges_of_each_range_are_allowed():
    cfg = load_config(
        Config,
        [
            "dist.master_port=65535",
            "seed=9223372036854775807",
            "trainer.max_steps=5",
            "trainer.max_epochs=0",
            "dist.timeout_s=0.5",
            "trainer.log_every=1",
        ],
    )
    assert (cfg.dist.master_port, cfg.seed, cfg.trainer.max_epochs) == (65535, 2**63 - 1, 0)
    assert load_config(Config, ["dist.static_graph=true", "trainer.accumulate=1"]).dist.static_graph
    # without static_graph
    # a whole number, or auto
    assert load_config(Config, ["trainer.accumulate=4"]).trainer.accumulate == 4


def test_an_override_that_does_not_parse_is_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(Config, ["trainer.max_steps=[1,"])
    assert "\n" not in str(e.value) and str(e.value).startswith("cannot parse overrides ['trainer.max_steps=[1,']")


def test_a_yaml_file_that_does_not_parse_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML \(.*\); fix its syntax"):
        load_config(Config, [], str(bad))


def test_the_config_is_saved_again_into_an_existing_folder(tmp_path):
    from ddplab.config import save_config

    for seed in (1, 2):
        save_config(load_config(Config, [f"seed={seed}"]), str(tmp_path / "run" / "config.yaml"))
    assert "seed: 2" in (tmp_path / "run" / "config.yaml").read_text()
