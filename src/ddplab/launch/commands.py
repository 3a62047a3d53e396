"""The command-line parts of the collectives tour (`ddplab collectives`) and of `ddplab bench comm`:
their options, checked before any process starts, become the settings of the programs they launch."""

import argparse
import os

from ..errors import DdplabError


def add_commands(sub) -> None:
    tour = sub.add_parser(
        "collectives",
        help="run torch.distributed's primitives on N processes and show each rank",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tour.add_argument("-h", "--help", action=_HelpWithPrimitives, nargs=0, help="show this help message and exit")
    tour.add_argument("ops", nargs="*", help="primitives to run (default: all); see the list below")
    tour.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=2)
    tour.add_argument("--backend", default="gloo", help="gloo (default), nccl, or auto")
    tour.add_argument("--json", default="", help="also write every rank's before/after values to this file")
    tour.set_defaults(handler=collectives_tour)

    bench = sub.add_parser("bench", help="measurements: `ddplab bench comm`")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    comm = bench_sub.add_parser("comm", help="latency and bandwidth of collectives over message sizes")
    comm.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=2)
    comm.add_argument("--backend", default="auto")
    comm.add_argument("--sizes", default="", help="comma-separated byte sizes, e.g. 8,1K,64M (default 8 B .. 64 MB)")
    comm.add_argument("--ops", default="", help="comma-separated: all_reduce,all_gather,broadcast,reduce_scatter")
    comm.add_argument("--iters", type=int, default=0, help="timed iterations per size (default: adaptive)")
    comm.add_argument("--json", default="", help="write the results here")
    comm.set_defaults(handler=bench_comm)


class _HelpWithPrimitives(argparse.Action):
    """The tour's --help, with its primitives listed below: read only when asked (the tour imports torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..experiments.collectives_tour import DEMOS

        parser.epilog = "primitives:\n" + "\n".join(f"  {name:24} {what}" for name, (_, what) in DEMOS.items())
        parser.print_help()
        parser.exit()


def collectives_tour(args: argparse.Namespace, rest: list[str]) -> int:
    from ..experiments.collectives_tour import DEMOS
    from .launcher import launch_function

    _check_writable(args.json)
    unknown = [op for op in args.ops if op not in DEMOS]
    if unknown:
        raise DdplabError(f"unknown primitive(s) {unknown}", f"choose from: {', '.join(DEMOS)}")
    settings = [
        f"tour.ops=[{','.join(args.ops)}]",
        f"dist.backend={args.backend}",
        "dist.timeout_s=60",
        *([f"tour.json={os.path.abspath(args.json)}"] if args.json else []),
    ]
    return launch_function("ddplab.experiments.collectives_tour:run_tour", settings, args.nproc, 60)


def bench_comm(args: argparse.Namespace, rest: list[str]) -> int:
    from ..tools.commbench import OPS, parse_sizes
    from .launcher import launch_function

    _check_writable(args.json)
    ops = [o for o in args.ops.split(",") if o] or list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise DdplabError(f"unknown op(s) {bad} for bench comm", f"choose from {', '.join(OPS)}")
    sizes = parse_sizes(args.sizes)
    settings = [
        f"bench.ops=[{','.join(ops)}]",
        f"bench.sizes=[{','.join(map(str, sizes))}]",
        f"bench.iters={args.iters}",
        f"dist.backend={args.backend}",
        "dist.timeout_s=300",
        *([f"bench.json={os.path.abspath(args.json)}"] if args.json else []),
    ]
    return launch_function("ddplab.tools.commbench:run_bench", settings, args.nproc, 300)


def _check_writable(path: str) -> None:
    """--json is checked before the measurement runs, not after: a result that cannot be written is lost."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise DdplabError(f"--json {path} is a folder", f"name a file, e.g. --json {os.path.join(path, 'result.json')}")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise DdplabError(
            f"--json {path}: cannot write in {folder}", "name a file in a folder that exists and is writable"
        )
