"""The parts of `ddplab sweep` that need no process: the search space as Optuna distributions, a
sampled value as a setting, and a trial's link to its study (a real SQLite study in tmp_path)."""

import json
import math
import os

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from ddplab.config import load_config
from ddplab.errors import ConfigError, DdplabError
from ddplab.launch.space import as_setting, split_space
from ddplab.train.pruning import SweepTrial, make_pruner
from fixtures.experiments import Cfg


@pytest.mark.parametrize(
    "item, expected, first",
    [
        ("k=choice(0.1, 2, true, word, 'quoted')", CategoricalDistribution([0.1, 2, True, "word", "quoted"]), 0.1),
        ("k=choice(False,TRUE,no)", CategoricalDistribution([False, True, "no"]), False),
        ("k=range(1,5)", IntDistribution(1, 4, step=1), 1),
        ("k=range(0,10,3)", IntDistribution(0, 9, step=3), 0),
        ("k=range(2,9,3)", IntDistribution(2, 8, step=3), 2),
        ("k=range(0,1,0.25)", FloatDistribution(0.0, 0.75, step=0.25), 0.0),
        ("k=interval(0,0.5)", FloatDistribution(0.0, 0.5), 0.0),
        ("k=interval(-1,1e-3)", FloatDistribution(-1.0, 0.001), -1.0),
        ("k=loguniform(1e-4,1e-1)", FloatDistribution(1e-4, 0.1, log=True), 1e-4),
    ],
)
def test_each_space_is_the_optuna_distribution_it_names(item, expected, first):
    space, fixed = split_space([item, "trainer.max_steps=4"])
    assert space["k"].distribution == expected and space["k"].first() == first
    assert space["k"].text == item.split("=", 1)[1] and fixed == ["trainer.max_steps=4"]


def test_settings_that_are_not_spaces_stay_as_they_are():
    items = ["a=1", "b=[1,2]", "c='f(x)'", "d=", "e=choice"]
    assert split_space(items) == ({}, items)


@pytest.mark.parametrize(
    "item, said",
    [
        ("k=choice()", "choice() needs at least one value"),
        ("k=range(1)", "range takes numbers: range(start,stop[,step])"),
        ("k=range(1,2,3,4)", "range takes numbers"),
        ("k=range(5,5)", "needs start < stop and a step above 0"),
        ("k=range(5,1)", "needs start < stop and a step above 0"),
        ("k=range(1,5,0)", "needs start < stop and a step above 0"),
        ("k=range(1,5,-1)", "needs start < stop and a step above 0"),
        ("k=interval(1,1)", "interval(low,high) needs low < high"),
        ("k=interval(a,b)", "interval takes numbers"),
        ("k=interval(1,2,3)", "interval takes numbers"),
        ("k=interval(true,2)", "interval takes numbers"),
        ("k=loguniform(0,1)", "loguniform(low,high) needs 0 < low"),
        ("k=loguniform(-1,1)", "needs 0 < low"),
        ("k=loguniform(2,1)", "needs low < high"),
        ("k=normal(0,1)", "normal() is not one of choice, range, interval, loguniform"),
    ],
)
def test_a_malformed_space_is_named_with_its_cause(item, said):
    with pytest.raises(ConfigError) as e:
        split_space([item])
    assert said in e.value.cause and f"'{item}'" in e.value.cause


def test_a_key_searched_twice_is_refused():
    with pytest.raises(ConfigError, match="k is searched twice"):
        split_space(["k=choice(1)", "k=range(1,3)"])


@pytest.mark.parametrize(
    "value, setting, parsed",
    [
        (1e-05, "model.lr=1.0e-05", 1e-05),
        (0.0003, "model.lr=0.0003", 0.0003),
        (2.5e20, "model.lr=2.5e+20", 2.5e20),
        (0.1 + 0.2, "model.lr=0.30000000000000004", 0.30000000000000004),
        (16, "model.hidden=16", 16),
        (True, "model.torchmetric=true", True),
        ("float64", "data.dtype=float64", "float64"),
    ],
)
def test_a_sampled_value_is_the_setting_a_run_reads_back_exactly(value, setting, parsed):
    key = setting.split("=")[0]
    assert as_setting(key, value) == setting
    cfg = load_config(Cfg, [setting])
    group, name = key.split(".")
    assert cfg[group][name] == parsed and type(cfg[group][name]) is type(parsed)


def _study(tmp_path, pruner="median", startup=1, direction="minimize"):
    storage = f"sqlite:///{tmp_path}/study.db"
    study = optuna.create_study(
        study_name="s", storage=storage, direction=direction, pruner=make_pruner(pruner, startup)
    )
    return study, storage


def _link(study, storage, trial, pruner="median", startup=1):
    return SweepTrial(storage, "s", trial._trial_id, trial.number, "loss", pruner, startup)


def test_a_trial_is_pruned_when_worse_than_the_median_of_finished_trials_at_that_step(tmp_path):
    study, storage = _study(tmp_path, startup=2)
    for losses in ([0.9, 0.5], [0.7, 0.3], [0.8, 0.1]):
        trial = study.ask()
        link = _link(study, storage, trial, startup=2)
        pruned = [
            link.should_prune({"loss": loss, "accuracy": 0.5}, step) for step, loss in zip((5, 10), losses, strict=True)
        ]
        # the first two have nobody to compare with (startup 2); the third is never worse than the median
        assert pruned == [False, False]
        study.tell(trial, losses[-1])
    # the median of 0.9, 0.7, 0.8 at step 5 is 0.8
    worse, better = study.ask(), study.ask()
    assert _link(study, storage, worse, startup=2).should_prune({"loss": 0.85}, 5) is True
    assert _link(study, storage, better, startup=2).should_prune({"loss": 0.75}, 5) is False
    # reported under the run's own step, once per step, even when a resumed run reports it again
    link = _link(study, storage, better, startup=2)
    assert link.should_prune({"loss": 0.75}, 5) is False
    assert study.trials[better.number].intermediate_values == {5: 0.75}


def test_maximizing_a_metric_prunes_the_low_values_and_a_value_that_is_not_finite(tmp_path):
    study, storage = _study(tmp_path, direction="maximize")
    trial = study.ask()
    _link(study, storage, trial).should_prune({"loss": 0.6}, 5)
    study.tell(trial, 0.6)
    low, high, nan = study.ask(), study.ask(), study.ask()
    assert _link(study, storage, low).should_prune({"loss": 0.5}, 5) is True
    assert _link(study, storage, high).should_prune({"loss": 0.7}, 5) is False
    assert _link(study, storage, nan).should_prune({"loss": math.inf}, 5) is True


@pytest.mark.parametrize(
    "name, kind",
    [
        ("median", optuna.pruners.MedianPruner),
        ("halving", optuna.pruners.SuccessiveHalvingPruner),
        ("hyperband", optuna.pruners.HyperbandPruner),
        ("none", optuna.pruners.NopPruner),
    ],
)
def test_each_pruner_name_is_optunas_pruner(tmp_path, name, kind):
    # the name as a rank reads it from the environment: a string of its own, not the literal
    read = json.loads(json.dumps(name))
    assert type(make_pruner(read, 3)) is kind
    if name == "median":
        assert make_pruner(read, 3)._n_startup_trials == 3
    study, storage = _study(tmp_path, pruner=name, startup=1)
    verdicts = []
    # finished trials to compare with, then trials the pruner judges
    for loss in (0.5, 0.6, 0.9, 0.4):
        trial = study.ask()
        verdicts.append(_link(study, storage, trial, pruner=name).should_prune({"loss": loss}, 1))
        study.tell(trial, loss)
    # a checkpoint keeps the verdict: a plain bool, never numpy's
    assert [type(v) for v in verdicts] == [bool] * 4
    if name == "median":
        assert verdicts == [False, True, True, False]


def test_the_link_travels_in_the_environment_whole(tmp_path):
    link = SweepTrial("sqlite:///x.db", "s", 7, 3, "roc_auc", "median", 2)
    env = link.to_env({"OTHER": "1"})
    assert env["OTHER"] == "1"
    os.environ.update(env)
    try:
        assert SweepTrial.from_env() == link
    finally:
        del os.environ["DDPLAB_SWEEP_TRIAL"]
    assert SweepTrial.from_env() is None


def _plan(tmp_path, *argv):
    from ddplab.launch.cli import _parser
    from ddplab.launch.sweep import plan_sweep

    args, rest = _parser().parse_known_args(["sweep", EXP, f"run.dir={tmp_path}", *argv])
    return plan_sweep(args, rest)


EXP = "tests/fixtures/experiments.py:Classifier"


def test_a_sweep_is_planned_from_its_command(tmp_path):
    sweep = _plan(
        tmp_path, "-n", "2", "trainer.max_steps=4", "model.lr=loguniform(1e-3,1e-1)", "model.hidden=range(8,33,8)",
        "--monitor", "loss", "--mode", "min", "--trials", "5", "--seed", "7", "--pruner", "halving",
    )  # fmt: skip
    assert sweep.folder == str(tmp_path / "classifier" / "sweep-lr-hidden")
    assert sweep.launch == ["-n", "2"] and sweep.settings == [f"run.dir={tmp_path}", "trainer.max_steps=4"]
    assert sweep.space == {"model.lr": "loguniform(1e-3,1e-1)", "model.hidden": "range(8,33,8)"}
    assert (sweep.monitor, sweep.mode, sweep.direction) == ("loss", "min", "minimize")
    assert (sweep.trials, sweep.seed, sweep.pruner, sweep.startup, sweep.sampler) == (5, 7, "halving", 5, "tpe")
    assert sweep.mlflow_store == ""
    tracked = _plan(tmp_path, "model.lr=choice(0.1)", "log.mlflow=true", "--monitor", "loss", "--mode", "min")
    assert tracked.mlflow_store == f"sqlite:///{tracked.folder}/mlflow.db" and tracked.trials == 10
    own_store = _plan(tmp_path, "model.lr=choice(0.1)", "log.mlflow=true", "log.mlflow_uri=http://tracking:5000",
                      "--monitor", "loss", "--mode", "min")  # fmt: skip
    assert own_store.mlflow_store == ""
    deep = _plan(tmp_path, "trainer.early_stop.patience=range(1,3)", "--monitor", "loss", "--mode", "min",
                 "--pruner-startup", "0")  # fmt: skip
    assert deep.folder.endswith("sweep-patience") and deep.startup == 0
    with pytest.raises(DdplabError, match="--pruner-startup -1 is below 0"):
        _plan(tmp_path, "model.lr=choice(0.1)", "--monitor", "loss", "--mode", "min", "--pruner-startup", "-1")
    assert sweep.reproduce(["model.lr=0.01", "model.hidden=16"]) == (
        f"ddplab run {EXP} -n 2 run.dir={tmp_path} trainer.max_steps=4 model.lr=0.01 model.hidden=16 "
        "checkpoint.monitor=loss checkpoint.mode=min"
    )
    # a mode as the command line gives it: a string of its own
    sweep.mode = "".join(["ma", "x"])
    assert sweep.direction == "maximize"


def test_the_metric_and_its_direction_come_from_the_run_unless_given(tmp_path):
    def chosen(*argv):
        sweep = _plan(tmp_path, "model.lr=choice(0.1)", *argv)
        return sweep.monitor, sweep.mode

    assert chosen("checkpoint.monitor=roc_auc") == ("roc_auc", "max")
    assert _plan(tmp_path, "model.lr=choice(0.1)", "checkpoint.monitor=roc_auc").direction == "maximize"
    with pytest.raises(DdplabError, match="--monitor loss: which way is better"):
        chosen("checkpoint.monitor=roc_auc", "--monitor", "loss")
    assert chosen("checkpoint.monitor=loss", "checkpoint.mode=min") == ("loss", "min")
    assert chosen("checkpoint.monitor=roc_auc", "--mode", "min") == ("roc_auc", "min")
    assert chosen("checkpoint.monitor=roc_auc", "--monitor", "roc_auc") == ("roc_auc", "max")
    assert chosen("trainer.early_stop.monitor=loss") == ("loss", "min")
    assert chosen("trainer.early_stop.monitor=accuracy", "trainer.early_stop.mode=max") == ("accuracy", "max")
    assert chosen("--monitor", "accuracy", "--mode", "max") == ("accuracy", "max")


def test_a_grid_is_each_point_of_its_choices_and_ranges_once(tmp_path):
    from ddplab.launch.sweep import _grid_values

    sweep = _plan(
        tmp_path, "model.lr=choice(0.1,0.2,0.3)", "model.hidden=range(8,20,4)", "data.n_train=range(100,200,50)",
        "--monitor", "loss", "--mode", "min", "--sampler", "grid", "--trials", "100",
    )  # fmt: skip
    assert sweep.trials == 3 * 3 * 2
    assert [_grid_values(k, p) for k, p in sweep.params.items()] == [[0.1, 0.2, 0.3], [8, 12, 16], [100, 150]]
    space, _ = split_space(["k=range(0,1,0.25)", "j=range(0,0.4,0.1)"])
    assert _grid_values("k", space["k"]) == [0.0, 0.25, 0.5, 0.75]
    assert _grid_values("j", space["j"]) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    # the sampler's name as a command line gives it: a string of its own
    grid = "".join(["gr", "id"])
    assert (
        _plan(tmp_path, "model.lr=choice(0.1,0.2)", "--monitor", "loss", "--mode", "min", "--sampler", grid).trials == 2
    )
    assert _plan(tmp_path, "model.lr=choice(0.1,0.2)", "--monitor", "loss", "--mode", "min", "--sampler", "grid",
                 "--trials", "1").trials == 1  # fmt: skip


def test_a_seeded_sampler_draws_anew_for_each_trial_even_after_a_restart(tmp_path):
    from ddplab.launch.sweep import _sampler

    sweep = _plan(tmp_path, "model.lr=interval(0,1)", "--monitor", "loss", "--mode", "min", "--seed", "11")
    for name, kind in (
        ("tpe", optuna.samplers.TPESampler),
        ("random", optuna.samplers.RandomSampler),
        ("grid", optuna.samplers.GridSampler),
    ):
        # the name as the command line gives it: a string of its own
        sweep.sampler = "".join(name)
        if name == "grid":
            sweep.params = split_space(["model.lr=choice(0.1,0.2)"])[0]
        # the grid: Optuna's, trying a failed point again first
        assert isinstance(_sampler(sweep, 0), kind)
    sweep.sampler = "random"
    draws = [_sampler(sweep, started)._rng.rng.random_sample() for started in (0, 1, 0)]
    expected = optuna.samplers.RandomSampler(seed=12)._rng.rng.random_sample()
    assert draws[0] == draws[2] != draws[1] == expected
    sweep.seed = None
    assert _sampler(sweep, 0)._rng.rng.random_sample() != _sampler(sweep, 0)._rng.rng.random_sample()


def test_a_sweep_folder_holds_one_sweep_and_one_process_at_a_time(tmp_path):
    from ddplab.launch.sweep import _held, _record

    args = ["model.lr=choice(0.1,0.2)", "--monitor", "loss", "--mode", "min"]
    sweep = _plan(tmp_path, *args)
    os.makedirs(sweep.folder)
    _record(sweep)
    # the same command with more trials is the same sweep
    _record(_plan(tmp_path, *args, "--trials", "20"))
    with pytest.raises(DdplabError, match=r"holds another sweep \(its space, monitor differ"):
        _record(_plan(tmp_path, "model.lr=choice(0.1,0.3)", "--monitor", "accuracy", "--mode", "min"))
    with _held(sweep.folder), pytest.raises(DdplabError, match="is running in another process"), _held(sweep.folder):
        pass
    with _held(sweep.folder):
        pass


def test_the_sweeps_loop_resumes_what_was_running_asks_until_enough_ended_and_prints_the_best(
    tmp_path, monkeypatch, capsys
):
    """The loop's policy, with each trial's run replaced by telling the study a scripted end (the
    runs themselves are test_sweeps.py's): a failed trial is not counted and stops the sweep, a
    trial a killed sweep left running is run first, and the best is the best finished one."""
    from optuna.trial import TrialState

    from ddplab.launch import sweep as sweep_module

    ran, script, checks = [], [], []

    def fake_trial(study, trial, sweep, storage, ended):
        ran.append((trial.number, ended))
        end = script.pop(0)
        if end == "fail":
            study.tell(trial.number, state=TrialState.FAIL)
            return 2
        if end == "stop":
            return 143
        if end == "pruned":
            study.tell(trial.number, state=TrialState.PRUNED)
        else:
            study.tell(trial.number, end)
        return 0

    monkeypatch.setattr(sweep_module, "run_trial", fake_trial)
    monkeypatch.setattr(sweep_module, "check_first_trial", lambda sweep: checks.append(sweep.folder))
    argv = [
        "sweep", EXP, f"run.dir={tmp_path}", "model.hidden=range(8,64)", "--monitor", "accuracy", "--mode", "max",
        "--trials", "4", "--seed", "1",
    ]  # fmt: skip

    def sweep_once(*ends):
        script[:] = list(ends)
        from ddplab.launch.cli import main

        code = main(argv)
        assert script == []
        return code

    assert sweep_once(0.5, "fail") == 2 and ran == [(0, 0), (1, 1)]
    assert len(checks) == 1
    # trial 2 is left running, as by a killed sweep
    assert sweep_once(0.7, "stop") == 143 and ran[2:] == [(2, 1), (3, 2)]
    assert sweep_once(0.9, "pruned") == 0
    # the interrupted trial first, then new ones until four ended (a pruned one counts, a failed one not)
    assert ran[4:] == [(3, 2), (4, 3)] and len(checks) == 1
    out = capsys.readouterr().out.strip().splitlines()
    study = optuna.load_study(
        study_name="sweep-hidden", storage=f"sqlite:///{tmp_path}/classifier/sweep-hidden/study.db"
    )
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE", "PRUNED"]
    best = study.trials[3]
    assert out[-4] == (
        "sweep sweep-hidden: 3 trials finished, 1 pruned, 1 failed (trial 1: not counted); best: trial 3, "
        "eval/accuracy 0.9 (max) with "
        f"model.hidden={best.params['model.hidden']}"
    )
    assert out[-3] == f"  its run: {tmp_path}/classifier/sweep-hidden/classifier/trial-003"
    # a finished sweep given again prints its best and runs nothing, also with fewer --trials
    assert sweep_once() == 0 and len(ran) == 6
    argv[argv.index("--trials") + 1] = "2"
    assert sweep_once() == 0 and len(ran) == 6
