"""The `ddplab` command line: run, eval, predict, sweep, runs, checkpoints, report, collectives, bench
comm, doctor, rendezvous.

Every user mistake ends as one line `ddplab: error: <cause>; <fix>` and exit code 2."""

import argparse
import importlib
import math
import os
import sys
import tempfile

from .. import environment
from ..errors import USER_ERROR_EXIT_CODE, DdplabError
from ..experiments import REGISTRY

# torch's C++ log (a store's connection retries, gloo's warnings) reads its level as torch loads:
# quiet it before, in this process and in every one a command starts
CPP_LOG = (environment.CPP_LOG_LEVEL, "FATAL")
os.environ.setdefault(*CPP_LOG)


def _version() -> str:
    """'ddplab 0.1.0 (torch 2.13.0)', read from the installed packages' records: no torch import."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"ddplab {__version__} (torch {torch})"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if rest and args.command not in ("run", "eval", "predict", "sweep"):
            # only these take key=value settings
            raise DdplabError(f"unexpected argument(s) {rest}", f"see `ddplab {args.command} --help`")
        return args.handler(args, rest)
    except (DdplabError, OSError) as e:
        # OSError: e.g. `ddplab report` on a read-only run folder
        why = (
            e if isinstance(e, DdplabError) else f"cannot write {e.filename} ({e.strerror}); pass --out PATH elsewhere"
        )
        print(f"ddplab: error: {why}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddplab", description="Distributed data-parallel PyTorch experiments.")
    parser.add_argument("--version", action="version", version=_version(), help="ddplab's version and torch's")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_experiment_commands(sub)
    _add_tool_commands(sub)
    return parser


def _add_experiment_commands(sub) -> None:
    """run, eval and predict: they start processes that run an experiment, so they take torchrun's flags."""
    from .launcher import add_launch_flags

    for name, help in (
        ("run", "run an experiment or script on one or many processes"),
        ("eval", "evaluate a checkpoint (exact distributed evaluation), write JSON"),
    ):
        cmd = sub.add_parser(
            name,
            help=help,
            description="TARGET: a registered experiment name, "
            "path/to/file.py[:Name] or a module. Settings follow as key=value.",
            # by name only: listing them imports none
            epilog=f"experiments that ship with ddplab: {', '.join(REGISTRY)}",
        )
        cmd.add_argument("target")
        cmd.add_argument("--config", default=None, help="YAML file with settings (key=value overrides win)")
        cmd.add_argument("--show-config", action="store_true", help="print every setting of TARGET and exit")
        add_launch_flags(cmd)
        cmd.set_defaults(handler=_start)
        if name == "eval":
            cmd.add_argument("--checkpoint", required=True, help="a checkpoint folder, its state.pt, or a run folder")
            cmd.add_argument(
                "--out", default=None, help="JSON file for the metrics (default: RUN/results/eval-STEP.json)"
            )
            cmd.add_argument("--set", dest="eval_set", help="one of the eval sets, when eval_dataset() returns several")

    pred = sub.add_parser(
        "predict", help="write a trained model's outputs for every row of a file or dataset, in order"
    )
    pred.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT")
    pred.add_argument(
        "--input",
        required=True,
        help="a file the experiment's predict_dataset() reads, or a dataset "
        "of the experiment: train, eval, or an eval set's name",
    )
    pred.add_argument("--out", required=True, help="FILE.csv or FILE.jsonl: one row per input row, in input order")
    add_launch_flags(pred)
    pred.set_defaults(handler=_predict, show_config=False)


def _add_tool_commands(sub) -> None:
    from . import elastic, replicas, sweep
    from .commands import add_commands

    # the collectives tour and `ddplab bench comm`, beside the programs they run
    add_commands(sub)
    elastic.add_command(sub)
    replicas.add_command(sub)
    sweep.add_command(sub)
    ck = sub.add_parser("checkpoints", help="list a run's checkpoints: step, epoch, metric, size, latest/best")
    ck.add_argument("run_dir")
    ck.set_defaults(handler=lambda args, rest: _tool("listing").print_checkpoints(args.run_dir))

    runs = sub.add_parser("runs", help="list runs: status (running, finished, killed and resumable...), step, best")
    runs.add_argument("run_dir", nargs="?", default="runs", metavar="DIR", help="the run.dir (default: runs)")
    runs.add_argument("--json", action="store_true", help="a JSON list, for scripts")
    runs.set_defaults(handler=lambda args, rest: _tool("listing").print_runs(args.run_dir, args.json))

    rep = sub.add_parser("report", help="draw runs' curves (loss, evaluation, lr, throughput) as PNGs; print a summary")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one run, or several to overlay")
    rep.add_argument(
        "--out",
        default=None,
        help="folder for the PNGs (default: RUN_DIR/results/report for one run, ./report for several)",
    )
    rep.set_defaults(handler=lambda args, rest: _tool("report").report(args.run_dirs, args.out))

    doctor = sub.add_parser("doctor", help="check this machine: torch, backends, devices, a 2-process all_reduce")
    # the doctor starts real processes with the launcher's own function
    launcher = "ddplab.launch.launcher"
    doctor.set_defaults(
        handler=lambda args, rest: _tool("doctor").doctor(importlib.import_module(launcher).launch_function)
    )


def _tool(name: str):
    """A module of ddplab.tools, imported when its command runs, so `ddplab --help` stays quick."""
    return importlib.import_module(f"ddplab.tools.{name}")


def _start(args: argparse.Namespace, rest: list[str]) -> int:
    """`ddplab run` and `ddplab eval`: plan the run once; then launch workers that run the plan, or
    be the worker and run it here."""
    from ..config import dist_overrides, split_overrides
    from ..distributed.cluster import detect, sagemaker_procs_per_host
    from . import replicas, stops
    from .launcher import launch, options_from_args, sagemaker_options, should_launch
    from .plan import make_plan
    from .scratch import scratch_folder

    overrides, extra = split_overrides(rest)
    # a script's own flags are its business, not ours
    flags = [a for a in extra if a.startswith("-")]
    if flags and not args.target.endswith(".py") and ":" not in args.target and "." not in args.target:
        raise DdplabError(f"unknown option {flags[0]}", "see `ddplab run --help`; settings are given as key=value")
    if args.show_config:
        return _show_config(args.target, overrides, args.config)
    plan = make_plan(
        args.command,
        args.target,
        rest,
        args.config,
        **{
            k: getattr(args, k)
            for k in ("checkpoint", "out", "eval_set", "input")
            if getattr(args, k, None) is not None
        },
    )
    dist_cfg = dist_overrides(overrides)
    opts, explicit = options_from_args(args)
    if replicas.is_live(plan):
        return replicas.launch_replicas(plan, replicas.count(opts), opts.max_restarts)
    env = os.environ
    by_hand = dist_cfg.rank is not None or dist_cfg.world_size is not None or dist_cfg.init_method is not None
    on_sagemaker = environment.SAGEMAKER_HOSTS in env and environment.ELASTIC_RUN_ID not in env and not by_hand
    if on_sagemaker:
        opts = sagemaker_options(opts, detect(env), sagemaker_procs_per_host(env))
    if explicit and by_hand and environment.ELASTIC_RUN_ID not in env:
        given = [f"dist.{key}" for key in ("rank", "world_size", "init_method") if getattr(dist_cfg, key) is not None]
        raise DdplabError(
            f"launch flags start the ranks and connect them, and {', '.join(given)} says they are started by hand",
            f"give one or the other: the launch flags, or {' and '.join(given)} without them",
        )
    if on_sagemaker or should_launch(explicit, opts, env, by_hand):
        _check_before_launch(plan, dist_cfg, opts)
        return launch(opts, plan, dist_cfg.timeout_s)
    # this process is the one worker (the launcher's own does not import the worker's modules)
    from .worker import exit_now, run_plan

    with scratch_folder("ddplab-stop-") as scratch:
        stops.prepare(plan, scratch)
        code = run_plan(plan)
        code = stops.report(plan, "SIGINT" if code == 130 else None) or code
    exit_now(code)
    # not reached
    return 0


def _predict(args: argparse.Namespace, rest: list[str]) -> int:
    """`ddplab predict`: the experiment and settings of the run that saved the checkpoint, then as `ddplab eval`."""
    from ..checkpoint.mirror import RunMirror, run_of
    from ..checkpoint.objects import is_url

    if not args.out.endswith((".csv", ".jsonl")):
        raise DdplabError(
            f"--out {args.out}: predictions are written as CSV or JSON lines", "name it FILE.csv or FILE.jsonl"
        )
    if is_url(args.checkpoint):
        # a run in object storage: its record, read into a scratch folder for as long as the job runs
        with tempfile.TemporaryDirectory() as scratch:
            RunMirror(run_of(args.checkpoint), scratch).fetch_record()
            return _predict_with(args, rest, scratch)
    # the run folder, its checkpoint folder, or that folder's state.pt
    run = os.path.abspath(args.checkpoint)
    while not os.path.isfile(os.path.join(run, "run.json")) and os.path.dirname(run) != run:
        run = os.path.dirname(run)
    return _predict_with(args, rest, run)


def _predict_with(args: argparse.Namespace, rest: list[str], run: str) -> int:
    """Predict with the experiment and settings that the record in folder `run` names."""
    from ..train.rundir import read_json

    args.target = read_json(os.path.join(run, "run.json")).get("entry")
    args.config = os.path.join(run, "config.yaml")
    if args.target is None:
        raise DdplabError(
            f"{args.checkpoint} is not in a run folder that names its experiment (run.json)",
            "pass a run folder (runs/<experiment>/<name>) or one of its checkpoints",
        )
    return _start(args, rest)


def _show_config(target: str, overrides: list[str], config_file: str | None) -> int:
    from ..config import Config, describe, load_config
    from .targets import resolve

    obj = resolve(target).obj
    if obj is None:
        raise DdplabError(
            f"{target} is a plain script: ddplab does not know its settings",
            "run it with --help, or give an experiment as file.py:ClassName",
        )
    schema = getattr(obj, "config_class", Config)
    print(describe(schema, load_config(schema, overrides, config_file)))
    return 0


def _check_before_launch(plan, dist_cfg, opts) -> None:
    """Catch batch-plan and backend mistakes once, here, instead of once per started worker (two
    ranks on one GPU are refused by each worker as it binds its device: runtime.bind_device)."""
    from ..distributed.runtime import choose_backend
    from ..distributed.wrapping import check_levers
    from .launcher import check_options, most_nodes

    check_options(opts)
    _, cfg = plan.load()
    if cfg is not None and "log" in cfg and cfg.log.mlflow:
        from ..train.trackers import check_tracking_uri

        check_tracking_uri(cfg.log.mlflow_uri)
    if plan.command == "run" and cfg is not None and opts.nproc_per_node.isdigit() and "trainer" in cfg:
        _check_batch_plans(cfg.trainer, opts)
    if opts.nproc_per_node.isdigit():
        # auto with too few GPUs; nccl with none
        planned = cfg is not None and "dist" in cfg
        backend = choose_backend(cfg.dist.backend if planned else dist_cfg.backend, int(opts.nproc_per_node))
        if planned:
            # the most ranks the job can have (an elastic job may grow to its largest size)
            check_levers(cfg.dist, backend, int(opts.nproc_per_node) * most_nodes(opts))


def _check_batch_plans(trainer, opts) -> None:
    """The global batch must be cut the same way at every world size the job may have: each number
    of nodes from MIN to MAX of an elastic job."""
    from ..errors import ConfigError
    from ..train.data import plan_batches

    per_node = int(opts.nproc_per_node)
    low, _, high = opts.nnodes.partition(":")
    sizes = [per_node * nodes for nodes in range(int(low), int(high or low) + 1)]
    for world in sizes:
        try:
            plan_batches(trainer.global_batch_size, world, trainer.accumulate, trainer.micro_batch_size)
        except ConfigError as e:
            if len(sizes) == 1:
                raise
            serving = _global_batch_for_all(trainer, sizes)
            use = (
                f"trainer.global_batch_size={serving} (it serves every world size from {sizes[0]} to {sizes[-1]}), or "
            )
            raise ConfigError(
                f"{opts.said('nnodes')} with {opts.said('nproc_per_node')} may run on {world} ranks, where {e.cause}",
                f"use {use if serving else ''}a narrower {opts.name_of('nnodes')}",
            ) from None


def _global_batch_for_all(trainer, sizes: list[int]) -> int | None:
    """The global batch nearest above this one (else below) that every world size can keep: a multiple
    of all of them times the accumulation, within trainer.micro_batch_size on the fewest ranks."""
    from ..errors import ConfigError
    from ..train.data import plan_batches

    def serves(batch: int) -> bool:
        try:
            for world in sizes:
                plan_batches(batch, world, trainer.accumulate, trainer.micro_batch_size)
        except ConfigError:
            return False
        return True

    step = math.lcm(*sizes) * (1 if str(trainer.accumulate) == "auto" else int(trainer.accumulate))
    start = -(-trainer.global_batch_size // step)
    above = next((step * k for k in range(start, start + 64) if serves(step * k)), None)
    return above or next((step * k for k in range(start - 1, 0, -1) if serves(step * k)), None)


if __name__ == "__main__":
    sys.exit(main())
