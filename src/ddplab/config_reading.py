"""Settings as the user typed them: a YAML file and `key=value` overrides, each value read as the
type its setting declares.

YAML 1.1, which OmegaConf reads, turns plain text into other things: `no`, `off` and `yes` into
booleans, `1:30` into the base-60 number 90, `010` into the octal 8. For a setting typed `str` that
is never what was meant (`tag: 1:30` became '90', `run.name=no` the folder `False`), so a `str`
setting keeps the text exactly as written; for a number, a leading zero or a base-60 form is
refused in one line rather than read as another number. Quoted values, lists, mappings and
interpolations (`${...}`) are left to OmegaConf."""

import difflib
import functools
import os
import re
import types as types_module
import typing
from collections.abc import Sequence
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError

# `async` is a Python keyword
ALIASES = {"checkpoint.async": "checkpoint.async_save"}
# what YAML reads as "no value" in a plain scalar: an optional setting's None, never the text
NULLS = ("null", "Null", "NULL", "~")
# YAML 1.1's octal integers (a leading zero) and base-60 numbers (parts joined by colons)
OCTAL = re.compile(r"[-+]?0[0-9_]+")
BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")


def parse_overrides(overrides: Sequence[str], types: dict[str, Any]) -> DictConfig:
    """`key=value` overrides as one config layer, each value read as its setting's type."""
    valid = sorted(types)
    pairs = [(ALIASES.get(key, key), value) for key, value in (o.split("=", 1) for o in overrides)]
    for key, _ in pairs:
        check_key(key, valid)
    # a key given twice: the last one says (the texts below are set after the parsed values)
    last = {key: i for i, (key, _) in enumerate(pairs)}
    pairs = [pair for i, pair in enumerate(pairs) if last[pair[0]] == i]
    texts = {}
    parsed = []
    for key, value in pairs:
        if _is_plain(value) and (text := typed_text(key, value, types.get(key))) is not None:
            texts[key] = text
        else:
            # `key=` means the empty string (e.g. checkpoint.preempt_signals= to disable), not null
            parsed.append(f"{key}={value}" if value else f"{key}=''")
    try:
        layer = OmegaConf.from_dotlist(parsed)
    except Exception as e:
        # OmegaConf's grammar errors, and yaml's for a value like [1,
        raise ConfigError(
            f"cannot parse overrides {[f'{k}={v}' for k, v in pairs]} ({type(e).__name__})",
            "write them as key=value, e.g. key='[1, 2]' for a list",
        ) from None
    for key, text in texts.items():
        OmegaConf.update(layer, key, text, merge=False)
    return old_spellings(layer, types)


def read_yaml(path: str, types: dict[str, Any]) -> DictConfig:
    """A config file as one layer: settings as `key: value`, nested by group."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist", "check the path given to --config")
    with open(path) as f:
        text = f.read()
    return yaml_layer(text, types, f"config file {path}")


def yaml_layer(text: str, types: dict[str, Any], what: str = "the config") -> DictConfig:
    """YAML text as one config layer, each plain value read as its setting's type."""
    try:
        tree = yaml.compose(text, Loader=yaml.SafeLoader)
        if tree is None:
            return OmegaConf.create({})
        if not isinstance(tree, yaml.MappingNode):
            kind = "a list" if isinstance(tree, yaml.SequenceNode) else f"the single value {tree.value!r}"
            raise ConfigError(
                f"{what} holds {kind}, not settings",
                "write one setting per line as key: value, with each group's keys nested under its name",
            )
        conf = OmegaConf.create(text)
    except ConfigError:
        raise
    except Exception as e:
        # yaml.YAMLError and OmegaConf's own (a key given twice)
        raise ConfigError(f"{what} is not valid YAML ({e.__class__.__name__})", "fix its syntax") from None
    valid = sorted(types)
    for key in leaf_keys(OmegaConf.to_container(conf)):
        check_key(key, valid)
    for key, raw in _plain_scalars(tree).items():
        if (value := typed_text(key, raw, types.get(key))) is not None:
            OmegaConf.update(conf, key, value, merge=False)
    return old_spellings(conf, types)


def typed_text(key: str, raw: str, kind: Any) -> str | None:
    """What a plain value `raw` must be for a setting of type `kind`: the text itself for a `str`
    setting (None for YAML's null); None to let YAML read it. A number written so that YAML 1.1
    would read another number is refused."""
    if kind is str:
        return None if raw in NULLS else raw
    if int in _members(kind) or float in _members(kind):
        if OCTAL.fullmatch(raw):
            read = yaml.safe_load(raw)
            raise ConfigError(
                f"config key '{key}' is {raw}, a number with a leading zero, which YAML reads as the octal {read}",
                f"write it without the zero ({key}={int(raw.replace('_', ''))}), or quote it if text was meant",
            )
        if BASE_60.fullmatch(raw):
            raise ConfigError(
                f"config key '{key}' is {raw}, which YAML reads as the base-60 number {yaml.safe_load(raw)}",
                f"write the number itself ({key}={yaml.safe_load(raw)}), or quote it if text was meant",
            )
    return None


def _members(kind: Any) -> tuple:
    return typing.get_args(kind) if typing.get_origin(kind) is not None else (kind,)


def _is_plain(value: str) -> bool:
    """A value written without quotes, brackets or an interpolation: YAML resolves its type."""
    return bool(value) and value[0] not in "'\"[{" and "${" not in value


def _plain_scalars(node, prefix: str = "") -> dict[str, str]:
    """Every plain (unquoted) scalar of a YAML mapping, by dotted key, as written."""
    out: dict[str, str] = {}
    if not isinstance(node, yaml.MappingNode):
        return out
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        if isinstance(value_node, yaml.MappingNode):
            out.update(_plain_scalars(value_node, key + "."))
        elif isinstance(value_node, yaml.ScalarNode) and value_node.style is None:
            out[ALIASES.get(key, key)] = value_node.value
    return out


def check_key(key: str, valid: list[str]) -> None:
    """An unknown key, or a group given a value, in one line naming the closest valid keys."""
    if key in valid or any(key.startswith(v + ".") for v in valid):
        # the latter: dict-typed leaves
        return
    group = [v for v in valid if v.startswith(key + ".")]
    if group:
        raise ConfigError(f"'{key}' is a group of keys, not a value", f"set one of its keys, e.g. {group[0]}=...")
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    hint = (
        f"did you mean {' or '.join(close)}?" if close else "see `ddplab run TARGET --show-config` for the valid keys"
    )
    raise ConfigError(f"unknown config key '{key}'", hint)


def old_spellings(layer: DictConfig, types: dict[str, Any]) -> DictConfig:
    """A switch or choice written as text, as older runs' config files hold them ('false', 'Warn',
    accumulate '2'), becomes what its typed setting takes (False, 'warn', 2)."""
    tree = OmegaConf.to_container(layer)
    for key in leaf_keys(tree):
        kind = types.get(key)
        if typing.get_origin(kind) not in (typing.Union, types_module.UnionType):
            continue
        # as written: an interpolation (${...}) is left for OmegaConf to resolve
        value = functools.reduce(lambda node, part: node[part], key.split("."), tree)
        if not isinstance(value, str):
            continue
        text = value.strip().lower()
        members = typing.get_args(kind)
        if bool in members and text in ("true", "false"):
            OmegaConf.update(layer, key, text == "true")
        elif int in members and text.isdigit():
            OmegaConf.update(layer, key, int(text))
        elif text in literal_choices(kind):
            OmegaConf.update(layer, key, text)
    return layer


def literal_choices(kind: Any) -> tuple:
    """The choices of a `Literal[...]` type, also inside a union (`bool | Literal["warn"]`)."""
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)
    return tuple(
        c for member in typing.get_args(kind) if typing.get_origin(member) is typing.Literal for c in member.__args__
    )


def leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return [prefix.rstrip(".")]
    return [leaf for k, v in tree.items() for leaf in leaf_keys(v, f"{prefix}{k}.")]
