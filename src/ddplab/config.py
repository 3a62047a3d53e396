"""Typed configuration: dataclass schemas, a YAML file, and `key=value` overrides, merged by OmegaConf.

This module adds the error a user can act on, in one line, before any process starts: an unknown key
names the closest valid keys, a wrong type or value names the key and what it allows."""

import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config_rules import RULES, Range, check_combinations
from .errors import ConfigError


def setting(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING) -> Any:
    """A setting and its description, declared together:

        lr: float = ddplab.setting(1e-3, "AdamW's learning rate")

    `ddplab run TARGET --show-config` prints the description beside the setting, and a one-line error
    about the setting quotes it. A list or dict default takes `default_factory`, as in `field`."""
    return field(default=default, default_factory=default_factory, metadata={"help": help})


@dataclass
class DistConfig:
    """How this process finds the others. `None` means: take it from the environment."""

    backend: str = setting("auto", "auto | gloo | nccl")
    rank: int | None = setting(None, "this process's rank, when you start each rank by hand")
    world_size: int | None = setting(None, "number of processes in the whole job")
    local_rank: int | None = setting(None, "rank on this node (picks the GPU)")
    local_world_size: int | None = setting(None, "processes on this node")
    master_addr: str | None = setting(None, "host of rank 0, where the ranks meet")
    master_port: int | None = setting(None, "port of rank 0's rendezvous store")
    init_method: str | None = setting(None, "env:// | tcp://host:port | file:///path")
    timeout_s: float = setting(600.0, "seconds a rendezvous or a collective may wait before it is an error")
    cpu_threads: int = setting(0, "0: cores // local_world_size")
    strategy: str = setting("ddp", "ddp | dp | none")
    bucket_cap_mb: float = setting(25.0, "DDP: gradient bucket size")
    find_unused_parameters: bool = setting(False, "DDP: allow parameters that get no gradient in a step")
    static_graph: bool = setting(False, "DDP: the graph is the same every step")
    gradient_as_bucket_view: bool = setting(True, "DDP: gradients are views into the buckets (saves memory)")
    broadcast_buffers: bool = setting(
        True, "DDP: copy rank 0's buffers (BatchNorm statistics) to every rank at each forward"
    )
    comm_hook: str = setting("none", "DDP gradient compression: none | fp16 | bf16 (NCCL only) | powersgd")
    powersgd_rank: int = setting(1, "powersgd: rank of the low-rank gradient (higher: closer to exact, more bytes)")
    powersgd_start_iter: int = setting(1000, "powersgd: steps of plain all_reduce before compressing (at least 2)")
    shard_optimizer: bool = setting(
        False, "split optimizer state across ranks (ZeroRedundancyOptimizer): 1/W memory each"
    )
    sync_batchnorm: bool = setting(
        False, "BatchNorm statistics over every rank's micro-batch (SyncBatchNorm; GPUs only)"
    )
    debug: str = setting("off", "off | info | detail")
    flight_recorder: str = setting(
        "auto", "torch's record of each rank's last collectives: auto (on with NCCL) | true | false"
    )


@dataclass
class RunConfig:
    dir: str = setting("runs", "runs are written to DIR/<experiment>/<name>/")
    name: str | None = setting(None, "the run's folder; unset: the start time. Give it to resume a run")
    resume: str = setting("auto", "auto | never | PATH")


@dataclass
class EarlyStopConfig:
    monitor: str = setting("", 'an evaluation metric (e.g. loss); "" never stops early')
    mode: str = setting("min", "min | max: which way is better")
    patience: int = setting(3, "evaluations in a row without improvement, then the run stops")
    min_delta: float = setting(0.0, "a change smaller than this is no improvement")


@dataclass
class TrainerConfig:
    max_steps: int = setting(0, "> 0: train exactly this many optimizer steps (max_epochs is then ignored)")
    max_epochs: int = setting(1, "used when max_steps is 0")
    global_batch_size: int = setting(32, "samples per optimizer step, over all ranks and micro-batches")
    accumulate: str = setting(
        "1", "micro-batches per optimizer step (gradient accumulation); auto: chosen per world size"
    )
    micro_batch_size: int | None = setting(
        None, "the most samples one rank takes at once; sets accumulate=auto's choice"
    )
    oom_backoff: bool = setting(False, "out of memory in a step: every rank redoes it with micro-batches cut in two")
    profile: str = setting("", 'START:END: torch.profiler over steps START+1..END on every rank ("": off)')
    profile_dir: str = setting("", 'where the traces go ("": RUN/profile)')
    precision: str = setting("fp32", "fp32 | bf16 | fp16")
    grad_clip: float = setting(0.0, "0: off")
    log_every: int = setting(10, "optimizer steps per logged line")
    eval_every: int = setting(0, "steps; 0: at the end of every epoch")
    eval_batch_size: int = setting(0, "per rank; 0: the training micro-batch")
    num_workers: int = setting(0, "DataLoader worker processes per rank")
    progress: bool = setting(True, "tqdm bar on local rank 0")
    checkpoint_every: int = setting(0, "steps; 0: off (see checkpoint.every_epoch and checkpoint.at_end)")
    nonfinite: str = setting("error", "a NaN/inf loss: error (stop, naming the step) | skip (skip that optimizer step)")
    deterministic: str = setting(
        "warn", "warn (deterministic kernels; a warning names an op that has none) | true | false"
    )
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    ema_decay: float = setting(
        0.0, "> 0 (e.g. 0.999): keep a moving average of the weights, used to evaluate and export"
    )
    eval_with_ema: bool = setting(True, "with ema_decay > 0: evaluate and predict with the averaged weights")
    compile: str = setting(
        "false", "torch.compile the networks for training: false | true | a mode: reduce-overhead, max-autotune, ..."
    )


@dataclass
class CheckpointConfig:
    every_epoch: bool = setting(False, "checkpoint at the end of every epoch")
    at_end: bool = setting(True, "checkpoint when training ends")
    keep_last: int = setting(2, "the K most recent; 0 keeps all")
    keep_best: int = setting(0, "also keep the K best by `monitor`")
    monitor: str = setting("", "an evaluation metric, e.g. roc_auc")
    mode: str = setting("max", "max | min")
    async_save: bool = setting(False, "`checkpoint.async=true` also works")
    preempt_signals: str = setting("SIGTERM,SIGUSR1", 'save and stop at the next step boundary; "" to disable')


@dataclass
class LogConfig:
    tensorboard: bool = setting(True, "write TensorBoard event files to the run's tensorboard/")
    wandb: bool = setting(False, "log to Weights & Biases (pip install 'ddplab[wandb]')")
    wandb_project: str = setting("ddplab", "the W&B project")
    wandb_mode: str = setting("online", "online | offline | disabled")
    mlflow: bool = setting(False, "log to MLflow from rank 0 (pip install 'ddplab[mlflow]')")
    mlflow_uri: str = setting("", 'the tracking URI; "": a local store in the run folder (sqlite:///RUN/mlflow.db)')
    mlflow_experiment: str = setting("", 'the MLflow experiment; "": the experiment\'s name')


@dataclass
class Config:
    """The keys every experiment has. An experiment adds its own groups by subclassing."""

    seed: int = setting(0, "initial weights, data order and every random stream follow from it")
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def check_values(cfg: DictConfig, schema: type = Config) -> None:
    """Refuse any setting outside its rule, or a combination that cannot work: one line, before any
    process starts."""
    for key, rule in RULES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not rule.allows(value):
            number = "an integer" if isinstance(value, int) else "a number"
            allowed = f"{number} {rule}" if isinstance(rule, Range) else rule.meaning
            raise ConfigError(
                f"config key '{key}' is {value!r}, but it must be {allowed} (the key's meaning: {_help(schema, key)})",
                f"pass {key}=<{allowed}>",
            )
    check_combinations(cfg)


def load_config(
    schema: type = Config, overrides: Sequence[str] = (), yaml_path: str | None = None, yaml_text: str | None = None
) -> DictConfig:
    """Build the resolved config: schema defaults < YAML file (or text) < `key=value` overrides."""
    merged = OmegaConf.structured(schema)
    types = _field_types(schema)
    valid = sorted(types)
    layers = [_read_yaml(yaml_path, valid)] if yaml_path else []
    if yaml_text is not None:
        layers.append(OmegaConf.create(yaml_text))
    layers.append(_parse_overrides(overrides, valid))
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _type_error(e, types) from None
    check_values(merged, schema)
    return merged


def describe(schema: type, cfg: DictConfig) -> str:
    """`--show-config`: every setting with its type, current value, default (when it differs) and
    the comment that documents it in the schema."""
    defaults = OmegaConf.structured(schema)
    rows = []
    for key, kind in _field_types(schema).items():
        value = OmegaConf.select(cfg, key)
        default = OmegaConf.select(defaults, key)
        shown = f"{value!r}" + ("" if value == default else f" (default {default!r})")
        rows.append((key, getattr(kind, "__name__", str(kind)), shown, _help(schema, key)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{k:<{widths[0]}}  {t:<{widths[1]}}  {v:<{widths[2]}}  {h}".rstrip() for k, t, v, h in rows)


def _help(schema: type, key: str) -> str:
    """The description declared with the setting (`setting(default, help)`), or "" when it has none."""
    *groups, name = key.split(".")
    for group in groups:
        schema = _strip_optional(typing.get_type_hints(schema)[group])
    declared = {f.name: f for f in fields(schema)}[name]
    # Python 3.14's field(doc=...) too
    return declared.metadata.get("help") or getattr(declared, "doc", None) or ""


def missing_help(schema: type) -> list[str]:
    """The settings of a schema declared without a description (a test keeps the bundled ones at none)."""
    return [key for key in _field_types(schema) if not _help(schema, key)]


def split_overrides(args: Iterable[str]) -> tuple[list[str], list[str]]:
    """Separate `key=value` overrides from everything else (flags, script arguments)."""
    overrides = [arg for arg in args if _is_override(arg)]
    return overrides, [arg for arg in args if not _is_override(arg)]


def dist_overrides(overrides: Sequence[str]) -> DistConfig:
    """Only the `dist.*` part of the overrides, typed: what the launcher and runtime need."""
    return OmegaConf.to_object(load_config(Config, [o for o in overrides if o.startswith("dist.")]).dist)


def save_config(cfg: DictConfig, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-") and arg.split("=", 1)[0].replace(".", "").replace("_", "").isalnum()


# `async` is a Python keyword
_ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def _parse_overrides(overrides: Sequence[str], valid: list[str]) -> DictConfig:
    overrides = [_ALIASES.get(o.split("=", 1)[0], o.split("=", 1)[0]) + "=" + o.split("=", 1)[1] for o in overrides]
    for item in overrides:
        _check_key(item.split("=", 1)[0], valid)
    # `key=` means the empty string (e.g. checkpoint.preempt_signals= to disable), not null
    overrides = [o + "''" if o.endswith("=") else o for o in overrides]
    # YAML reads 20:25 as a base-60 integer (1225), and -1:2 as -62: nobody means that, so such a
    # value stays text, a negative part included
    overrides = [re.sub(r"=(-?\d+(?::-?\d+)+)$", r"='\1'", o) for o in overrides]
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as e:
        # OmegaConf's grammar errors, and yaml's for a value like [1,
        raise ConfigError(
            f"cannot parse overrides {list(overrides)} ({type(e).__name__})",
            "write them as key=value, e.g. key='[1, 2]' for a list",
        ) from None


def _read_yaml(path: str, valid: list[str]) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist", "check the path given to --config")
    try:
        conf = OmegaConf.load(path)
    except Exception as e:
        # yaml.YAMLError and friends
        raise ConfigError(f"config file {path} is not valid YAML ({e.__class__.__name__})", "fix its syntax") from None
    for key in _leaf_keys(OmegaConf.to_container(conf)):
        _check_key(key, valid)
    return conf


def _check_key(key: str, valid: list[str]) -> None:
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


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_error(e: OmegaConfBaseException, types: dict[str, Any]) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    value = getattr(e, "value", None)
    expected = types.get(key)
    words = _TYPE_WORDS.get(expected, f"a value of type {getattr(expected, '__name__', expected)}")
    return ConfigError(f"config key '{key}' expects {words}, got {value!r}", f"pass {key}=<{words}>")


def _field_types(schema: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of a dataclass schema, dotted, with its (un-Optional'ed) type."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        name = prefix + f.name
        kind = _strip_optional(hints[f.name])
        if is_dataclass(kind):
            out.update(_field_types(kind, name + "."))
        else:
            out[name] = kind
    return out


def _strip_optional(kind: Any) -> Any:
    """`int | None` (or `Optional[int]`) -> int; any other type as it is."""
    if typing.get_origin(kind) not in (typing.Union, types.UnionType):
        return kind
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return args[0] if len(args) == 1 else kind


def _leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return [prefix.rstrip(".")]
    return [leaf for k, v in tree.items() for leaf in _leaf_keys(v, f"{prefix}{k}.")]
