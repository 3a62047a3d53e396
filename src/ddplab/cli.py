"""The `ddplab` command line: run, eval, checkpoints, report, collectives, bench comm, doctor.

Every user mistake ends as one line `ddplab: error: <cause>; <fix>` and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

# torch's C++ layer logs every socket retry, with C++ stack traces, to stderr. ddplab turns those
# failures into one-line errors; set TORCH_CPP_LOG_LEVEL=INFO to see the raw logs when debugging.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from .errors import USER_ERROR_EXIT_CODE, DdplabError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if rest and args.command not in ("run", "eval"):  # only run/eval take key=value settings
            raise DdplabError(f"unexpected argument(s) {rest}", f"see `ddplab {args.command} --help`")
        return args.handler(args, rest)
    except DdplabError as e:
        print(f"ddplab: error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


def _parser() -> argparse.ArgumentParser:
    from .launch import add_launch_flags

    parser = argparse.ArgumentParser(prog="ddplab", description="Distributed data-parallel PyTorch experiments.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an experiment or script on one or many processes",
                         description="Run TARGET: a registered experiment name, path/to/file.py[:Name] or a module. "
                                     "Settings follow as key=value.")
    run.add_argument("target")
    run.add_argument("--config", default=None, help="YAML file with settings (key=value overrides win)")
    add_launch_flags(run)
    run.set_defaults(handler=_cmd_run)

    ev = sub.add_parser("eval", help="evaluate a checkpoint (exact distributed evaluation) and write JSON",
                        description="Evaluate the networks of a checkpoint on TARGET's eval set.")
    ev.add_argument("target")
    ev.add_argument("--checkpoint", required=True, help="a checkpoint directory, its state.pt, or a run directory")
    ev.add_argument("--out", default=None, help="JSON file for the metrics (default: eval.json next to the checkpoint)")
    ev.add_argument("--config", default=None)
    add_launch_flags(ev)
    ev.set_defaults(handler=_cmd_eval)

    tour = sub.add_parser("collectives", help="run torch.distributed's primitives on N processes and show each rank")
    tour.add_argument("ops", nargs="*", help="primitives to run (default: all); see the list below")
    tour.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=2)
    tour.add_argument("--backend", default="gloo", help="gloo (default), nccl, or auto")
    tour.add_argument("--json", default="", help="also write every rank's before/after values to this file")
    tour.set_defaults(handler=_cmd_collectives)

    bench = sub.add_parser("bench", help="measurements: `ddplab bench comm`")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    comm = bench_sub.add_parser("comm", help="latency and bandwidth of collectives over message sizes")
    comm.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=2)
    comm.add_argument("--backend", default="auto")
    comm.add_argument("--sizes", default="", help="comma-separated byte sizes, e.g. 8,1K,64M (default 8 B .. 64 MB)")
    comm.add_argument("--ops", default="", help="comma-separated: all_reduce,all_gather,broadcast,reduce_scatter")
    comm.add_argument("--iters", type=int, default=0, help="timed iterations per size (default: adaptive)")
    comm.add_argument("--json", default="", help="write the results here")
    comm.set_defaults(handler=_cmd_bench_comm)

    ck = sub.add_parser("checkpoints", help="list a run's checkpoints: step, epoch, metric, size, latest/best")
    ck.add_argument("run_dir")
    ck.set_defaults(handler=_cmd_checkpoints)

    rep = sub.add_parser("report", help="draw runs' curves (loss, evaluation, lr, throughput) as PNGs; print a summary")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one run, or several to overlay")
    rep.add_argument("--out", default=None,
                     help="folder for the PNGs (default: RUN_DIR/results/report for one run, ./report for several)")
    rep.set_defaults(handler=_cmd_report)

    doctor = sub.add_parser("doctor", help="check this machine: torch, backends, devices, a 2-process all_reduce")
    doctor.set_defaults(handler=_cmd_doctor)
    return parser


def _cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    return _start(args, rest, ["run"], None)


def _cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    flags = ["eval", "--checkpoint", args.checkpoint, *(["--out", args.out] if args.out else [])]
    return _start(args, rest, flags, (args.checkpoint, args.out))


def _cmd_collectives(args: argparse.Namespace, rest: list[str]) -> int:
    from .launch import LaunchOptions, launch
    from .tour import DEMOS

    unknown = [op for op in args.ops if op not in DEMOS]
    if unknown:
        raise DdplabError(f"unknown primitive(s) {unknown}", f"choose from: {', '.join(DEMOS)}")
    ops = "[" + ",".join(args.ops) + "]"
    worker = ["run", "ddplab.tour:run_tour", f"tour.ops={ops}", f"dist.backend={args.backend}", "dist.timeout_s=60",
              *([f"tour.json={os.path.abspath(args.json)}"] if args.json else [])]
    return launch(LaunchOptions(nproc_per_node=str(args.nproc)), worker, timeout_s=60)


def _cmd_bench_comm(args: argparse.Namespace, rest: list[str]) -> int:
    from .commbench import OPS, parse_sizes
    from .launch import LaunchOptions, launch

    ops = [o for o in args.ops.split(",") if o] or list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise DdplabError(f"unknown op(s) {bad} for bench comm", f"choose from {', '.join(OPS)}")
    sizes = parse_sizes(args.sizes)
    worker = ["run", "ddplab.commbench:run_bench", f"bench.ops=[{','.join(ops)}]",
              f"bench.sizes=[{','.join(map(str, sizes))}]", f"bench.iters={args.iters}", f"dist.backend={args.backend}",
              "dist.timeout_s=300", *([f"bench.json={os.path.abspath(args.json)}"] if args.json else [])]
    return launch(LaunchOptions(nproc_per_node=str(args.nproc)), worker, timeout_s=300)


def _cmd_checkpoints(args: argparse.Namespace, rest: list[str]) -> int:
    from .listing import print_checkpoints

    return print_checkpoints(args.run_dir)


def _cmd_report(args: argparse.Namespace, rest: list[str]) -> int:
    from .report import report

    return report(args.run_dirs, args.out)


def _start(args: argparse.Namespace, rest: list[str], command: list[str], evaluate) -> int:
    """Launch workers that run `command` on the target, or be the worker and run it here."""
    from .cluster import detect, sagemaker_procs_per_host
    from .config import dist_overrides, split_overrides
    from .launch import launch, options_from_args, sagemaker_options, should_launch

    overrides, extra = split_overrides(rest)
    _reject_unknown_flags(extra, args.target)
    dist_cfg = dist_overrides(overrides)
    opts, explicit = options_from_args(args)
    env = os.environ
    by_hand = dist_cfg.rank is not None or dist_cfg.world_size is not None or dist_cfg.init_method is not None
    on_sagemaker = "SM_HOSTS" in env and "TORCHELASTIC_RUN_ID" not in env and not by_hand
    if on_sagemaker:
        opts = sagemaker_options(opts, detect(env), sagemaker_procs_per_host(env))
    if on_sagemaker or should_launch(explicit, opts, env, by_hand):
        _check_before_launch(args, overrides, dist_cfg, opts)
        worker_args = [*command, args.target, *(["--config", args.config] if args.config else []), *overrides, *extra]
        return launch(opts, worker_args, dist_cfg.timeout_s)
    from .worker import exit_now, run_target

    exit_now(run_target(args.target, overrides, extra, args.config, evaluate))
    return 0  # not reached


def _check_before_launch(args, overrides, dist_cfg, opts) -> None:
    """Catch config and backend mistakes once, here, instead of once per started worker."""
    from .config import Config, load_config
    from .runtime import choose_backend
    from .targets import resolve

    target = resolve(args.target)
    if not target.is_script:
        cfg = load_config(getattr(target.obj, "config_class", Config), overrides, args.config)
        if opts.nproc_per_node.isdigit() and opts.nnodes.isdigit() and hasattr(cfg, "trainer"):
            from .data import BatchPlan

            world = int(opts.nproc_per_node) * int(opts.nnodes)
            BatchPlan(cfg.trainer.global_batch_size, world, cfg.trainer.accumulate)
    if opts.nproc_per_node.isdigit():
        backend = choose_backend(dist_cfg.backend, int(opts.nproc_per_node))
        if backend == "nccl":
            _check_gpu_count(int(opts.nproc_per_node))


def _check_gpu_count(nproc: int) -> None:
    import torch

    gpus = torch.cuda.device_count()
    if gpus < nproc:
        raise DdplabError(
            f"-n {nproc} with dist.backend=nccl but only {gpus} GPUs are visible, so two ranks would share one GPU",
            f"use -n {gpus} or dist.backend=gloo",
        )


def _reject_unknown_flags(extra: list[str], target: str) -> None:
    flags = [a for a in extra if a.startswith("-")]
    if flags and not target.endswith(".py") and ":" not in target and "." not in target:
        raise DdplabError(f"unknown option {flags[0]}", "see `ddplab run --help`; settings are given as key=value")


def _cmd_doctor(args: argparse.Namespace, rest: list[str]) -> int:
    from .doctor import doctor

    return doctor()


if __name__ == "__main__":
    sys.exit(main())
