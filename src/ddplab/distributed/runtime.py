"""The process-group runtime: one call that joins (or skips) the process group and binds a device.

    with ddplab.init() as rt:
        model = model.to(rt.device)

It reads the layout (cluster.py), picks the backend, binds the device before any tensor exists,
sizes CPU threads and joins with a timeout. A world of one needs no group, yet every helper works; a
script's own ddplab.init() under a launcher gets a group of one all the same (see init)."""

import datetime
import functools
import importlib
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import environment
from ..config import DistConfig
from ..errors import LaunchError, PortInUse
from . import hangs
from .cluster import LOOPBACK, ClusterEnv, agent_and_launcher_ports, detect

_JOINED_KEY = "ddplab/joined"
_current: "Runtime | None" = None


@dataclass
class Runtime:
    """This process's place in the job. Use as a context manager to tear down on exit."""

    cluster: ClusterEnv
    backend: str
    device: torch.device
    timeout_s: float
    owns_group: bool = False
    # a gloo group beside an nccl one, for host numbers (None: the default group is gloo already)
    control_group: object = None

    @property
    def rank(self):
        return self.cluster.rank

    @property
    def world_size(self):
        return self.cluster.world_size

    @property
    def local_rank(self):
        return self.cluster.local_rank

    @property
    def local_world_size(self):
        return self.cluster.local_world_size

    @property
    def node_rank(self):
        return self.cluster.node_rank

    @property
    def is_main(self):
        """Rank 0 of the job: writes shared files, prints summaries."""
        return self.rank == 0

    @property
    def is_local_main(self):
        """One per node: progress bars, local downloads."""
        return self.local_rank == 0

    @property
    def distributed(self):
        """In a process group."""
        return dist.is_available() and dist.is_initialized()

    device_name = property(
        lambda self: (
            f"{torch.cuda.get_device_name(self.device)} ({self.device})"
            # what the banner says this rank runs on
            if self.device.type == "cuda"
            else "cpu"
        )
    )

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        global _current
        hangs.stop()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False
        if _current is self:
            _current = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The dist.* settings given on the command line of a script (`ddplab run train.py dist.timeout_s=15`),
# which its own ddplab.init() takes when it passes none (set by launch/worker.py).
script_settings: DistConfig | None = None


def init(
    dist_config: DistConfig | None = None, env: Mapping[str, str] | None = None, group_of_one: bool = True
) -> Runtime:
    """Join the job this process belongs to. Calling it again returns the same runtime.

    A process that a launcher started (ddplab run, torchrun, srun, mpirun) alone gets a process group
    of one (`group_of_one`), so a script's own `DistributedDataParallel(model)` and `dist.all_reduce`
    work at every world size, one included, as they do after `dist.init_process_group` under
    torchrun. ddplab's own training passes False: it needs no group to train alone."""
    global _current
    if _current is not None:
        return _current
    cfg = dist_config or script_settings or DistConfig()
    cluster = detect(os.environ if env is None else env, cfg)
    backend = choose_backend(cfg.backend, cluster.local_world_size)
    device = bind_device(backend, cluster)
    if device.type == "cpu":
        torch.set_num_threads(cfg.cpu_threads or cpu_threads_per_rank(cluster.local_world_size))
    runtime = Runtime(cluster, backend, device, cfg.timeout_s)
    if cluster.distributed and not dist.is_initialized():
        if cfg.debug in ("info", "detail"):
            os.environ[environment.DISTRIBUTED_DEBUG] = cfg.debug.upper()
            dist.set_debug_level_from_env()
        # each rank's last collectives, for the report of a hang (hangs.py)
        hangs.enable_flight_recorder(cfg.flight_recorder, backend)
        _join_group(cluster, backend, device, cfg.timeout_s)
        runtime.owns_group = True
        if not (cluster.init_method or "").startswith("file://"):
            # a TCP store to meet in: hang diagnosis, on its own connection
            hangs.start(_connect_store(cluster, cfg.timeout_s, client=True), cluster.rank)
        # under another launcher, a failed collective that ends the script is explained there
        hangs.explain_uncaught(cluster.world_size, cfg.timeout_s)
        if backend == "nccl":
            # host numbers the ranks must agree on travel here, without waiting for the GPU
            runtime.control_group = dist.new_group(backend="gloo")
            ids: list = [None] * dist.get_world_size()
            dist.all_gather_object(ids, (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)))
            check_distinct_devices([tuple(x) for x in ids])
    elif group_of_one and cluster.source != "single" and not dist.is_initialized():
        # nobody to meet: a store of this process's own, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        runtime.owns_group = True
    _current = runtime
    return runtime


def _group_timeout(default: float = 600.0) -> float:
    """The timeout of a process group the user made (init_process_group(timeout=...)), in seconds."""
    try:
        return (
            dist.distributed_c10d._get_default_group()
            ._get_backend(torch.device("cpu"))
            .options._timeout.total_seconds()
        )
    except Exception:
        # another backend or torch: its default
        return default


def current() -> Runtime:
    """The active runtime; a single-process one when `init()` was never called."""
    if _current is not None:
        return _current
    if dist.is_available() and dist.is_initialized():
        # the user made the group themselves
        cluster = ClusterEnv("external", rank=dist.get_rank(), world_size=dist.get_world_size())
        return Runtime(cluster, dist.get_backend(), torch.device("cpu"), _group_timeout())
    return Runtime(ClusterEnv("single"), "none", torch.device("cpu"), 600.0)


def choose_backend(requested: str, local_world_size: int, gpus: int | None = None) -> str:
    """`auto` -> nccl when CUDA has a GPU for every local rank, gloo on a machine without one; too
    few GPUs is an error rather than a run that silently trains on the CPU."""
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    if requested == "auto" and 0 < gpus < local_world_size:
        raise LaunchError(
            f"{local_world_size} processes on this node but only {gpus} GPU(s) are visible",
            f"pass -n {gpus} to train on the GPUs, or dist.backend=gloo to train on the CPU on purpose",
        )
    if requested == "auto":
        return "nccl" if gpus and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and gpus == 0:
        raise LaunchError(
            "dist.backend=nccl needs CUDA GPUs, and this machine has none", "use dist.backend=gloo or dist.backend=auto"
        )
    if requested not in ("gloo", "nccl", "mpi"):
        raise LaunchError(f"unknown backend '{requested}'", "use dist.backend=auto, gloo or nccl")
    if requested == "mpi" and not dist.is_mpi_available():
        raise LaunchError("this torch build has no mpi backend", "use dist.backend=gloo (it works under mpirun)")
    return requested


def bind_device(backend: str, c: ClusterEnv) -> torch.device:
    """Pick this rank's device and make it current before any tensor is created. With one visible GPU
    per process (schedulers that bind GPUs per task) every rank uses its cuda:0; else local rank i takes
    cuda:i, and too few GPUs is an error rather than two ranks silently sharing cuda:0."""
    if backend != "nccl":
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if gpus == 1:
        index = 0
    elif c.local_rank < gpus and gpus >= c.local_world_size:
        index = c.local_rank
    else:
        raise LaunchError(
            f"{c.local_world_size} processes on this node but only {gpus} GPUs are visible, so two "
            f"ranks would share one GPU",
            f"start at most {gpus} processes per node (-n {gpus}) or use dist.backend=gloo",
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_distinct_devices(device_ids: list[tuple[str, str]]) -> None:
    """Fail when two ranks ended up on the same physical GPU (same host, same device UUID)."""
    seen: dict[tuple[str, str], int] = {}
    for rank, key in enumerate(device_ids):
        if key in seen:
            raise LaunchError(
                f"ranks {seen[key]} and {rank} use the same GPU ({key[1]}) on host {key[0]}",
                "give each process its own GPU (check CUDA_VISIBLE_DEVICES and -n)",
            )
        seen[key] = rank


def cpu_threads_per_rank(local_world_size: int) -> int:
    """Split this machine's cores between the ranks on it so they do not oversubscribe."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(local_world_size, 1))


def loopback_store(port: int, timeout_s: float, port_setting: str = "dist.master_port") -> dist.TCPStore:
    """Host a TCPStore that listens on 127.0.0.1 only: torch's server binds every interface, with no
    authentication (whoever reaches the port reads and writes the keys the ranks meet by), and a
    single-node job has no reason to be reachable, so ddplab binds the socket and hands it over."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        raise PortInUse(port, port_setting) from None
    sock.listen(1024)
    # detach(): the store's server owns the descriptor from now on; Python must not close it.
    return dist.TCPStore(
        LOOPBACK,
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def _attempt_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """This attempt's part of a store that outlives worker restarts (see _connect_store)."""
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddplab/attempt_{environment.restart_count()}", store)


def meet_in_the_launchers_store() -> None:
    """A plain script's own `init_process_group()` (env:// or tcp:// at MASTER_ADDR:MASTER_PORT)
    under ddplab's launcher on one machine meets in the launcher's store, as ddplab's runs do.

    torch would have the script's rank 0 host a store at MASTER_PORT, a port the agent found free
    (bound, then closed) seconds before: another process can take it meanwhile, and the job ends with
    "address already in use", which the user cannot prevent. The launcher's store is held for the
    whole job and listens on loopback only, and each attempt of the workers keeps its keys under a
    prefix of its own there. Other addresses (a store of the script's own) are left to torch."""
    ports = agent_and_launcher_ports(os.environ)
    # the module, which torch.distributed's function of the same name hides
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    create = rendezvous._create_c10d_store
    if ports is None or getattr(create, "mended", False):
        return
    found, held = ports

    @functools.wraps(create)
    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if str(port) != found:
            return create(hostname, port, rank, world_size, timeout, *args, **kwargs)
        return _attempt_store(LOOPBACK, int(held), world_size, timeout)

    _create_c10d_store.mended = True
    rendezvous._create_c10d_store = _create_c10d_store


def _join_group(c: ClusterEnv, backend: str, device: torch.device, timeout_s: float) -> None:
    how = {
        "rank": c.rank,
        "world_size": c.world_size,
        "timeout": datetime.timedelta(seconds=timeout_s),
        "device_id": device if device.type == "cuda" else None,
    }
    if c.init_method is not None and c.init_method.startswith("file://"):
        dist.init_process_group(backend, init_method=c.init_method, **how)
        return
    store = _connect_store(c, timeout_s)
    store.add(_JOINED_KEY, 1)
    try:
        dist.init_process_group(backend, store=store, **how)
    except dist.DistError as e:
        joined = store.add(_JOINED_KEY, 0)
        raise LaunchError(
            f"rendezvous timed out after {timeout_s:g} s (dist.timeout_s): {joined} of {c.world_size} ranks joined "
            f"at {c.master_addr}:{c.master_port}",
            "start the missing ranks with the same dist.master_addr/master_port and dist.world_size, "
            "or raise dist.timeout_s",
        ) from e


def _connect_store(c: ClusterEnv, timeout_s: float, client: bool = False) -> dist.Store:
    """The key-value store the ranks meet in. One the job already runs (ddplab's launcher's on one node,
    torch's agent's when shared) outlives worker restarts, so a previous attempt's keys (gloo's peer
    addresses) are still there: each attempt gets its own prefix, or restarted workers would connect
    to their dead predecessors. Otherwise rank 0 hosts it."""
    try:
        if c.shared_store:
            return _attempt_store(c.master_addr, c.master_port, c.world_size, datetime.timedelta(seconds=timeout_s))
        if c.rank == 0 and not client and c.master_addr in ("127.0.0.1", "localhost"):
            return loopback_store(c.master_port, timeout_s)
        return dist.TCPStore(
            c.master_addr,
            c.master_port,
            c.world_size,
            is_master=c.rank == 0 and not client,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e):
            raise PortInUse(c.master_port, "dist.master_port") from None
        raise LaunchError(
            f"rank {c.rank} could not reach rank 0 at {c.master_addr}:{c.master_port} within "
            f"{timeout_s:g} s (dist.timeout_s)",
            "check that rank 0 is running and that dist.master_addr/master_port point at it",
        ) from None


# How long a destroyed group's run-loop threads are given the GIL (see mend_destroy_process_group).
GLOO_DRAIN_S = 0.05


def mend_destroy_process_group() -> None:
    """Two mends to torch's `destroy_process_group`, for the scripts users bring (docs/decisions.md).

    It lets go of the GIL for a moment before it destroys. torch 2.13's gloo run loop needs the GIL
    to free a finished collective's tensor, and a gloo group joins its run-loop threads when it is
    freed. A script's usual ending frees the group with the GIL held: `destroy_process_group()`,
    then its DDP model goes, whose C++ Reducer holds the group's last reference. When the script got
    there within the few milliseconds after its last collective, before the run loop had its turn,
    each waits for the other forever (pytorch/pytorch#56297). The run loop is waiting for the GIL
    by then; letting go of it, as a short sleep does, gives it that turn.

    And destroying the default group no longer restarts torch's count of group names. torch resets
    it, so a default group made again (a script that trains in phases and re-initialises between
    them) took the first one's name and found that group's keys still in the job's store: its gloo
    connected to addresses of the group just destroyed and waited forever (pytorch/pytorch#55967).
    Every rank makes the same groups, so the continued count names the new group alike on each."""
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.destroy_process_group, "mended", False):
        return
    destroy = c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        time.sleep(GLOO_DRAIN_S)
        count = getattr(c10d._world, "group_count", None)
        destroy(group)
        if count is not None:
            c10d._world.group_count = count

    destroy_process_group.mended = True
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
