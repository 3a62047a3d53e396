"""What a setting may be, and which combinations of settings cannot work together.

A setting declares its rule beside its type and help (`config.setting(default, help, rule=...)`; a
`Literal[...]` type, or `bool | Literal[...]` for a switch with modes, is its own rule). config.py
refuses a value outside it in one line naming the key, the value and what it allows;
`check_combinations` refuses settings that are each fine but cannot run together. Both before any
process starts."""

import math
import re
import signal
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Numbers from `low` (excluded when `open`) up to `high` (excluded when `below`); never NaN or infinite."""

    low: float
    high: float = math.inf
    open: bool = False
    below: bool = False

    def allows(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        above_low = value > self.low if self.open else value >= self.low
        below_high = value < self.high if self.below else value <= self.high
        return above_low and below_high

    def __str__(self) -> str:
        text = f"{'>' if self.open else '>='} {self.low:g}"
        if self.high != math.inf:
            text += f" and {'<' if self.below else '<='} {self.high}"
        return text


@dataclass(frozen=True)
class Text:
    pattern: str  # what a value must match, whole
    meaning: str  # the same, in words

    def allows(self, value: Any) -> bool:
        return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None


@dataclass(frozen=True)
class Either:
    """A value any of `rules` allows (trainer.accumulate: auto, or a whole number >= 1)."""

    rules: tuple
    meaning: str

    def allows(self, value: Any) -> bool:
        return any(rule.allows(value) for rule in self.rules)


@dataclass(frozen=True)
class Choice:
    """One of `choices`, of their own type (a `Literal[1, 2, 4]` takes the int 2, not True or 2.0)."""

    choices: tuple

    def allows(self, value: Any) -> bool:
        return any(value == choice and type(value) is type(choice) for choice in self.choices)

    @property
    def meaning(self) -> str:
        return f"one of {', '.join(map(str, self.choices))}"


def one_of(*choices: Any) -> Choice:
    return Choice(choices)


@dataclass(frozen=True)
class _Bool:
    meaning: str = "true or false"

    def allows(self, value: Any) -> bool:
        return isinstance(value, bool)


def switch(*modes: str) -> Either:
    """A switch that also has named modes: true, false, or one of `modes`."""
    words = ", ".join(["true", "false", *modes[:-1]]) + f" or {modes[-1]}"
    return Either((_Bool(), one_of(*modes)), words)


def switch_value(value: Any) -> bool | str:
    """A switch as the code reads it: True, False or its mode. Also the old spellings ("true",
    "False"), which a config file of an older run, or a DistConfig built in Python, may hold."""
    if isinstance(value, str):
        value = value.lower()
        return value == "true" if value in ("true", "false") else value
    return value


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
ABOVE_0 = Range(0, open=True)
FILLED = Text(r".+", "a value (not empty)")
# the signals a process can catch: SIGKILL and SIGSTOP cannot be, so they cannot start a clean stop
SIGNALS = "|".join(name for name in signal.Signals.__members__ if name not in ("SIGKILL", "SIGSTOP"))
PREEMPT_SIGNALS = Text(
    rf"(\s*({SIGNALS})\s*(,\s*({SIGNALS})\s*)*)?",
    "names of signals a process can catch (not SIGKILL or SIGSTOP), e.g. SIGTERM,SIGUSR1",
)
# YAML 1.1's words for true, false and null: as text, a user who typed one meant a switch, not a name
_SWITCH_WORD = r"(?!(?i:no|false|off|none|null|yes|true|on)$)"
METRIC = Text(_SWITCH_WORD + r".*", "the name of a metric the evaluation returns, or empty for none")
RESUME = Text(_SWITCH_WORD + r".+", "auto, never (start afresh) or a checkpoint's path")
WHOLE_OR_AUTO = Either((one_of("auto"), Range(1)), "auto or a whole number >= 1")


def check_combinations(cfg: DictConfig) -> None:
    """Settings each within their rule that cannot work together."""
    if OmegaConf.select(cfg, "trainer.max_steps", default=1) == 0 == OmegaConf.select(cfg, "trainer.max_epochs"):
        raise ConfigError(
            "trainer.max_steps and trainer.max_epochs are both 0: there is nothing to train",
            "set trainer.max_steps=N or trainer.max_epochs=N above 0",
        )
    accumulate = str(OmegaConf.select(cfg, "trainer.accumulate", default="1"))
    if accumulate == "auto" and OmegaConf.select(cfg, "trainer.micro_batch_size", default=None) is None:
        raise ConfigError(
            "trainer.accumulate=auto chooses the accumulation that keeps each rank's micro-batch within "
            "trainer.micro_batch_size, which is not set",
            "set trainer.micro_batch_size=<the most samples one rank can take at once>",
        )
    if OmegaConf.select(cfg, "dist.static_graph", default=False) and accumulate != "1":
        # one micro-batch a step may not fit trainer.micro_batch_size: then the only fix that works alone
        fits = OmegaConf.select(cfg, "trainer.micro_batch_size", default=None) is None
        raise ConfigError(
            "dist.static_graph=true fails inside DDP with trainer.accumulate other than 1 (micro-batches without "
            "gradient sync break the static graph)",
            "set dist.static_graph=false" + (" or trainer.accumulate=1" if fits else ""),
        )
    if OmegaConf.select(cfg, "checkpoint.keep_best", default=0) and not cfg.checkpoint.monitor:
        raise ConfigError(
            f"checkpoint.keep_best={cfg.checkpoint.keep_best} needs a metric to rank by",
            "set checkpoint.monitor=<an evaluation metric>, or checkpoint.keep_best=0",
        )
    compiled = switch_value(OmegaConf.select(cfg, "trainer.compile", default=False)) is not False
    bucket_cap_mb = OmegaConf.select(cfg, "dist.bucket_cap_mb", default=None)
    if compiled and bucket_cap_mb is not None and bucket_cap_mb < 1:
        # torch.compile's DDP optimizer splits the graph at buckets no smaller than its 1 MiB first one
        raise ConfigError(
            f"trainer.compile with dist.bucket_cap_mb={cfg.dist.bucket_cap_mb} fails inside torch.compile, which "
            "needs gradient buckets of at least 1 MiB",
            "set dist.bucket_cap_mb=1 or more, or trainer.compile=false",
        )
    _check_levers(cfg)
    _check_backoff(cfg)
    _check_live(cfg)
    max_steps = OmegaConf.select(cfg, "trainer.max_steps", default=0)
    # with max_epochs, the window's end is checked once the data tells the run's length (train/loop.py)
    check_window(str(OmegaConf.select(cfg, "trainer.profile", default="")), max_steps or None)


def _check_backoff(cfg: DictConfig) -> None:
    """trainer.oom_backoff sums the gradients itself, after every micro-batch is through."""
    if not OmegaConf.select(cfg, "trainer.oom_backoff", default=False):
        return
    clashes = {
        "dist.comm_hook": OmegaConf.select(cfg, "dist.comm_hook", default="none") != "none",
        "dist.sync_batchnorm": OmegaConf.select(cfg, "dist.sync_batchnorm", default=False),
        "dist.strategy=dp": OmegaConf.select(cfg, "dist.strategy", default="ddp") == "dp",
        "dist.strategy=fsdp": OmegaConf.select(cfg, "dist.strategy", default="ddp") == "fsdp",
    }
    if setting := _first_on(clashes):
        raise ConfigError(
            f"trainer.oom_backoff cannot run with {setting}: it sums the gradients itself once every rank is "
            "through its micro-batches, so no collective runs inside the forward or backward",
            f"turn off {setting.split('=')[0]} or trainer.oom_backoff",
        )


def _first_on(clashes: dict[str, bool]) -> str | None:
    """The first of the settings that is on."""
    return next((setting for setting, on in clashes.items() if on), None)


def _check_live(cfg: DictConfig) -> None:
    """dist.fault_tolerance=live: replicas of one process, whose gradients torchft's DDP averages."""
    if OmegaConf.select(cfg, "dist.fault_tolerance", default="restart") != "live":
        return
    strategy = OmegaConf.select(cfg, "dist.strategy", default="ddp")
    clashes = {
        f"dist.strategy={strategy}": strategy != "ddp",
        "dist.comm_hook": OmegaConf.select(cfg, "dist.comm_hook", default="none") != "none",
        "dist.shard_optimizer": OmegaConf.select(cfg, "dist.shard_optimizer", default=False),
        "dist.sync_batchnorm": OmegaConf.select(cfg, "dist.sync_batchnorm", default=False),
        "trainer.oom_backoff": OmegaConf.select(cfg, "trainer.oom_backoff", default=False),
        "trainer.nonfinite=skip": OmegaConf.select(cfg, "trainer.nonfinite", default="error") == "skip",
        "trainer.compile": switch_value(OmegaConf.select(cfg, "trainer.compile", default=False)) is not False,
    }
    if setting := _first_on(clashes):
        raise ConfigError(
            f"dist.fault_tolerance=live cannot run with {setting}: each replica is one process whose gradients "
            "torchft averages in one all_reduce per step, kept or redone by all replicas together",
            f"drop {setting.split('=')[0]}, or use dist.fault_tolerance=restart",
        )


def _check_levers(cfg: DictConfig) -> None:
    """Gradient compression, synchronized BatchNorm and optimizer sharding act on DDP's ranks."""
    strategy = OmegaConf.select(cfg, "dist.strategy", default="ddp")
    if strategy == "fsdp":
        _check_fsdp(cfg)
    if strategy in ("ddp", "fsdp"):
        return
    levers = {
        "dist.comm_hook": OmegaConf.select(cfg, "dist.comm_hook", default="none") != "none",
        "dist.sync_batchnorm": OmegaConf.select(cfg, "dist.sync_batchnorm", default=False),
        "dist.shard_optimizer": OmegaConf.select(cfg, "dist.shard_optimizer", default=False),
    }
    for key, on in levers.items():
        if on:
            value = OmegaConf.select(cfg, key)
            raise ConfigError(
                f"{key}={str(value).lower()} acts on DDP's ranks, and dist.strategy={strategy} has none "
                f"({'one process over all GPUs' if strategy == 'dp' else 'networks left unwrapped'})",
                f"use dist.strategy=ddp, or drop {key}",
            )


def _check_fsdp(cfg: DictConfig) -> None:
    """What FSDP2 does its own way, or cannot do."""
    hook = OmegaConf.select(cfg, "dist.comm_hook", default="none")
    if hook != "none":
        raise ConfigError(
            f"dist.comm_hook={hook} is a hook on DDP's gradient all_reduce, and dist.strategy=fsdp reduces "
            "gradients with its own reduce-scatter",
            "drop dist.comm_hook (with trainer.precision=bf16 FSDP already gathers the weights in bf16), "
            "or use dist.strategy=ddp",
        )
    if OmegaConf.select(cfg, "dist.shard_optimizer", default=False):
        raise ConfigError(
            "dist.shard_optimizer=true and dist.strategy=fsdp both shard the optimizer state, and only one can",
            "drop dist.shard_optimizer: dist.strategy=fsdp shards weights, gradients and optimizer state",
        )
    if "://" in str(OmegaConf.select(cfg, "run.dir", default="runs")):
        raise ConfigError(
            "run.dir is in object storage, and the sharded checkpoints of dist.strategy=fsdp are written by every "
            "rank to a disk all ranks share",
            "point run.dir at a shared disk with dist.strategy=fsdp, or use dist.strategy=ddp",
        )
    if OmegaConf.select(cfg, "trainer.precision", default="fp32") == "fp16":
        raise ConfigError(
            "trainer.precision=fp16 needs a grad scaler that sees whole gradients, and dist.strategy=fsdp "
            "leaves each rank a shard of each",
            "use trainer.precision=bf16 (no scaler needed), or dist.strategy=ddp",
        )


def parse_window(text: str) -> tuple[int, int] | None:
    """'20:25' -> (20, 25); '' -> None. config_rules checks the form before any process starts."""
    if not text:
        return None
    start, end = (int(part) for part in text.split(":"))
    return start, end


def check_window(text: str, total: int | None) -> None:
    """An empty or reversed window, or one past the run's last step: one line each."""
    window = parse_window(text)
    if window is None:
        return
    start, end = window
    if end <= start:
        raise ConfigError(
            f"trainer.profile={text} is {'empty' if end == start else 'reversed'}: it profiles the steps after "
            "START up to END",
            f"write START:END with END above START, e.g. trainer.profile={start}:{start + 5}",
        )
    if total is not None and end > total:
        raise ConfigError(
            f"trainer.profile={text} ends after the run's last step ({total})",
            f"profile steps within the run, e.g. trainer.profile={max(0, total - 5)}:{total}",
        )
