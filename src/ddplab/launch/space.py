"""The search space of `ddplab sweep`, written as Hydra's sweepers write it, as Optuna distributions.

    trainer.lr=loguniform(1e-4,1e-1)     a float, uniform in its logarithm
    model.dropout=interval(0,0.5)        a float, uniform
    model.layers=range(1,5)              1, 2, 3 or 4 (the end left out, as in Python); range(0,1,0.25)
    data.augment=choice(none,flip,crop)  one of the values given

Any other key=value is a setting every trial shares."""

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError

KINDS = ("choice", "range", "interval", "loguniform")
_SPACE = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$", re.S)


@dataclass
class Param:
    key: str
    text: str  # as given, e.g. loguniform(1e-4,1e-1)
    distribution: object  # optuna.distributions.*

    def first(self):
        """A value of the space: what the check before the first trial runs with."""
        d = self.distribution
        return d.choices[0] if hasattr(d, "choices") else d.low


def split_space(settings: list[str]) -> tuple[dict[str, Param], list[str]]:
    """The key=SPACE items of `settings` by key, and the key=value settings every trial shares."""
    space: dict[str, Param] = {}
    fixed = []
    for item in settings:
        key, _, value = item.partition("=")
        found = _SPACE.match(value.strip())
        if not found:
            fixed.append(item)
            continue
        if found[1] not in KINDS:
            raise ConfigError(
                f"search space {item!r}: {found[1]}() is not one of {', '.join(KINDS)}",
                f"write KEY=KIND(...) with one of those, or quote a text value: {key}='{value}'",
            )
        if key in space:
            raise ConfigError(f"{key} is searched twice ({space[key].text} and {value})", "give one space per key")
        space[key] = Param(key, value.strip(), _distribution(item, found[1], found[2]))
    return space, fixed


def as_setting(key: str, value) -> str:
    """A sampled value as the key=value a run takes (a float keeps its point: 1e-05 -> 1.0e-05)."""
    text = repr(value) if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, float) and "e" in text and "." not in text:
        text = text.replace("e", ".0e", 1)
    return f"{key}={text}"


def _distribution(item: str, kind: str, inside: str):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    values = [_value(v) for v in inside.split(",")] if inside.strip() else []
    if kind == "choice":
        if not values:
            raise _malformed(item, "choice() needs at least one value")
        return CategoricalDistribution(values)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    wanted = {"range": "start,stop[,step]", "interval": "low,high", "loguniform": "low,high"}[kind]
    if len(numbers) != len(values) or not (2 <= len(values) <= (3 if kind == "range" else 2)):
        raise _malformed(item, f"{kind} takes numbers: {kind}({wanted})")
    low, high = values[:2]
    if kind == "range":
        return _range(item, low, high, values[2] if len(values) == 3 else 1, IntDistribution, FloatDistribution)
    if not low < high:
        raise _malformed(item, f"{kind}(low,high) needs low < high")
    if kind == "loguniform" and low <= 0:
        raise _malformed(item, "loguniform(low,high) needs 0 < low")
    return FloatDistribution(float(low), float(high), log=kind == "loguniform")


def _range(item: str, start, stop, step, int_kind, float_kind):
    """range(start,stop,step): start, start+step, ... below stop."""
    if step <= 0 or not start < stop:
        raise _malformed(item, "range(start,stop[,step]) needs start < stop and a step above 0")
    count = math.ceil((stop - start) / step)
    if all(isinstance(v, int) for v in (start, stop, step)):
        return int_kind(start, start + (count - 1) * step, step=step)
    return float_kind(float(start), round(start + (count - 1) * step, 12), step=float(step))


def _value(text: str):
    """One value of a space: a whole number, a number, true/false, or text (quotes taken off)."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text.strip("'\"")


def _malformed(item: str, why: str) -> ConfigError:
    return ConfigError(f"search space {item!r}: {why}", f"write KEY={'|'.join(f'{k}(...)' for k in KINDS)}")
