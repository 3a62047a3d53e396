"""`ddplab sweep`: tune an experiment with Optuna, every trial a full ddplab run.

The sweep asks its study for a trial, starts `ddplab run` with the trial's values as key=value
settings (so every rank reads them from the run plan, never draws its own), and tells the study the
run's best value of the monitored metric. The study lives in SWEEP/study.db (Optuna's SQLite
storage), the trials' run folders in SWEEP/<experiment>/trial-NNN: after a kill the same command
goes on, finished trials kept and the interrupted one resumed from its checkpoint."""

import contextlib
import fcntl
import json
import math
import os
import shlex
from dataclasses import asdict, dataclass, field

from ..checkpoint.objects import is_url
from ..config import Config, load_config, split_overrides
from ..errors import ConfigError, DdplabError
from ..tools.sweeps import SWEEP_FILE
from ..train.pruning import PRUNERS, make_pruner, quiet_optuna
from .space import Param, as_setting, split_space
from .targets import resolve
from .trials import SAMPLERS, check_first_trial, run_trial

# the study, beside sweep.json and the trials' run folders
STUDY_FILE = "study.db"


@dataclass
class Sweep:
    """How a sweep was asked for (SWEEP/sweep.json). The same command must find the same sweep:
    every field but `trials` is compared when a sweep is continued."""

    target: str
    experiment: str  # its run.dir subfolder
    folder: str
    launch: list[str]  # the launch flags (-n 2 ...), given to every trial
    settings: list[str]  # the key=value settings every trial shares
    space: dict[str, str]  # key -> its space as given, e.g. loguniform(1e-4,1e-1)
    monitor: str
    mode: str  # max | min
    sampler: str
    pruner: str
    startup: int
    seed: int | None
    config: str | None = None  # --config FILE
    trials: int = 10
    params: dict = field(default_factory=dict, repr=False)  # key -> Param, not saved
    # with log.mlflow=true and no log.mlflow_uri: one MLflow store for every trial, SWEEP/mlflow.db
    mlflow_store: str = field(default="", repr=False)

    @property
    def direction(self) -> str:
        return "maximize" if self.mode == "max" else "minimize"

    def reproduce(self, values: list[str]) -> str:
        """The command that trains one trial's settings again as a run of its own (its summary's
        best value the one the sweep optimized)."""
        config = ["--config", self.config] if self.config else []
        monitor = [f"checkpoint.monitor={self.monitor}", f"checkpoint.mode={self.mode}"]
        return shlex.join(["ddplab", "run", self.target, *self.launch, *config, *self.settings, *values, *monitor])


def add_command(sub) -> None:
    from .launcher import add_launch_flags

    cmd = sub.add_parser(
        "sweep",
        help="tune an experiment with Optuna: every trial a full run, pruned and resumed like one",
        description="TARGET: an experiment. Settings follow as key=value; a searched one as key=choice(a,b,...), "
        "key=range(start,stop[,step]), key=interval(low,high) or key=loguniform(low,high).",
    )
    cmd.add_argument("target")
    cmd.add_argument("--trials", type=int, default=10, help="finished trials the sweep ends with (default 10)")
    cmd.add_argument("--monitor", help="the evaluation metric to optimize (default: checkpoint.monitor)")
    cmd.add_argument("--mode", choices=("max", "min"), help="which way is better (default: checkpoint.mode)")
    cmd.add_argument("--name", help="the sweep's folder, RUN_DIR/<experiment>/NAME (default: sweep-<keys>)")
    cmd.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna's sampler (default tpe)")
    cmd.add_argument("--pruner", choices=PRUNERS, default="median", help="Optuna's pruner (default median)")
    cmd.add_argument(
        "--pruner-startup", type=int, default=5, help="trials run in full before the median pruner judges (default 5)"
    )
    cmd.add_argument("--seed", type=int, default=None, help="the sampler's seed")
    cmd.add_argument("--config", default=None, help="YAML file with settings every trial shares")
    add_launch_flags(cmd)
    cmd.set_defaults(handler=sweep_command)


def sweep_command(args, rest: list[str]) -> int:
    """Plan and check the sweep, then run trials until `--trials` have finished."""
    import optuna

    quiet_optuna()
    sweep = plan_sweep(args, rest)
    os.makedirs(sweep.folder, exist_ok=True)
    with _held(sweep.folder):
        _record(sweep)
        storage = f"sqlite:///{os.path.join(sweep.folder, STUDY_FILE)}"
        study = optuna.create_study(
            study_name=os.path.basename(sweep.folder),
            storage=storage,
            load_if_exists=True,
            direction=sweep.direction,
            pruner=make_pruner(sweep.pruner, sweep.startup),
        )
        if not study.trials:
            check_first_trial(sweep)
        return _run_trials(study, sweep, storage)


def _run_trials(study, sweep: Sweep, storage: str) -> int:
    from optuna.trial import TrialState

    # trials a killed sweep left running: resumed from their checkpoints, as they were
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        code = run_trial(study, trial, sweep, storage, len(_ended(study)))
        if code:
            return code
    while len(_ended(study)) < sweep.trials:
        study.sampler = _sampler(sweep, len(study.trials))
        trial = study.ask({key: p.distribution for key, p in sweep.params.items()})
        code = run_trial(study, study.trials[trial.number], sweep, storage, len(_ended(study)))
        if code:
            return code
    _print_best(study, sweep)
    return 0


def plan_sweep(args, rest: list[str]) -> Sweep:
    """Every mistake in the command, one line each, before any trial starts."""
    from .launcher import check_options, launch_flags, options_from_args

    if args.trials < 1:
        raise DdplabError(f"--trials {args.trials}: a sweep needs at least one trial", "pass --trials K with K >= 1")
    if args.pruner_startup < 0:
        raise DdplabError(f"--pruner-startup {args.pruner_startup} is below 0", "pass 0 or more")
    opts, _ = options_from_args(args)
    check_options(opts)
    if not opts.single_node:
        raise DdplabError(
            f"--nnodes {opts.nnodes}: a sweep runs its trials on this node", "leave --nnodes out (-n N ranks each)"
        )
    settings, extra = split_overrides(rest)
    if extra:
        raise DdplabError(f"unexpected argument(s) {extra}", "see `ddplab sweep --help`; settings are key=value")
    space, fixed = split_space(settings)
    if not space:
        raise DdplabError("nothing to search", "give at least one key=choice(...), range(...), interval(...) or ...")
    if any(item.startswith("run.name=") for item in fixed):
        raise DdplabError("run.name is set by the sweep (trial-NNN)", "leave it out; --name names the sweep")
    experiment, cfg = _check_settings(args, space, fixed)
    if is_url(cfg.run.dir):
        raise DdplabError(
            f"run.dir={cfg.run.dir}: a sweep keeps its study and trials in a local folder",
            "give run.dir a folder (a shared disk for several machines); a single run may train into a bucket",
        )
    monitor, mode = _monitor(args, cfg)
    name = args.name or "sweep-" + "-".join(key.split(".")[-1] for key in space)
    folder = os.path.abspath(os.path.join(cfg.run.dir, experiment, name))
    trials = args.trials
    if args.sampler == "grid":
        # the grid's points, each tried once
        trials = min(trials, math.prod(len(_grid_values(key, p)) for key, p in space.items()))
    return Sweep(
        target=args.target,
        experiment=experiment,
        folder=folder,
        launch=launch_flags(opts),
        settings=fixed,
        space={key: p.text for key, p in space.items()},
        monitor=monitor,
        mode=mode,
        sampler=args.sampler,
        pruner=args.pruner,
        startup=args.pruner_startup,
        seed=args.seed,
        config=os.path.abspath(args.config) if args.config else None,
        trials=trials,
        params=space,
        mlflow_store="" if cfg.log.mlflow_uri or not cfg.log.mlflow else f"sqlite:///{folder}/mlflow.db",
    )


def _check_settings(args, space: dict[str, Param], fixed: list[str]):
    """The experiment's name, and its config with the shared settings: each searched key must be a
    setting, and take each end of its space (every value of a choice)."""
    # here, not above: `ddplab --help` builds this command's parser without torch
    from ..experiment import experiment_folder

    found = resolve(args.target)
    if found.is_script:
        raise DdplabError(f"{args.target} is a plain script", "a sweep needs an experiment: NAME or file.py:Class")
    schema = getattr(found.obj, "config_class", Config)
    cfg = load_config(schema, fixed, args.config)
    for key, param in space.items():
        d = param.distribution
        for value in getattr(d, "choices", None) or (d.low, d.high):
            try:
                load_config(schema, [*fixed, f"{key}={value}"], args.config)
            except ConfigError as e:
                raise ConfigError(f"search space {key}={param.text}: {e.cause}", e.fix) from None
    return experiment_folder(found.obj), cfg


def _monitor(args, cfg) -> tuple[str, str]:
    """The metric to optimize and which way is better: --monitor/--mode, else the run's own."""
    if args.monitor:
        if args.mode is None and args.monitor != cfg.checkpoint.monitor:
            raise DdplabError(f"--monitor {args.monitor}: which way is better?", "pass --mode max or --mode min")
        return args.monitor, args.mode or cfg.checkpoint.mode
    if cfg.checkpoint.monitor:
        return cfg.checkpoint.monitor, args.mode or cfg.checkpoint.mode
    early = cfg.trainer.early_stop
    if early.monitor:
        return early.monitor, args.mode or early.mode
    raise DdplabError("the sweep has no metric to optimize", "pass --monitor METRIC --mode max|min (an eval metric)")


def _sampler(sweep: Sweep, started: int):
    """Optuna's sampler; a seeded one seeded anew for each trial, so a continued sweep does not draw
    the values of its first trials again."""
    import optuna

    seed = None if sweep.seed is None else sweep.seed + started
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sweep.sampler == "grid":
        grid = {key: _grid_values(key, p) for key, p in sweep.params.items()}
        return _grid_sampler(grid, sweep.seed)
    return optuna.samplers.TPESampler(seed=seed)


def _grid_sampler(grid: dict[str, list], seed: int | None):
    """Optuna's grid, trying a point whose trial failed again before any other: Optuna counts it as
    visited, so a sweep continued after the fix trained another point twice and never this one."""
    import optuna
    from optuna.trial import TrialState

    class RetryingGrid(optuna.samplers.GridSampler):
        def before_trial(self, study, trial) -> None:
            trials = study.get_trials(deepcopy=False)
            tried = {t.system_attrs.get("grid_id") for t in trials if t.state != TrialState.FAIL}
            failed = [t for t in trials if t.state == TrialState.FAIL and t.system_attrs.get("grid_id") not in tried]
            if not failed or "grid_id" in trial.system_attrs:
                super().before_trial(study, trial)
                return
            # what the grid itself records for a point it picks
            for key in ("search_space", "grid_id"):
                study._storage.set_trial_system_attr(trial._trial_id, key, failed[0].system_attrs[key])

    return RetryingGrid(grid, seed=seed)


def _grid_values(key: str, param: Param) -> list:
    d = param.distribution
    if hasattr(d, "choices"):
        return list(d.choices)
    if getattr(d, "step", None):
        count = round((d.high - d.low) / d.step) + 1
        return [d.low + i * d.step for i in range(count)]
    raise DdplabError(
        f"--sampler grid cannot list {key}={param.text}", "use choice(...) or range(...), or another sampler"
    )


def _ended(study) -> list:
    """Trials that count towards --trials: finished or pruned (a failed one is tried again)."""
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


def _print_best(study, sweep: Sweep) -> None:
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    pruned = len(_ended(study)) - len(done)
    head = f"sweep {os.path.basename(sweep.folder)}: {len(done)} trials finished, {pruned} pruned"
    if failed := [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))]:
        again = "each point tried again" if sweep.sampler == "grid" else "not counted"
        head += f", {len(failed)} failed ({', '.join(f'trial {n}' for n in failed)}: {again})"
    if not done:
        print(f"{head}; none finished, so there is no best trial", flush=True)
        return
    best = study.best_trial
    values = [as_setting(key, best.params[key]) for key in sweep.space]
    run = os.path.join(sweep.folder, sweep.experiment, f"trial-{best.number:03d}")
    print(
        f"{head}; best: trial {best.number}, eval/{sweep.monitor} {best.value:.6g} ({sweep.mode}) "
        f"with {' '.join(values)}\n  its run: {run}\n  to train it again: {sweep.reproduce(values)}\n"
        f"  every trial: ddplab runs {sweep.folder}; drawn: ddplab report {sweep.folder}",
        flush=True,
    )


def _record(sweep: Sweep) -> None:
    """Write sweep.json, or check that the sweep found in the folder is the one asked for."""
    path = os.path.join(sweep.folder, SWEEP_FILE)
    mine = {k: v for k, v in asdict(sweep).items() if k not in ("params", "mlflow_store")}
    if os.path.exists(path):
        with open(path) as f:
            theirs = json.load(f)
        differ = [k for k in mine if k != "trials" and theirs.get(k) != mine[k]]
        if differ:
            raise DdplabError(
                f"{sweep.folder} holds another sweep (its {', '.join(differ)} differ from this command's)",
                "pass --name NEW for a new sweep, or the same command to continue that one",
            )
    with open(path, "w") as f:
        json.dump(mine, f, indent=1)


@contextlib.contextmanager
def _held(folder: str):
    """One `ddplab sweep` per sweep folder at a time; the OS lets go when it ends, even killed."""
    with open(os.path.join(folder, ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DdplabError(
                f"the sweep {folder} is running in another process", "wait for it, or stop it first"
            ) from None
        yield
