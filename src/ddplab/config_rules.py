"""What each setting allows, and which combinations of settings cannot work together.

config.py reads a setting and refuses one outside its rule here, in one line naming the key, the
value and what it allows; `check_combinations` refuses settings that are each fine but cannot run
together. Both before any process starts."""

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

    def allows(self, value: float) -> bool:
        if not math.isfinite(value):
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

    def allows(self, value: str) -> bool:
        return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None


def one_of(*choices: str) -> Text:
    return Text("|".join(map(re.escape, choices)), f"one of {', '.join(choices)}")


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
ABOVE_0 = Range(0, open=True)
FILLED = Text(r".+", "a value (not empty)")
# the signals a process can catch: SIGKILL and SIGSTOP cannot be, so they cannot start a clean stop
SIGNALS = "|".join(name for name in signal.Signals.__members__ if name not in ("SIGKILL", "SIGSTOP"))
# What each setting allows (the choices, or a range); a test feeds every key a value outside it.
RULES: dict[str, Any] = {
    "seed": Range(0, 2**63 - 1),
    "trainer.max_steps": AT_LEAST_0,
    "trainer.max_epochs": AT_LEAST_0,
    "trainer.global_batch_size": AT_LEAST_1,
    "trainer.accumulate": Text(r"auto|[1-9][0-9]*", "auto or a whole number >= 1"),
    "trainer.micro_batch_size": AT_LEAST_1,
    "trainer.grad_clip": AT_LEAST_0,
    "trainer.precision": one_of("fp32", "bf16", "fp16"),
    "trainer.log_every": AT_LEAST_1,
    "trainer.eval_every": AT_LEAST_0,
    "trainer.eval_batch_size": AT_LEAST_0,
    "trainer.num_workers": AT_LEAST_0,
    "trainer.checkpoint_every": AT_LEAST_0,
    "trainer.nonfinite": one_of("error", "skip"),
    # yaml reads true as True
    "trainer.deterministic": Text(r"(?i:warn|true|false)", "warn, true or false"),
    "trainer.early_stop.mode": one_of("min", "max"),
    "trainer.early_stop.patience": AT_LEAST_1,
    "trainer.compile": Text(
        r"(?i:false|true)|default|reduce-overhead|max-autotune(-no-cudagraphs)?",
        "false, true, default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs",
    ),
    "trainer.early_stop.min_delta": AT_LEAST_0,
    "trainer.ema_decay": Range(0, 1, below=True),
    "checkpoint.keep_last": AT_LEAST_0,
    "checkpoint.keep_best": AT_LEAST_0,
    "checkpoint.mode": one_of("max", "min"),
    "checkpoint.preempt_signals": Text(
        rf"(\s*({SIGNALS})\s*(,\s*({SIGNALS})\s*)*)?",
        "names of signals a process can catch (not SIGKILL or SIGSTOP), e.g. SIGTERM,SIGUSR1",
    ),
    "log.wandb_mode": one_of("online", "offline", "disabled"),
    "log.wandb_project": FILLED,
    "log.mlflow_uri": Text(
        r"|[A-Za-z][A-Za-z0-9+.-]*:.+",
        'empty (a store in the run folder) or a tracking URI with its scheme, e.g. "sqlite:///PATH/mlflow.db" or '
        '"http://HOST:5000"',
    ),
    "dist.backend": one_of("auto", "gloo", "nccl", "mpi"),
    "dist.rank": AT_LEAST_0,
    "dist.world_size": AT_LEAST_1,
    "dist.local_rank": AT_LEAST_0,
    "dist.local_world_size": AT_LEAST_1,
    "dist.master_port": Range(1, 65535),
    "dist.timeout_s": ABOVE_0,
    "dist.cpu_threads": AT_LEAST_0,
    "dist.strategy": one_of("ddp", "dp", "none"),
    "dist.bucket_cap_mb": ABOVE_0,
    "dist.debug": one_of("off", "info", "detail"),
    # true and false arrive as True and False (YAML booleans in a text setting)
    "dist.flight_recorder": Text(r"(?i)auto|true|false", "auto, true or false"),
    "dist.comm_hook": one_of("none", "fp16", "bf16", "powersgd"),
    "dist.powersgd_rank": AT_LEAST_1,
    # PowerSGD keeps state across steps, which it can only begin after DDP's buckets settle (step 2)
    "dist.powersgd_start_iter": Range(2),
    "dist.master_addr": FILLED,
    "dist.init_method": Text(r"(env|tcp|file)://.*", "env://, tcp://HOST:PORT or file:///PATH"),
    "trainer.profile": Text(r"(\d+:\d+)?", "START:END, e.g. 20:25 (quoted in a YAML file: '20:25'; empty: off)"),
    "run.name": Text(r"(?!\.\.?$|\s*$)[^/\\]+", "a plain folder name (not '.' or '..', no '/')"),
    "run.dir": FILLED,
    "run.resume": FILLED,
}


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
        raise ConfigError(
            "dist.static_graph=true fails inside DDP with trainer.accumulate other than 1 (micro-batches without "
            "gradient sync break the static graph)",
            "set dist.static_graph=false or trainer.accumulate=1",
        )
    if OmegaConf.select(cfg, "checkpoint.keep_best", default=0) and not cfg.checkpoint.monitor:
        raise ConfigError(
            f"checkpoint.keep_best={cfg.checkpoint.keep_best} needs a metric to rank by",
            "set checkpoint.monitor=<an evaluation metric>, or checkpoint.keep_best=0",
        )
    compiled = str(OmegaConf.select(cfg, "trainer.compile", default="false")).lower() != "false"
    if compiled and OmegaConf.select(cfg, "dist.bucket_cap_mb", default=25.0) < 1:
        # torch.compile's DDP optimizer splits the graph at buckets no smaller than its 1 MiB first one
        raise ConfigError(
            f"trainer.compile with dist.bucket_cap_mb={cfg.dist.bucket_cap_mb} fails inside torch.compile, which "
            "needs gradient buckets of at least 1 MiB",
            "set dist.bucket_cap_mb=1 or more, or trainer.compile=false",
        )
    _check_levers(cfg)
    _check_backoff(cfg)
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
    }
    for setting, clash in clashes.items():
        if clash:
            raise ConfigError(
                f"trainer.oom_backoff cannot run with {setting}: it sums the gradients itself once every rank is "
                "through its micro-batches, so no collective runs inside the forward or backward",
                f"turn off {setting.split('=')[0]} or trainer.oom_backoff",
            )


def _check_levers(cfg: DictConfig) -> None:
    """Gradient compression, synchronized BatchNorm and optimizer sharding act on DDP's ranks."""
    strategy = OmegaConf.select(cfg, "dist.strategy", default="ddp")
    if strategy == "ddp":
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
