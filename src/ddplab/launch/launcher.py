"""`ddplab run`: start N workers per node through torch's elastic agent (torchrun's engine).

ddplab turns its flags (torchrun's names) into a torchrun command line for `torch.distributed.run` and
makes the outcome readable: a free loopback port when none is given, a busy port reported before
anything starts, a failed run summed up in one line that points at the failing rank's own error."""

import argparse
import ipaddress
import logging
import os
import re
import shlex
import socket
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields

from .. import environment
from ..distributed.cluster import LOOPBACK, ClusterEnv
from ..errors import LaunchError, PortInUse
from . import failures, stops
from .elastic import ELASTIC_RESTARTS, default_restarts, rendezvous_closed, rendezvous_lost, watch_membership
from .plan import RunPlan, make_plan
from .scratch import scratch_folder


@dataclass
class LaunchOptions:
    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str = "ddplab"
    rdzv_conf: str | None = None
    local_addr: str | None = None
    max_restarts: int | None = None  # none given: elastic.default_restarts
    log_dir: str | None = None
    local_ranks_filter: str | None = None
    # the options a platform set through torchrun's PET_* variables, not a flag: named as such
    from_platform: frozenset = frozenset()

    @property
    def single_node(self):
        return self.nnodes in ("1", "1:1")

    def name_of(self, name: str) -> str:
        """The flag or the variable an option came from: `--nnodes`, `-n`, or `PET_NNODES`."""
        if name in self.from_platform:
            return f"PET_{name.upper()}"
        return "-n" if name == "nproc_per_node" else "--" + name.replace("_", "-")

    def said(self, name: str, value=None) -> str:
        """An option as the user gave it, for a message: `--nnodes 2`, or `PET_NNODES=2` when the
        job's platform set it."""
        value = getattr(self, name) if value is None else value
        return f"{self.name_of(name)}{'=' if name in self.from_platform else ' '}{value}"

    def give(self, name: str, example) -> str:
        """How to give an option, where it came from: `pass --nnodes 2`, or `set PET_NNODES=2`."""
        return f"set PET_{name.upper()}={example}" if name in self.from_platform else f"pass {self.said(name, example)}"


def _flags() -> list:
    """LaunchOptions' fields that are launch flags (torchrun's)."""
    return [f for f in fields(LaunchOptions) if f.name != "from_platform"]


_FLAG_HELP = {
    "nproc_per_node": "workers per node: a number, or auto/gpu/cpu (default 1)",
    "nnodes": "number of nodes, or MIN:MAX for elastic jobs (default 1)",
    "master_port": "rendezvous port; single-node runs pick a free one when unset",
    "max_restarts": f"restarts after a failure (default 0; {ELASTIC_RESTARTS} for --nnodes MIN:MAX)",
    "log_dir": "keep each worker's output in files here",
    "local_ranks_filter": "show the prints of these local ranks only, e.g. 0 or 0,1 (errors: all)",
}


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags, under torchrun's names (both spellings), so commands carry over unchanged."""
    group = parser.add_argument_group("launching (as torchrun)")
    for f in _flags():
        names = (["-n"] if f.name == "nproc_per_node" else []) + [f"--{f.name.replace('_', '-')}", f"--{f.name}"]
        group.add_argument(
            *dict.fromkeys(names),
            dest=f.name,
            default=None,
            help=_FLAG_HELP.get(f.name),
            type=int if int in (f.type, *typing.get_args(f.type)) else str,
        )


def options_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> tuple[LaunchOptions, bool]:
    """The launch options, and whether a launch was asked for explicitly: a flag given, or torchrun's
    environment (PET_*) that a platform sets for each pod, as Kubeflow's PyTorchJob does."""
    given = {f.name: getattr(args, f.name) for f in _flags() if getattr(args, f.name, None) is not None}
    platform = platform_options(env, given)
    chosen = {**platform, **given}
    opts = LaunchOptions(**{k: str(v) if k in ("nproc_per_node", "nnodes") else v for k, v in chosen.items()})
    opts.from_platform = frozenset(platform) - set(given)
    return opts, bool(chosen)


def platform_options(env: Mapping[str, str], given: dict) -> dict:
    """torchrun reads each flag it is not given from PET_<FLAG> (PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR, PET_RDZV_ENDPOINT, ...): so does ddplab. A flag given wins, but a
    --nnodes that contradicts the platform's PET_NNODES is refused: the job would wait for nodes that
    never come, or leave some out."""
    found = {}
    for f in _flags():
        name = f"PET_{f.name.upper()}"
        value = env.get(name)
        if value is None or value == "":
            continue
        if int in (f.type, *typing.get_args(f.type)):
            if not value.lstrip("-").isdigit():
                raise LaunchError(f"{name}={value!r} is not a whole number", f"set {name} to a number, or unset it")
            value = int(value)
        found[f.name] = value
    if "nnodes" in given and "nnodes" in found and str(given["nnodes"]) != str(found["nnodes"]):
        raise LaunchError(
            f"--nnodes {given['nnodes']} contradicts PET_NNODES={found['nnodes']}, which the job's platform set "
            "(e.g. Kubeflow's PyTorchJob)",
            "leave --nnodes out to take the platform's, or give the job that many nodes",
        )
    return found


def should_launch(explicit_flags: bool, opts: LaunchOptions, env: dict | os._Environ, dist_rank_given: bool) -> bool:
    """Start workers through the agent, or run here as one rank? Inside torchrun (or ddplab's agent), or
    with `dist.rank` (ranks started by hand): here. srun/mpirun workers run in place unless launch
    flags are given. A plain single-process run needs no agent."""
    if environment.ELASTIC_RUN_ID in env or dist_rank_given:
        return False
    if explicit_flags:
        return True
    if any(k in env for k in environment.WORKER_MARKERS):
        return False
    return not (opts.nproc_per_node == "1" and opts.single_node and not opts.max_restarts)


def check_options(opts: LaunchOptions) -> None:
    """Every launch flag, and how they combine, before any worker starts: one line each."""
    procs = opts.nproc_per_node
    if procs not in ("auto", "gpu", "cpu") and not (procs.isdigit() and int(procs) > 0):
        raise LaunchError(
            f"{opts.said('nproc_per_node')}: workers per node must be a whole number above 0 (or auto, gpu, cpu)",
            f"{opts.give('nproc_per_node', 2)}, say",
        )
    most = most_nodes(opts)
    if not 0 <= opts.node_rank < most:
        raise LaunchError(
            f"{opts.said('node_rank')} is not one of the {most} node(s) of {opts.said('nnodes')}",
            f"number the nodes 0 to {most - 1}",
        )
    if opts.max_restarts is None:
        opts.max_restarts = default_restarts(opts.nnodes)
    if opts.max_restarts < 0:
        raise LaunchError(
            f"{opts.said('max_restarts')} is below 0", f"{opts.give('max_restarts', 0)} (no restart) or more"
        )
    for name, port in (("master_port", opts.master_port), ("rdzv_endpoint", _endpoint_port(opts))):
        if port is not None and not 1 <= port <= 65535:
            raise LaunchError(
                f"{opts.name_of(name)}: port {port} is not between 1 and 65535", "give a port from 1 to 65535"
            )
    if opts.rdzv_backend is not None and opts.rdzv_backend not in RDZV_BACKENDS:
        raise LaunchError(
            f"{opts.said('rdzv_backend')}: torch's agent knows the rendezvous backends {', '.join(RDZV_BACKENDS)}",
            f"{opts.give('rdzv_backend', 'c10d')}, or leave it unset",
        )
    shown = opts.local_ranks_filter
    if shown is not None:
        if not re.fullmatch(r"\d+(,\d+)*", shown):
            raise LaunchError(
                f"{opts.said('local_ranks_filter', repr(shown))} is not a list of local ranks",
                "pass rank numbers separated by commas, e.g. --local-ranks-filter 0 or 0,1",
            )
        if procs.isdigit() and not any(int(rank) < int(procs) for rank in shown.split(",")):
            raise LaunchError(
                f"{opts.said('local_ranks_filter')} names no local rank of {opts.said('nproc_per_node')}: the whole "
                "run would be silent",
                f"name ranks from 0 to {int(procs) - 1}",
            )


# the rendezvous backends torch's agent has (torch.distributed.elastic.rendezvous.registry)
RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")


def most_nodes(opts: LaunchOptions) -> int:
    """The most nodes --nnodes N or MIN:MAX allows, once it is checked."""
    found = re.fullmatch(r"(\d+)(?::(\d+))?", opts.nnodes)
    low, high = (int(found.group(1)), int(found.group(2) or found.group(1))) if found else (0, 0)
    if not found or not 1 <= low <= high:
        raise LaunchError(
            f"{opts.said('nnodes')}: the number of nodes must be N, or MIN:MAX with 1 <= MIN <= MAX",
            f"{opts.give('nnodes', 2)}, or MIN:MAX such as 1:4",
        )
    return high


def _endpoint_port(opts: LaunchOptions) -> int | None:
    if not opts.rdzv_endpoint or ":" not in opts.rdzv_endpoint:
        return None
    port = opts.rdzv_endpoint.rsplit(":", 1)[1]
    return int(port) if port.isdigit() else -1


def sagemaker_options(opts: LaunchOptions, sm: ClusterEnv, procs_per_host: int) -> LaunchOptions:
    """On SageMaker each host runs `ddplab run` once; the agent starts one worker per device."""
    opts.nnodes = str(sm.num_nodes)
    opts.node_rank = sm.node_rank
    opts.master_addr = sm.master_addr
    opts.master_port = sm.master_port
    opts.nproc_per_node = str(procs_per_host)
    return opts


def torchrun_argv(opts: LaunchOptions, timeout_s: float | None = None, records: str | None = None) -> list[str]:
    """The torchrun command line (without the program name) that starts the workers, each of which
    reads the run plan from its environment (worker.py); the workers' error records go in RECORDS
    unless the user keeps their output (--log-dir)."""
    argv = ["--nproc-per-node", opts.nproc_per_node, "--nnodes", opts.nnodes, "--max-restarts", str(opts.max_restarts)]
    if opts.single_node and not opts.rdzv_endpoint:
        port = opts.master_port or free_port()
        if opts.master_port:
            ensure_port_free(port)
        # c10d, not static: each agent restart is a fresh rendezvous round with its own store prefix
        # (a static rendezvous reuses the store, and restarted workers read their predecessors' keys).
        # The launcher hosts the store on loopback (see launch()); the agent joins it as a client.
        argv += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{LOOPBACK}:{port}",
            "--rdzv-id",
            str(uuid.uuid4()),
            "--rdzv-conf",
            "is_host=0",
            "--local-addr",
            LOOPBACK,
        ]
    elif opts.rdzv_endpoint:
        argv += [
            "--rdzv-backend",
            opts.rdzv_backend or "c10d",
            "--rdzv-endpoint",
            opts.rdzv_endpoint,
            "--rdzv-id",
            opts.rdzv_id,
        ]
        conf = [c for c in (opts.rdzv_conf, f"join_timeout={int(timeout_s)}" if timeout_s else None) if c]
        if timeout_s and "last_call_timeout" not in (opts.rdzv_conf or ""):
            # once MIN nodes joined, the agents wait this long for more (torch's 30 s): within the join
            # timeout, or a job whose minimum joined would time out waiting for nodes it does not need
            conf.append(f"last_call_timeout={max(1, min(30, int(timeout_s) // 2))}")
        if "is_host" not in (opts.rdzv_conf or ""):
            conf += _store_role(opts.rdzv_endpoint)
        if conf:
            argv += ["--rdzv-conf", ",".join(conf)]
    else:
        argv += _static_rendezvous(opts, timeout_s)
    if opts.local_addr and "--local-addr" not in argv:
        argv += ["--local-addr", opts.local_addr]
    if opts.log_dir:
        argv += ["--log-dir", opts.log_dir, "--tee", "3"]
    elif records:
        argv += ["--log-dir", records]
    return [*argv, "-m", "ddplab.launch.worker"]


def _static_rendezvous(opts: LaunchOptions, timeout_s: float | None) -> list[str]:
    """Several nodes meeting at node 0's --master-addr and --master-port."""
    if not opts.master_addr:
        raise LaunchError(
            f"{opts.said('nnodes')} needs to know where node 0 is",
            "pass --master-addr HOST --master-port PORT --node-rank R, or --rdzv-endpoint HOST:PORT",
        )
    argv = ["--rdzv-backend", "static", "--master-addr", opts.master_addr]
    argv += ["--master-port", str(opts.master_port or 29500), "--node-rank", str(opts.node_rank)]
    # the wait for the other nodes is bounded by dist.timeout_s, as every other wait
    if timeout_s:
        argv += ["--rdzv-conf", f"timeout={int(timeout_s)}"]
    return argv


def launch(opts: LaunchOptions, plan: RunPlan, timeout_s: float | None = None) -> int:
    """Run the plan on every worker through torch.distributed.run and return the job's exit code."""
    # first: the agent's modules set their loggers' levels as they are imported
    import torch.distributed.run  # noqa: F401

    # the agent's chatter: noise
    verbose = bool(os.environ.get(environment.VERBOSE))
    for part in ("distributed.elastic", "distributed.run", "distributed.launcher", "multiprocessing"):
        logging.getLogger(f"torch.{part}").setLevel(logging.INFO if verbose else logging.CRITICAL)
    watch_membership(verbose)
    # workers end themselves if this process dies, and leave reporting to it
    plan.launcher_pid = os.getpid()
    check_options(opts)
    # torchrun's --local-ranks-filter: whose prints are shown
    shown = opts.local_ranks_filter
    plan.shown_ranks = None if shown is None else [int(r) for r in shown.split(",")]
    # the launch's own folder, for the stop note and the workers' error records: torch's agent would
    # make one of its own in the temporary folder for every job and leave it there
    with scratch_folder("ddplab-launch-") as scratch:
        stops.prepare(plan, scratch)
        return _run_agent(opts, plan, timeout_s, scratch)


def _run_agent(opts: LaunchOptions, plan: RunPlan, timeout_s: float | None, scratch: str) -> int:
    """Start the workers through torch's agent, with the environment they read, and wait for them;
    the launch's SCRATCH folder holds the workers' error records and the fork server's socket."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    plan.to_env()
    # the summary's resume command repeats them
    os.environ[environment.LAUNCH_FLAGS] = shlex.join(launch_flags(opts))
    # here, not above: `ddplab --help` reads this module's launch flags without torch
    from ..distributed.runtime import cpu_threads_per_rank

    threads = cpu_threads_per_rank(int(opts.nproc_per_node)) if opts.nproc_per_node.isdigit() else 1
    os.environ.setdefault(environment.OMP_THREADS, str(threads))
    if not opts.single_node:
        _find_node_address(opts)
    # Each rendezvous round's rank 0 publishes a fresh address for the workers' store, and its first
    # worker hosts it. With the agent's store shared instead (torch's default), a rank 0 that stays
    # rank 0 skips publishing, and a node that joins later waits for it until both agents die
    # (DistStoreError on torchelastic/role_info): an elastic job could never grow.
    os.environ[environment.NO_SHARED_RDZV_STORE] = "1"
    argv = torchrun_argv(opts, timeout_s, records=os.path.join(scratch, "records"))
    # an earlier launch of this process (a notebook's) leaves no store for these workers to look for
    os.environ.pop(environment.STORE_PORT, None)
    store = _loopback_rendezvous(argv, timeout_s) if "is_host=0" in argv and opts.single_node else None
    args = torchrun.parse_args(argv)
    try:
        _run_workers(args)
        return stops.report(plan) or 0
    except ChildFailedError as e:
        return failures.report(e)
    except SignalException as e:
        # the job was told to stop; the agent passed the signal to the workers
        return stops.report(plan, e.sigval.name)
    except Exception as e:
        raise _rendezvous_error(e, opts, timeout_s) from None
    finally:
        # the loopback store serves the agent and workers until the job is over
        del store


def _run_workers(args) -> None:
    """torchrun's run(), with the workers forked from a server that imported torch and ddplab once
    (fork_server.py) wherever the launcher's main module allows it; else each is `python -m`."""
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from . import fork_server
    from .worker import run_forked

    config, cmd, cmd_args = torchrun.config_from_args(args)
    if fork_server.ready():
        config.start_method = "forkserver"
        elastic_launch(config, entrypoint=run_forked)(fork_server.LaunchersEnvironment())
    else:
        elastic_launch(config, entrypoint=cmd)(*cmd_args)


def _rendezvous_error(e: Exception, opts: LaunchOptions, timeout_s: float | None) -> Exception:
    """The agent's rendezvous failures, one line each; anything else is raised as it is."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    waited = f"rendezvous timed out after {int(timeout_s or 600)} s (dist.timeout_s)"
    if isinstance(e, DistStoreError) and not opts.rdzv_endpoint:
        # a static rendezvous (--master-addr) whose other nodes did not come within dist.timeout_s
        joined = re.search(r"(\d+)/(\d+) clients joined", str(e))
        count = f"{joined.group(1)} of the {joined.group(2)}" if joined else "fewer than the"
        return LaunchError(
            f"{waited}: {count} nodes asked for (--nnodes {opts.nnodes}) joined at "
            f"{opts.master_addr}:{opts.master_port or 29500}",
            "start `ddplab run` on every node with the same --master-addr and --master-port, or raise dist.timeout_s",
        )
    if isinstance(e, RendezvousTimeoutError):
        return LaunchError(
            f"{waited}: fewer than the {opts.nnodes} nodes asked for (--nnodes) joined at {opts.rdzv_endpoint}",
            "start `ddplab run` on every node with the same --rdzv-endpoint and --rdzv-id, or raise dist.timeout_s",
        )
    if isinstance(e, RendezvousClosedError):
        return rendezvous_closed(opts.rdzv_endpoint, opts.rdzv_id)
    if isinstance(e, RendezvousConnectionError):
        return rendezvous_lost(opts.rdzv_endpoint, e)
    if isinstance(e, DistStoreError):
        return LaunchError(
            f"the nodes stopped finding each other's keys in the rendezvous store at {opts.rdzv_endpoint} "
            f"({str(e).splitlines()[0][:160]})",
            "start every node with the same ddplab and torch versions, --rdzv-endpoint and --rdzv-id; "
            "DDPLAB_VERBOSE=1 shows the agents' own log",
        )
    return e


def launch_flags(opts: LaunchOptions) -> list[str]:
    """The launch flags this job was given, as a command line that starts it again."""
    flags = []
    for f in _flags():
        value = getattr(opts, f.name)
        if (
            f.name not in opts.from_platform
            and value is not None
            and value != f.default
            and not (f.name == "max_restarts" and value == default_restarts(opts.nnodes))
        ):
            flags += ["-n" if f.name == "nproc_per_node" else f"--{f.name.replace('_', '-')}", str(value)]
    return flags


def launch_function(entry: str, settings: list[str], nproc: int, timeout_s: float) -> int:
    """Run a function of ddplab's own tools ("module:name", called with its config) on `nproc` local processes."""
    if nproc < 2:
        # one process has no one to exchange with (and no process group)
        raise LaunchError(f"-n {nproc}: this command runs collectives between processes", "pass -n 2 or more")
    return launch(LaunchOptions(nproc_per_node=str(nproc)), make_plan("run", entry, settings), timeout_s)


def _loopback_rendezvous(argv: list[str], timeout_s: float | None):
    """A single-node job's stores, reachable from this machine only; its workers' gloo sockets stay
    on loopback too (GLOO_SOCKET_IFNAME), unless the user chose an interface."""
    from .network import interface_with_address

    port = int(argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1])
    os.environ.setdefault(environment.GLOO_IFNAME, interface_with_address(LOOPBACK) or "lo")
    # here, not above, as cpu_threads_per_rank: the parser reads this module without torch
    from ..distributed.runtime import loopback_store

    store = loopback_store(port, timeout_s or 600, port_setting="--master-port")
    # the workers meet in it too: it is held until the job ends, where a port picked for rank 0's own
    # store could be taken by another process before rank 0 binds it
    os.environ[environment.STORE_PORT] = str(port)
    return store


def _store_role(endpoint: str) -> list[str]:
    """Whether this node's agent hosts the rendezvous store: a store already served at the endpoint
    (`ddplab rendezvous`, one that outlives the job) is joined; else the node that is the endpoint
    hosts it, even when its hostname resolves elsewhere. A loopback endpoint (several "nodes" on one
    machine) is left to torch, which lets the first agent host and the others connect."""
    from .network import is_local_address, resolve, split_endpoint

    host, port = split_endpoint(endpoint)
    if not is_local_address(host):
        return []
    try:
        socket.create_connection((host, port), timeout=2).close()
        return ["is_host=0"]
    except OSError:
        return [] if ipaddress.ip_address(resolve(host)).is_loopback else ["is_host=1"]


def _find_node_address(opts: LaunchOptions) -> None:
    """Fill in --local-addr and GLOO_SOCKET_IFNAME from the route to node 0, unless given."""
    from .network import interface_with_address, source_address_for, split_endpoint

    if opts.rdzv_endpoint:
        host, port = split_endpoint(opts.rdzv_endpoint)
    elif opts.master_addr:
        host = opts.master_addr
        port = opts.master_port or 29500
    else:
        return
    opts.local_addr = opts.local_addr or source_address_for(host, port)
    interface = interface_with_address(opts.local_addr)
    if interface:
        os.environ.setdefault(environment.GLOO_IFNAME, interface)


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it), for single-node rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def ensure_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            raise PortInUse(port, "--master-port") from None
