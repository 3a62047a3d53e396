"""Typed configuration: dataclass schemas, a YAML file, and `key=value` overrides, merged by OmegaConf.

This module adds the error a user can act on, in one line, before any process starts: an unknown key
names the closest valid keys, a wrong type or value names the key and what it allows."""

import enum
import os
import re
import types as types_module
import typing
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Literal

from omegaconf import MISSING as OmegaConf_MISSING
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    GrammarParseError,
    InterpolationKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    UnsupportedInterpolationType,
)

from .config_reading import literal_choices, parse_overrides, read_yaml, yaml_layer
from .config_rules import (
    ABOVE_0,
    AT_LEAST_0,
    AT_LEAST_1,
    FILLED,
    METRIC,
    PREEMPT_SIGNALS,
    RESUME,
    WHOLE_OR_AUTO,
    Range,
    Text,
    check_combinations,
    one_of,
    switch,
)
from .errors import ConfigError


def setting(default: Any = MISSING, help: str = "", *, rule: Any = None, default_factory: Any = MISSING) -> Any:
    """A setting, its description and its rule, declared together:

        lr: float = ddplab.setting(1e-3, "AdamW's learning rate", rule=ddplab.Range(0, open=True))
        optimizer: Literal["adamw", "sgd"] = ddplab.setting("adamw", "which optimizer")

    `ddplab run TARGET --show-config` prints the description beside the setting; a value outside the
    rule (a `Literal` type is its own) is refused in one line that quotes it, before any process
    starts. A list or dict default takes `default_factory`, as in `field`; a setting without a default
    must be given (`key=value` or the --config file), or the run is refused in one line."""
    metadata = {"help": help} if rule is None else {"help": help, "rule": rule}
    if default is MISSING and default_factory is MISSING:
        # a required setting: OmegaConf's mark of a missing value, refused in one line when not given
        default = OmegaConf_MISSING
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass
class DistConfig:
    """How this process finds the others. `None` means: take it from the environment."""

    backend: Literal["auto", "gloo", "nccl", "mpi"] = setting("auto", "which library carries the collectives")
    rank: int | None = setting(None, "this process's rank, when you start each rank by hand", rule=AT_LEAST_0)
    world_size: int | None = setting(None, "number of processes in the whole job", rule=AT_LEAST_1)
    local_rank: int | None = setting(None, "rank on this node (picks the GPU)", rule=AT_LEAST_0)
    local_world_size: int | None = setting(None, "processes on this node", rule=AT_LEAST_1)
    master_addr: str | None = setting(None, "host of rank 0, where the ranks meet", rule=FILLED)
    master_port: int | None = setting(None, "port of rank 0's rendezvous store", rule=Range(1, 65535))
    init_method: str | None = setting(
        None,
        "env:// | tcp://host:port | file:///path",
        rule=Text(r"(env|tcp|file)://.*", "env://, tcp://HOST:PORT or file:///PATH"),
    )
    timeout_s: float = setting(
        600.0, "seconds a rendezvous or a collective may wait before it is an error", rule=ABOVE_0
    )
    cpu_threads: int = setting(0, "0: cores // local_world_size", rule=AT_LEAST_0)
    strategy: Literal["ddp", "fsdp", "dp", "none"] = setting(
        "ddp",
        "ddp: a process per device; fsdp: the same, each network sharded across the ranks (FSDP2); "
        "dp: one process over all GPUs; none: networks left unwrapped",
    )
    fsdp_units: str = setting(
        "auto",
        "fsdp: the modules sharded as units: auto (by size) or class names, e.g. Block,Embedding",
        rule=Text(r"auto|\s*[A-Za-z_]\w*(\s*,\s*[A-Za-z_]\w*)*\s*", "auto or class names separated by commas"),
    )
    fsdp_min_params: int = setting(
        1_000_000, "fsdp_units=auto: the parameters that make a module a unit of its own", rule=AT_LEAST_1
    )
    fsdp_cpu_offload: bool = setting(False, "fsdp: keep sharded weights, gradients and optimizer state on the host")
    # unset, DDP closes its first bucket at 1 MiB, so the all_reduce starts while the backward runs on;
    # any value given to DDP makes every bucket that size, the first one too
    bucket_cap_mb: float | None = setting(
        None, "DDP: gradient bucket size in MiB (unset: DDP's 25, after a first bucket of 1)", rule=ABOVE_0
    )
    find_unused_parameters: bool = setting(False, "DDP: allow parameters that get no gradient in a step")
    static_graph: bool = setting(False, "DDP: the graph is the same every step")
    gradient_as_bucket_view: bool = setting(True, "DDP: gradients are views into the buckets (saves memory)")
    broadcast_buffers: bool = setting(
        True, "DDP: copy rank 0's buffers (BatchNorm statistics) to every rank at each forward"
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = setting("none", "DDP gradient compression")
    powersgd_rank: int = setting(
        1, "powersgd: rank of the low-rank gradient (higher: closer to exact, more bytes)", rule=AT_LEAST_1
    )
    # PowerSGD keeps state across steps, which it can only begin after DDP's buckets settle (step 2)
    powersgd_start_iter: int = setting(
        1000, "powersgd: steps of plain all_reduce before compressing (at least 2)", rule=Range(2)
    )
    shard_optimizer: bool = setting(
        False, "split optimizer state across ranks (ZeroRedundancyOptimizer): 1/W memory each"
    )
    sync_batchnorm: bool = setting(
        False, "BatchNorm statistics over every rank's micro-batch (SyncBatchNorm; GPUs only)"
    )
    debug: Literal["off", "info", "detail"] = setting("off", "torch.distributed's own checks and logs")
    fault_tolerance: Literal["restart", "live"] = setting(
        "restart",
        "restart: a failure restarts every worker from the last checkpoint; live: each process is a replica, "
        "a lost one's peers go on and its replacement heals from a peer (torchft; pip install ddplab[ft])",
    )
    lighthouse: str | None = setting(
        None,
        "live: the lighthouse's address, http://HOST:PORT (ddplab lighthouse); unset: ddplab run starts one",
        rule=Text(r"https?://[^\s/]+(:\d+)?/?", "http://HOST:PORT"),
    )
    replica_id: int = setting(
        0, "live: the number of this node's first replica (ddplab run -n N: N from here)", rule=AT_LEAST_0
    )
    min_replicas: int = setting(1, "live: replicas a step needs; with fewer the step waits for them", rule=AT_LEAST_1)
    flight_recorder: bool | Literal["auto"] = setting(
        "auto", "torch's record of each rank's last collectives: auto (on with NCCL) | true | false"
    )


@dataclass
class RunConfig:
    dir: str = setting(
        "runs",
        "runs are written to DIR/<experiment>/<name>/; DIR may be object storage: s3://BUCKET/PREFIX",
        rule=FILLED,
    )
    name: str | None = setting(
        None,
        "the run's folder; unset: the start time. Give it to resume a run",
        rule=Text(r"(?!\.\.?$|\s*$)[^/\\]+", "a plain folder name (not '.' or '..', no '/')"),
    )
    resume: str = setting("auto", "auto | never | PATH", rule=RESUME)
    local_dir: str = setting(
        "runs",
        "with run.dir in object storage: the run's local copy (checkpoints are written here first, then uploaded)",
        rule=FILLED,
    )
    storage_timeout_s: float = setting(
        60.0, "with run.dir in object storage: the longest one request to the store may wait", rule=ABOVE_0
    )
    storage_lease_s: float = setting(
        60.0,
        "with run.dir in object storage: how long a job's hold on its run lasts unrenewed; another job waits "
        "this long before it takes over the run of a job that died",
        rule=ABOVE_0,
    )


@dataclass
class EarlyStopConfig:
    monitor: str = setting("", 'an evaluation metric (e.g. loss); "" never stops early', rule=METRIC)
    mode: Literal["min", "max"] = setting("min", "which way is better")
    patience: int = setting(3, "evaluations in a row without improvement, then the run stops", rule=AT_LEAST_1)
    min_delta: float = setting(0.0, "a change smaller than this is no improvement", rule=AT_LEAST_0)


@dataclass
class TrainerConfig:
    max_steps: int = setting(
        0, "> 0: train exactly this many optimizer steps (max_epochs is then ignored)", rule=AT_LEAST_0
    )
    max_epochs: int = setting(1, "used when max_steps is 0", rule=AT_LEAST_0)
    global_batch_size: int = setting(
        32, "samples per optimizer step, over all ranks and micro-batches", rule=AT_LEAST_1
    )
    accumulate: int | Literal["auto"] = setting(
        1, "micro-batches per optimizer step (gradient accumulation); auto: chosen per world size", rule=WHOLE_OR_AUTO
    )
    micro_batch_size: int | None = setting(
        None, "the most samples one rank takes at once; sets accumulate=auto's choice", rule=AT_LEAST_1
    )
    oom_backoff: bool = setting(False, "out of memory in a step: every rank redoes it with micro-batches cut in two")
    profile: str = setting(
        "",
        'START:END: torch.profiler over steps START+1..END on every rank ("": off)',
        rule=Text(r"(\d+:\d+)?", "START:END, e.g. 20:25 (empty: off)"),
    )
    profile_dir: str = setting("", 'where the traces go ("": RUN/profile)')
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32", "the dtype of the forward and backward (fp16: CUDA only)"
    )
    grad_clip: float = setting(0.0, "the largest gradient norm; 0: off", rule=AT_LEAST_0)
    log_every: int = setting(10, "optimizer steps per logged line", rule=AT_LEAST_1)
    eval_every: int = setting(0, "steps; 0: at the end of every epoch", rule=AT_LEAST_0)
    eval_batch_size: int = setting(0, "per rank; 0: the training micro-batch", rule=AT_LEAST_0)
    num_workers: int = setting(0, "DataLoader worker processes per rank", rule=AT_LEAST_0)
    progress: bool = setting(True, "tqdm bar on local rank 0")
    checkpoint_every: int = setting(
        0, "steps; 0: off (see checkpoint.every_epoch and checkpoint.at_end)", rule=AT_LEAST_0
    )
    nonfinite: Literal["error", "skip"] = setting(
        "error", "a NaN/inf loss: error (stop, naming the step) | skip (skip that optimizer step)"
    )
    deterministic: bool | Literal["warn"] = setting(
        "warn", "warn (deterministic kernels; a warning names an op that has none) | true | false"
    )
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    ema_decay: float = setting(
        0.0,
        "> 0 (e.g. 0.999): keep a moving average of the weights, used to evaluate and export",
        rule=Range(0, 1, below=True),
    )
    eval_with_ema: bool = setting(True, "with ema_decay > 0: evaluate and predict with the averaged weights")
    compile: bool | Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = setting(
        False, "torch.compile the networks for training: false | true | a mode: reduce-overhead, max-autotune, ..."
    )


@dataclass
class CheckpointConfig:
    every_epoch: bool = setting(False, "checkpoint at the end of every epoch")
    at_end: bool = setting(True, "checkpoint when training ends")
    keep_last: int = setting(2, "the K most recent; 0 keeps all", rule=AT_LEAST_0)
    keep_best: int = setting(0, "also keep the K best by `monitor`", rule=AT_LEAST_0)
    monitor: str = setting("", 'an evaluation metric, e.g. roc_auc; "": none', rule=METRIC)
    mode: Literal["max", "min"] = setting("max", "which way `monitor` is better")
    async_save: bool = setting(False, "`checkpoint.async=true` also works")
    preempt_signals: str = setting(
        "SIGTERM,SIGUSR1", 'save and stop at the next step boundary; "" to disable', rule=PREEMPT_SIGNALS
    )


@dataclass
class LogConfig:
    tensorboard: bool = setting(True, "write TensorBoard event files to the run's tensorboard/")
    wandb: bool = setting(False, "log to Weights & Biases (pip install 'ddplab[wandb]')")
    wandb_project: str = setting("ddplab", "the W&B project", rule=FILLED)
    wandb_mode: Literal["online", "offline", "disabled"] = setting("online", "where W&B sends the run")
    mlflow: bool = setting(False, "log to MLflow from rank 0 (pip install 'ddplab[mlflow]')")
    mlflow_uri: str = setting(
        "",
        'the tracking URI; "": a local store in the run folder (sqlite:///RUN/mlflow.db)',
        rule=Text(
            r"|[A-Za-z][A-Za-z0-9+.-]*:.+",
            'empty (a store in the run folder) or a tracking URI with its scheme, e.g. "sqlite:///PATH/mlflow.db" or '
            '"http://HOST:5000"',
        ),
    )
    mlflow_experiment: str = setting("", 'the MLflow experiment; "": the experiment\'s name')


@dataclass
class Config:
    """The keys every experiment has. An experiment adds its own groups by subclassing."""

    seed: int = setting(
        0, "initial weights, data order and every random stream follow from it", rule=Range(0, 2**63 - 1)
    )
    run: RunConfig = field(default_factory=RunConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def check_values(cfg: DictConfig, schema: type = Config) -> None:
    """Refuse any setting outside its rule, or a combination that cannot work: one line, before any
    process starts."""
    for key in _field_types(schema):
        rule = rule_of(schema, key)
        value = OmegaConf.select(cfg, key, default=None)
        if rule is not None and value is not None and not rule.allows(value):
            raise _outside(schema, key, value, rule)
    check_combinations(cfg)


def load_config(
    schema: type = Config, overrides: Sequence[str] = (), yaml_path: str | None = None, yaml_text: str | None = None
) -> DictConfig:
    """Build the resolved config: schema defaults < YAML file (or text) < `key=value` overrides, each
    value read as its setting's type (config_reading.py)."""
    merged = OmegaConf.structured(schema)
    types = _field_types(schema)
    layers = [read_yaml(yaml_path, types)] if yaml_path else []
    if yaml_text is not None:
        layers.append(yaml_layer(yaml_text, types))
    layers.append(parse_overrides(overrides, types))
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _type_error(e, schema, types) from None
    _check_complete(merged, schema, types)
    check_values(merged, schema)
    return merged


def _check_complete(cfg: DictConfig, schema: type, types: dict[str, Any]) -> None:
    """Every setting has a value, and every interpolation (${...}) resolves to one of its type."""
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        OmegaConf.to_container(cfg, resolve=True)
    except (InterpolationResolutionError, GrammarParseError) as e:
        raise _interpolation_error(e) from None
    except OmegaConfBaseException as e:
        # a value an interpolation gave that the setting's type refuses
        raise _type_error(e, schema, types) from None
    if missing:
        key = missing[0]
        words = _TYPE_WORDS.get(types.get(key), f"a value of type {_type_name(types.get(key))}")
        raise ConfigError(
            f"config key '{key}' has no default and was not given (the key's meaning: {_help(schema, key)})",
            f"pass {key}=<{words}>, or set it in the --config file",
        )


def _interpolation_error(e: OmegaConfBaseException) -> ConfigError:
    """An interpolation that cannot be resolved, naming the setting that holds it and why."""
    key = getattr(e, "full_key", None) or "?"
    text = str(e).splitlines()[0]
    if isinstance(e, InterpolationKeyError):
        missing = re.search(r"key '([^']*)'", text)
        return ConfigError(
            f"config key '{key}' takes its value from ${{{missing.group(1) if missing else '?'}}}, which is no setting",
            "name an existing setting in the interpolation (its full dotted key), or give the value itself",
        )
    if isinstance(e, UnsupportedInterpolationType):
        return ConfigError(
            f"config key '{key}' uses an interpolation OmegaConf does not know ({text})",
            "use ${oc.env:VARIABLE} for an environment variable, ${group.key} for another setting, or a plain value",
        )
    variable = re.search(r"Environment variable '([^']*)' not found", text)
    if variable:
        return ConfigError(
            f"config key '{key}' takes its value from the environment variable {variable.group(1)}, which is not set",
            f"set {variable.group(1)}, or give a default: ${{oc.env:{variable.group(1)},DEFAULT}}",
        )
    return ConfigError(f"config key '{key}' cannot be resolved ({text})", "fix the interpolation, or give a value")


def describe(schema: type, cfg: DictConfig) -> str:
    """`--show-config`: every setting with its type, current value, default (when it differs) and
    the description declared with it."""
    defaults = OmegaConf.structured(schema)
    rows = []
    for key, kind in _field_types(schema).items():
        value = _shown(OmegaConf.select(cfg, key))
        if OmegaConf.select(defaults, key, default=OmegaConf_MISSING) == OmegaConf_MISSING:
            shown = f"{value} (required)"
        else:
            default = _shown(OmegaConf.select(defaults, key))
            shown = value + ("" if value == default else f" (default {default})")
        rows.append((key, _type_name(kind), shown, _help(schema, key)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{k:<{widths[0]}}  {t:<{widths[1]}}  {v:<{widths[2]}}  {h}".rstrip() for k, t, v, h in rows)


def _shown(value: Any) -> str:
    """A value as --show-config writes it: an Enum by its member's name, as it is given."""
    return repr(value.name if isinstance(value, enum.Enum) else value)


def rule_of(schema: type, key: str) -> Any:
    """What the setting allows: the rule declared with it, or the choices of its `Literal` type
    (`bool | Literal[...]`: true, false or a mode); None when any value of its type will do."""
    owner, declared = _declared(schema, key)
    if "rule" in declared.metadata:
        return declared.metadata["rule"]
    kind = _strip_optional(typing.get_type_hints(owner)[declared.name])
    choices = literal_choices(kind)
    if not choices:
        return None
    return switch(*choices) if bool in typing.get_args(kind) else one_of(*choices)


def _help(schema: type, key: str) -> str:
    """The description declared with the setting (`setting(default, help)`), or "" when it has none."""
    declared = _declared(schema, key)[1]
    # Python 3.14's field(doc=...) too
    return declared.metadata.get("help") or getattr(declared, "doc", None) or ""


def _declared(schema: type, key: str) -> tuple[type, Any]:
    """The dataclass that declares a dotted key, and its field."""
    *groups, name = key.split(".")
    for group in groups:
        schema = _strip_optional(typing.get_type_hints(schema)[group])
    return schema, {f.name: f for f in fields(schema)}[name]


def missing_help(schema: type) -> list[str]:
    """The settings of a schema declared without a description (a test keeps the bundled ones at none)."""
    return [key for key in _field_types(schema) if not _help(schema, key)]


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-") and arg.split("=", 1)[0].replace(".", "").replace("_", "").isalnum()


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


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_error(e: OmegaConfBaseException, schema: type, types: dict[str, Any]) -> ConfigError:
    key = getattr(e, "full_key", None) or "?"
    value = getattr(e, "value", None)
    expected = types.get(key)
    # a choice or a switch with modes: its rule says what it takes better than its type
    if typing.get_origin(expected) in (Literal, typing.Union, types_module.UnionType):
        return _outside(schema, key, value, rule_of(schema, key))
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return _outside(schema, key, value, one_of(*expected.__members__))
    words = _TYPE_WORDS.get(expected, f"a value of type {_type_name(expected)}")
    return ConfigError(f"config key '{key}' expects {words}, got {value!r}", f"pass {key}=<{words}>")


def _outside(schema: type, key: str, value: Any, rule: Any) -> ConfigError:
    allowed = (
        f"{'an integer' if isinstance(value, int) else 'a number'} {rule}" if isinstance(rule, Range) else rule.meaning
    )
    return ConfigError(
        f"config key '{key}' is {value!r}, but it must be {allowed} (the key's meaning: {_help(schema, key)})",
        f"pass {key}=<{allowed}>",
    )


def _type_name(kind: Any) -> str:
    """How --show-config writes a type: int, bool | warn, fp32 | bf16 | fp16, bool | str."""
    if typing.get_origin(kind) is Literal:
        # a long list of modes is in the setting's help
        choices = typing.get_args(kind)
        return " | ".join(map(str, choices)) if len(choices) <= 3 else type(choices[0]).__name__
    if typing.get_origin(kind) in (typing.Union, types_module.UnionType):
        return " | ".join(_type_name(member) for member in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


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
    if typing.get_origin(kind) not in (typing.Union, types_module.UnionType):
        return kind
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return args[0] if len(args) == 1 else kind
