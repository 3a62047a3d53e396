"""Every setting of every ddplab schema is range-checked before anything starts: each key is fed a
value outside what it allows, and each must be refused in one line naming the key and the value.
A new key without a bad value here fails the walk, so a new setting cannot skip its rule."""

import pytest
from omegaconf import OmegaConf

from ddplab.config import Config, _field_types, load_config
from ddplab.errors import ConfigError
from helpers import ddplab_here

# key -> values it must refuse (booleans are walked with "maybe"); every key of Config is here
BAD = {
    "seed": ["-1", "1.5"],
    "run.dir": ["''"],
    "run.name": ["a/b", "..", "' '"],
    "run.resume": ["''"],
    "run.local_dir": ["''"],
    "run.storage_timeout_s": ["0", "-1"],
    "run.storage_lease_s": ["0", "-5"],
    "trainer.max_steps": ["-3"],
    "trainer.max_epochs": ["-1"],
    "trainer.global_batch_size": ["0", "-8"],
    "trainer.accumulate": ["0", "-2", "1.5", "automatic"],
    "trainer.micro_batch_size": ["0", "-4"],
    "trainer.precision": ["fp8"],
    "trainer.grad_clip": ["-1", "nan", "inf"],
    "trainer.log_every": ["0"],
    "trainer.eval_every": ["-2"],
    "trainer.eval_batch_size": ["-1"],
    "trainer.num_workers": ["-1"],
    "trainer.checkpoint_every": ["-1"],
    "trainer.nonfinite": ["ignore"],
    "trainer.deterministic": ["2", "fast"],
    "trainer.early_stop.mode": ["maximum"],
    "trainer.early_stop.patience": ["0", "-1"],
    "trainer.early_stop.min_delta": ["-0.1", "nan"],
    # checked at the first evaluation (test_step_effects)
    "trainer.early_stop.monitor": [],
    "trainer.ema_decay": ["1", "1.5", "-0.1", "nan"],
    "trainer.compile": ["fast", "max_autotune", ""],
    "trainer.profile": ["20", "20-25", "a:b", "5:2", "3:3", "-1:2", "1:-2"],
    # checked when training starts (test_profiling)
    "trainer.profile_dir": [],
    "checkpoint.keep_last": ["-1"],
    "checkpoint.keep_best": ["-1"],
    "checkpoint.mode": ["maximum"],
    # checked at the first evaluation
    "checkpoint.preempt_signals": ["SIGTERM,SIGFOO", "SIGKILL", "SIGTERM,SIGSTOP"],
    "checkpoint.monitor": [],
    "log.wandb_project": ["''"],
    "log.wandb_mode": ["offline2"],
    "log.mlflow_uri": ["mlruns", "runs/mlflow.db"],
    # any name is an MLflow experiment's ("": the experiment's own)
    "log.mlflow_experiment": [],
    "dist.backend": ["nccl2"],
    "dist.rank": ["-1"],
    "dist.world_size": ["0"],
    "dist.local_rank": ["-1"],
    "dist.local_world_size": ["0"],
    "dist.master_addr": ["''"],
    "dist.master_port": ["0", "70000"],
    "dist.init_method": ["env:/", "http://host:1"],
    "dist.timeout_s": ["0", "-5", "nan"],
    "dist.cpu_threads": ["-1"],
    "dist.strategy": ["fsdp1", "zero3"],
    "dist.fsdp_units": ["1Block", "Block;Head", "''", "auto,Block,"],
    "dist.fsdp_min_params": ["0", "-1"],
    "dist.bucket_cap_mb": ["0"],
    "dist.debug": ["verbose"],
    "dist.flight_recorder": ["always", "2"],
    "dist.comm_hook": ["zip", "powerSGD"],
    "dist.powersgd_rank": ["0"],
    "dist.powersgd_start_iter": ["1", "0"],
    "dist.fault_tolerance": ["torchft", "elastic"],
    "dist.lighthouse": ["127.0.0.1:29510", "ftp://host:1", "''"],
    "dist.replica_id": ["-1"],
    "dist.min_replicas": ["0"],
}


def _cases():
    for key, kind in _field_types(Config).items():
        for value in ["maybe"] if kind is bool else BAD.get(key, []):
            yield key, value


def test_every_key_has_a_bad_value_to_try():
    keys = set(_field_types(Config))
    missing = {k for k in keys if k not in BAD and _field_types(Config)[k] is not bool}
    assert not missing, f"give these keys a bad value in BAD: {sorted(missing)}"


@pytest.mark.parametrize("key, value", list(_cases()))
def test_a_value_outside_the_rule_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(Config, [f"{key}={value}"])
    assert key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_steps=0", "trainer.max_epochs=0"],
        ["checkpoint.keep_best=2"],
        ["dist.static_graph=true", "trainer.accumulate=2"],
        ["trainer.accumulate=auto"],
        ["dist.strategy=dp", "dist.comm_hook=fp16"],
        ["dist.strategy=none", "dist.sync_batchnorm=true"],
        ["dist.strategy=dp", "dist.shard_optimizer=true"],
        ["trainer.compile=true", "dist.bucket_cap_mb=0.5"],
    ],
)
def test_combinations_that_cannot_work_are_refused(overrides):
    with pytest.raises(ConfigError):
        load_config(Config, overrides)


@pytest.mark.parametrize(
    "overrides, cause, fix",
    [
        (["dist.comm_hook=fp16"], "hook on DDP's gradient all_reduce", "drop dist.comm_hook"),
        (["dist.comm_hook=powersgd"], "own reduce-scatter", "drop dist.comm_hook"),
        (["dist.shard_optimizer=true"], "both shard the optimizer state", "drop dist.shard_optimizer"),
        (
            ["trainer.oom_backoff=true"],
            "trainer.oom_backoff cannot run with dist.strategy=fsdp",
            "turn off dist.strategy",
        ),
        (["trainer.precision=fp16"], "grad scaler that sees whole gradients", "trainer.precision=bf16"),
        (["run.dir=s3://bucket/runs"], "written by every rank to a disk all ranks share", "shared disk"),
    ],
)
def test_what_fsdp_cannot_combine_with_is_one_line_naming_the_fix(overrides, cause, fix):
    with pytest.raises(ConfigError) as e:
        load_config(Config, ["dist.strategy=fsdp", *overrides])
    assert cause in e.value.cause and fix in e.value.fix and "\n" not in str(e.value)
    # each alone is fine
    load_config(Config, overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["dist.strategy=fsdp"],
        ["dist.comm_hook=fp16"],
        ["dist.shard_optimizer=true"],
        ["trainer.oom_backoff=true"],
        ["trainer.nonfinite=skip"],
        ["trainer.compile=true"],
    ],
)
def test_what_live_recovery_cannot_combine_with_is_one_line_naming_the_fix(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(Config, ["dist.fault_tolerance=live", *overrides])
    setting = overrides[0].split("=")[0]
    assert setting in e.value.cause and f"drop {setting}" in e.value.fix and "\n" not in str(e.value)
    load_config(Config, overrides)


def test_static_graph_with_accumulation_names_only_fixes_that_work_alone():
    """trainer.accumulate=1 is a fix only where no micro-batch limit may refuse one micro-batch a step."""
    with pytest.raises(ConfigError) as e:
        load_config(Config, ["dist.static_graph=true", "trainer.accumulate=2"])
    assert str(e.value).endswith("set dist.static_graph=false or trainer.accumulate=1")
    assert load_config(Config, ["dist.static_graph=true", "trainer.accumulate=1"]).dist.static_graph
    limited = ["dist.static_graph=true", "trainer.accumulate=auto", "trainer.micro_batch_size=4"]
    with pytest.raises(ConfigError) as e:
        load_config(Config, limited)
    assert str(e.value).endswith("set dist.static_graph=false")


@pytest.mark.parametrize(
    "key, value",
    [("trainer.grad_clip", v) for v in ("0", "1", "4.5", "1e9")]
    + [("trainer.ema_decay", v) for v in ("0", "0.5", "0.9999")],
)
def test_values_inside_the_rule_are_kept(key, value):
    assert OmegaConf.select(load_config(Config, [f"{key}={value}"]), key) == float(value)


@pytest.mark.parametrize(
    ("value", "typed"),
    [("false", False), ("true", True), ("True", True)]
    + [(mode, mode) for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")],
)
def test_every_compile_mode_is_accepted(value, typed):
    assert OmegaConf.select(load_config(Config, [f"trainer.compile={value}"]), "trainer.compile") == typed


def test_an_older_runs_config_file_with_switches_written_as_text_loads_typed(tmp_path):
    """Switches and the accumulation were text settings once: a config.yaml of such a run (`ddplab
    eval` reads final/config.yaml) still loads, each value becoming what its typed setting takes."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "trainer:\n  compile: 'false'\n  deterministic: Warn\n  accumulate: '2'\ndist:\n  flight_recorder: 'TRUE'\n"
        # an interpolation of a key the file does not set is resolved after the merge, as before
        "seed: ${trainer.log_every}\n"
    )
    trainer = load_config(Config, yaml_path=str(path)).trainer
    assert (trainer.compile, trainer.deterministic, trainer.accumulate) == (False, "warn", 2)
    assert load_config(Config, yaml_path=str(path)).seed == 10
    assert load_config(Config, yaml_path=str(path)).dist.flight_recorder is True
    # the settings read as switches in the code take the old spellings from Python too
    from ddplab.config_rules import switch_value

    assert [switch_value(v) for v in ("false", "True", True, "auto", "Warn")] == [False, True, True, "auto", "warn"]


def test_an_experiments_own_settings_carry_their_rules():
    """A rule declared with an experiment's own setting, or its Literal type, refuses a value in the
    same one line as ddplab's settings, naming the key, what it allows and the key's meaning."""
    from dataclasses import dataclass, field
    from typing import Literal

    from ddplab import Range, setting

    @dataclass
    class Optim:
        lr: float = setting(3e-4, "AdamW's learning rate", rule=Range(0, open=True))
        kind: Literal["adamw", "sgd"] = setting("adamw", "which optimizer")

    @dataclass
    class Cfg(Config):
        optim: Optim = field(default_factory=Optim)

    with pytest.raises(ConfigError) as e:
        load_config(Cfg, ["optim.lr=0"])
    assert str(e.value).startswith(
        "config key 'optim.lr' is 0.0, but it must be a number > 0 (the key's meaning: AdamW"
    )
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, ["optim.kind=adam"])
    assert "'optim.kind' is 'adam', but it must be one of adamw, sgd (the key's meaning: which optimizer)" in str(
        e.value
    )
    assert load_config(Cfg, ["optim.lr=0.1", "optim.kind=sgd"]).optim == {"lr": 0.1, "kind": "sgd"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override", ["trainer.grad_clip=-1", "trainer.log_every=0", "dist.timeout_s=-1"])
def test_a_bad_value_never_reaches_a_worker(tmp_path, override):
    res = ddplab_here("run", "-n", "2", "tests/fixtures/experiments.py:Classifier", f"run.dir={tmp_path}", override)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and override.split("=")[0] in lines[0], res.stderr
    assert not any(tmp_path.iterdir()), "a run folder was made: a worker started"


def _schemas() -> dict[str, type]:
    """ddplab's own schema and every bundled experiment's and command's, by name."""
    from ddplab.entries import load_entry
    from ddplab.experiments import REGISTRY
    from ddplab.experiments.collectives_tour import TourConfig
    from ddplab.tools.commbench import BenchConfig

    found = {name: getattr(load_entry(entry), "config_class", Config) for name, entry in REGISTRY.items()}
    return {"ddplab.Config": Config, "collectives": TourConfig, "bench comm": BenchConfig, **found}


@pytest.mark.parametrize("name", sorted(_schemas()))
def test_every_setting_is_declared_with_its_help(name):
    from ddplab.config import missing_help

    assert missing_help(_schemas()[name]) == []


def _outside(rule) -> list:
    """Values a Range or a choice refuses, at each of its ends."""
    from ddplab.config_rules import Range

    if not isinstance(rule, Range):
        return ["not-one-of-them"] if "one of" in getattr(rule, "meaning", "") else []
    values = [rule.low if rule.open else rule.low - 1]
    if rule.high != float("inf"):
        values.append(rule.high if rule.below else rule.high + 1)
    return [int(v) if float(v).is_integer() and abs(v) < 2**63 else v for v in values]


@pytest.mark.parametrize("name", sorted(_schemas()))
def test_every_number_and_choice_of_every_schema_declares_its_rule_and_is_held_to_it(name):
    """A number or a choice without a rule would reach the training (a dropout of 2, a fraction of
    1.5) and fail there, or worse, not fail: each one declares what it allows, and each end of it is
    refused in one line before any process starts."""
    from ddplab.config import _field_types, rule_of

    schema = _schemas()[name]
    numbers = [k for k, kind in _field_types(schema).items() if kind in (int, float) or "Literal" in str(kind)]
    assert [k for k in numbers if rule_of(schema, k) is None] == []
    for key in numbers:
        for value in _outside(rule_of(schema, key)):
            with pytest.raises(ConfigError) as e:
                load_config(schema, [f"{key}={value}"])
            assert f"config key '{key}'" in str(e.value) and "\n" not in str(e.value)


def test_help_is_read_from_the_declaration_whatever_the_formatter_made_of_the_line():
    from dataclasses import dataclass, field

    from ddplab import setting
    from ddplab.config import describe, missing_help

    @dataclass
    class Optim:
        lr: float = setting(3e-4, "AdamW's learning rate")
        betas: list[float] = setting(default_factory=lambda: [0.9, 0.95], help="AdamW's betas")
        # a comment beside a field is not a declaration: it is reported missing
        eps: float = 1e-8  # AdamW's epsilon

    @dataclass
    class Cfg(Config):
        optim: Optim = field(default_factory=Optim)

    assert missing_help(Cfg) == ["optim.eps"]
    rows = {line.split()[0]: line for line in describe(Cfg, load_config(Cfg, ["optim.lr=0.1"])).splitlines()}
    assert rows["optim.lr"].endswith("AdamW's learning rate") and "0.1 (default 0.0003)" in rows["optim.lr"]
    assert rows["optim.betas"].endswith("AdamW's betas") and Cfg().optim.betas is not Cfg().optim.betas
    # the setting whose comment the formatter once moved off its line
    assert "torch.compile the networks for training" in rows["trainer.compile"]


@pytest.mark.parametrize("window", ["-1:2", "1:-2", "-5:-3"])
def test_a_negative_window_is_named_as_typed_not_as_yaml_reads_it(window):
    """YAML reads -1:2 as a base-60 number (-62): the message must show what the user typed."""
    with pytest.raises(ConfigError) as e:
        load_config(Config, [f"trainer.profile={window}"])
    assert f"'trainer.profile' is '{window}'" in str(e.value)
