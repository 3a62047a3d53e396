"""`--show-config` prints every setting of a target; the run plan reaches each worker whole, once."""

import dataclasses
import re
import types
import typing

import pytest
from omegaconf import OmegaConf

from helpers import FIXTURES, ddplab_here

TARGET = f"{FIXTURES}/experiments.py:Classifier"


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        yield from _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]


def _schema_types(cls, prefix=""):
    """Every leaf setting's type, read from the dataclasses (not from ddplab's own code)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in typing.get_args(kind):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        yield from (
            _schema_types(kind, f"{prefix}{f.name}.") if dataclasses.is_dataclass(kind) else [(prefix + f.name, kind)]
        )


def _words(kind) -> str:
    """A type as --show-config writes it: int; fp32 | bf16 | fp16 (choices); bool | warn (a switch
    with a mode); str for a long list of choices, which the setting's help names."""
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        return " | ".join(choices) if len(choices) <= 3 else "str"
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " | ".join(_words(member) for member in typing.get_args(kind))
    return kind.__name__


@pytest.mark.timeout(60)
def test_show_config_lists_every_setting_with_type_value_default_and_help(tmp_path):
    import sys

    sys.path.insert(0, str(FIXTURES))
    from experiments import Cfg

    res = ddplab_here("run", TARGET, "--show-config", "trainer.max_steps=7", f"run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr
    # columns: key, type, value, help, at least two spaces apart
    rows = {line.split()[0]: re.split(r"\s{2,}", line) for line in res.stdout.splitlines() if line.strip()}
    expected = dict(_leaves(OmegaConf.to_container(OmegaConf.structured(Cfg))))
    # every setting, nothing else
    assert set(rows) == set(expected)
    for key, kind in _schema_types(Cfg):
        assert rows[key][1] == _words(kind), rows[key]
    assert rows["trainer.precision"][1] == "fp32 | bf16 | fp16" and rows["trainer.accumulate"][1] == "int | auto"
    # the value in force, and the default it replaces
    assert rows["trainer.max_steps"][2] == "7 (default 0)"
    # the help declared with the setting
    assert rows["trainer.log_every"][3] == "optimizer steps per logged line"
    # nothing ran
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_show_config_on_eval_and_the_error_that_points_to_it():
    res = ddplab_here("eval", TARGET, "--checkpoint", "nowhere", "--show-config")
    assert res.returncode == 0 and "checkpoint.keep_last" in res.stdout, res.stderr
    res = ddplab_here("run", TARGET, "trainer.max_stepz=3")
    assert res.returncode == 2 and "did you mean trainer.max_steps" in res.stderr
    res = ddplab_here("run", TARGET, "nosuchgroup.key=3")
    assert "ddplab run TARGET --show-config" in res.stderr
    res = ddplab_here("run", "tests/fixtures/probe.py", "--show-config")
    assert res.returncode == 2 and "plain script" in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_workers_get_the_plan_resolved_once(tmp_path, parse_reports):
    settings = tmp_path / "settings.yaml"
    settings.write_text("seed: 41\n")
    res = ddplab_here("run", "tests/fixtures/probe.py:plan_probe", "-n", "2", "--config", str(settings), "seed=42")
    assert res.returncode == 0, res.stderr
    rows = parse_reports(res.stdout, "PLAN")
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        # no target, no settings to re-parse
        assert row["argv"][0].endswith("worker.py") and len(row["argv"]) == 1
        assert row["plan"]["entry"].endswith("probe.py:plan_probe") and row["plan"]["command"] == "run"
        # the override wins over the file, as resolved by the launcher
        assert row["seed"] == 42
        assert OmegaConf.create(row["plan"]["config"]).seed == 42
    # One name for the run, chosen before any worker starts, the same on every rank.
    assert rows[0]["run_name"] and rows[0]["run_name"] == rows[1]["run_name"]
