"""What the user typed is what they get (config_reading.py, config.py): a `str` setting keeps its text
from a YAML file and from key=value, where YAML 1.1 would make it a boolean, a base-60 or an octal
number; a number YAML would misread is refused; `Literal`s of any type, `Enum`s, required settings,
interpolations and files that hold no settings are one line each, naming the setting."""

import enum
from dataclasses import dataclass, field
from typing import Literal

import pytest

import ddplab
from ddplab.config import Config, describe, load_config
from ddplab.errors import ConfigError
from helpers import ddplab_here


class Colour(enum.Enum):
    red = 1
    blue = 2


@dataclass
class Extra:
    tag: str = ddplab.setting("x", "a label")
    label: str | None = ddplab.setting(None, "an optional label")
    width: Literal[1, 2, 4] = ddplab.setting(2, "a width")
    scale: Literal[0.5, 1.0] = ddplab.setting(1.0, "a scale")
    colour: Colour = ddplab.setting(Colour.red, "a colour")
    count: int = ddplab.setting(help="given on every run")


@dataclass
class Typed(Config):
    extra: Extra = field(default_factory=Extra)


def _load(*overrides: str, yaml: str | None = None, tmp_path=None):
    path = None
    if yaml is not None:
        path = tmp_path / "c.yaml"
        path.write_text(yaml)
    return load_config(Typed, ["extra.count=1", *overrides], None if path is None else str(path))


# YAML 1.1 reads each of these as something else: a boolean, a base-60 number, an octal, a float, null
TEXTS = ["1:30", "no", "off", "Yes", "010", "1e3", "0x1F", "true", "12:30:00"]


@pytest.mark.parametrize("text", TEXTS)
def test_a_str_setting_keeps_the_text_typed_on_the_command_line_and_in_a_file(text, tmp_path):
    assert _load(f"extra.tag={text}").extra.tag == text
    assert _load(yaml=f"extra:\n  tag: {text}\n  count: 1\n", tmp_path=tmp_path).extra.tag == text
    # a built-in str setting too: the run's folder is the name typed
    assert _load(f"run.name={text}").run.name == text


def test_null_is_still_none_for_an_optional_text_and_quotes_are_yamls(tmp_path):
    assert _load("extra.label=null").extra.label is None
    assert _load(yaml="extra:\n  label: ~\n  count: 1\n", tmp_path=tmp_path).extra.label is None
    assert _load("extra.label='null'").extra.label == "null"
    assert _load(yaml="extra:\n  tag: 'no'\n  count: 1\n", tmp_path=tmp_path).extra.tag == "no"
    # an interpolation is OmegaConf's to resolve, into the text of what it names
    assert _load("extra.tag=${seed}", "seed=7").extra.tag == "7"


def test_a_key_given_twice_takes_the_last_value_whichever_way_each_is_read():
    # a text kept as typed, then null (read by YAML): the later one says, as it always has
    assert _load("extra.label=first", "extra.label=null").extra.label is None
    assert _load("run.name=r", "run.name=null").run.name is None
    assert _load("extra.label=null", "extra.label=no").extra.label == "no"
    assert _load("extra.tag=a", "extra.tag=b").extra.tag == "b"
    assert _load("seed=1", "seed=2").seed == 2


@pytest.mark.parametrize(
    ("typed", "read_as"),
    [("010", "the octal 8"), ("-007", "the octal -7"), ("1:30", "the base-60 number 90"), ("1:02:03", "3723")],
)
def test_a_number_yaml_would_read_as_another_is_refused_naming_the_setting(typed, read_as, tmp_path):
    with pytest.raises(ConfigError) as on_the_line:
        _load(f"seed={typed}")
    assert f"config key 'seed' is {typed}" in on_the_line.value.cause and read_as in on_the_line.value.cause
    with pytest.raises(ConfigError) as in_a_file:
        _load(yaml=f"seed: {typed}\n", tmp_path=tmp_path)
    assert in_a_file.value.cause == on_the_line.value.cause
    # the same digits without the trap are a number, and quoted they are refused as text
    assert _load("seed=10").seed == 10
    assert _load("trainer.accumulate=3").trainer.accumulate == 3
    with pytest.raises(ConfigError, match=r"'trainer\.accumulate' is 010, a number with a leading zero"):
        _load("trainer.accumulate=010")


def test_a_literal_of_numbers_takes_its_members_and_names_them_when_refused():
    assert _load("extra.width=4").extra.width == 4
    assert _load("extra.scale=0.5").extra.scale == 0.5
    with pytest.raises(ConfigError) as refused:
        _load("extra.width=3")
    assert refused.value.cause.startswith("config key 'extra.width' is 3, but it must be one of 1, 2, 4")
    assert "extra.width" in describe(Typed, _load())


def test_an_enum_takes_a_members_name_and_lists_them_when_refused():
    assert _load("extra.colour=blue").extra.colour == Colour.blue
    with pytest.raises(ConfigError) as refused:
        _load("extra.colour=green")
    assert refused.value.cause.startswith("config key 'extra.colour' is 'green', but it must be one of red, blue")
    assert "'blue' (default 'red')" in describe(Typed, _load("extra.colour=blue"))


def test_a_required_setting_not_given_is_one_line_and_shown_as_required():
    with pytest.raises(ConfigError) as refused:
        load_config(Typed, [])
    assert refused.value.cause == (
        "config key 'extra.count' has no default and was not given (the key's meaning: given on every run)"
    )
    assert refused.value.fix.startswith("pass extra.count=<an integer>")
    assert "3 (required)" in describe(Typed, load_config(Typed, ["extra.count=3"]))


@pytest.mark.parametrize(
    ("value", "cause"),
    [
        ("${nope}", "config key 'extra.tag' takes its value from ${nope}, which is no setting"),
        (
            "${oc.env:DDPLAB_TEST_UNSET}",
            "config key 'extra.tag' takes its value from the environment variable DDPLAB_TEST_UNSET, which is not set",
        ),
        ("${who:knows}", "config key 'extra.tag' uses an interpolation OmegaConf does not know"),
        ("${oc.env:HOME}", None),
    ],
)
def test_an_interpolation_that_cannot_resolve_is_one_line_naming_the_setting(value, cause, monkeypatch):
    monkeypatch.delenv("DDPLAB_TEST_UNSET", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    if cause is None:
        assert _load(f"extra.tag={value}").extra.tag == "/home/someone"
        with pytest.raises(ConfigError, match="config key 'seed' cannot be resolved"):
            _load(f"seed={value}")
        return
    with pytest.raises(ConfigError) as refused:
        _load(f"extra.tag={value}")
    assert refused.value.cause.startswith(cause), refused.value.cause


@pytest.mark.parametrize(
    ("text", "holds"), [("- a\n- b\n", "a list"), ("just words\n", "the single value 'just words'")]
)
def test_a_file_that_holds_no_settings_is_one_line(text, holds, tmp_path):
    with pytest.raises(ConfigError) as refused:
        _load(yaml=text, tmp_path=tmp_path)
    assert f"holds {holds}, not settings" in refused.value.cause


@pytest.mark.parametrize(
    "override", ["run.resume=no", "run.resume=false", "trainer.early_stop.monitor=off", "checkpoint.monitor=None"]
)
def test_a_switch_word_where_a_name_or_path_belongs_is_refused_naming_the_way_to_turn_it_off(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as refused:
        _load(override)
    assert refused.value.cause.startswith(f"config key '{key}' is ")
    assert "never (start afresh)" in refused.value.cause or "or empty for none" in refused.value.cause


def test_the_command_line_refuses_in_one_line_before_any_process(tmp_path):
    res = ddplab_here("run", "toy", "seed=010", f"run.dir={tmp_path}", expect=2)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "seed=10" in lines[0], res.stderr
    assert not list(tmp_path.iterdir())
