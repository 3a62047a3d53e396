"""Who am I? Work out rank, world size and the rendezvous address from how the process was started.

Pure functions of an environment mapping and the `dist.*` config, testable without a process. First match
wins: explicit `dist.*` config, torchrun / TorchElastic, SLURM, MPI, SageMaker, a single process."""

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlparse

from .. import environment
from ..config import DistConfig
from ..errors import LaunchError

DEFAULT_PORT = 29500
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ClusterEnv:
    """Everything `init_process_group` and device binding need, plus where it came from."""

    source: str  # config | torchelastic | env | slurm | mpi | sagemaker | single
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_PORT
    init_method: str | None = None  # set only for file:// and env:// (tcp:// is master_addr/port)
    # the ranks join a store the job already runs, as its clients (distributed/runtime.py): ddplab's
    # launcher's on one node, or torch's agent's when the agent shares its own
    shared_store: bool = False

    @property
    def distributed(self):
        return self.world_size > 1


def detect(env: Mapping[str, str], dist: DistConfig | None = None) -> ClusterEnv:
    """Resolve the cluster layout; explicit `dist.*` values win over anything in `env`."""
    dist = dist or DistConfig()
    found = _from_config(dist, env)
    if found is None:
        for probe in (_from_torchelastic, _from_slurm, _from_mpi, _from_sagemaker):
            found = probe(env)
            if found is not None:
                break
    found = found or ClusterEnv(source="single")
    found = _apply_address_overrides(found, dist)
    validate(found)
    return found


def validate(c: ClusterEnv) -> None:
    if c.world_size < 1:
        raise LaunchError(f"world size is {c.world_size}", "it must be at least 1")
    if not 0 <= c.rank < c.world_size:
        raise LaunchError(
            f"rank {c.rank} is out of range for world size {c.world_size} (ranks are 0..{c.world_size - 1})",
            f"pass dist.rank between 0 and {c.world_size - 1}, or raise dist.world_size",
        )
    if not 0 <= c.local_rank < c.local_world_size:
        raise LaunchError(
            f"local rank {c.local_rank} is out of range for {c.local_world_size} local processes",
            "pass dist.local_rank and dist.local_world_size consistently",
        )


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: `node[01-04,07],gpu3` -> `node01`."""
    # a comma inside [...] does not end a host
    top = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], top)


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node `node_id` from SLURM's compressed form `4(x2),3` (-> 4, 4, 3)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"cannot read SLURM tasks-per-node value '{tasks_per_node}'", "set dist.local_world_size")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def _from_config(dist: DistConfig, env: Mapping[str, str]) -> ClusterEnv | None:
    if (dist.init_method or "").startswith("env://"):
        # as torch's env://: RANK, WORLD_SIZE, MASTER_* from env
        found = _from_torchelastic(
            {**env, **{k.upper(): str(v) for k in ("rank", "world_size") if (v := getattr(dist, k)) is not None}}
        )
        if found is None:
            raise LaunchError(
                "dist.init_method=env:// reads RANK and WORLD_SIZE from the environment, and they are not set",
                "export RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or drop dist.init_method",
            )
        return found
    if dist.rank is None and dist.world_size is None and dist.init_method is None:
        return None
    if dist.world_size is None:
        raise LaunchError("dist.rank is set but dist.world_size is not", "pass dist.world_size=N as well")
    rank = dist.rank or 0
    addr, port, init = _parse_init_method(dist.init_method)
    addr = addr or dist.master_addr
    if addr is None and init is None and rank > 0:
        raise LaunchError(
            f"rank {rank} does not know where rank 0 is",
            "pass dist.master_addr=HOST (and dist.master_port=PORT) of the machine running rank 0",
        )
    addr = addr or LOOPBACK
    same_host = _is_loopback(addr) or (init or "").startswith("file://")
    local_world = dist.local_world_size or (dist.world_size if same_host else 1)
    local_rank = dist.local_rank if dist.local_rank is not None else (rank if same_host else 0)
    return ClusterEnv(
        "config",
        rank,
        dist.world_size,
        local_rank,
        local_world,
        node_rank=0 if same_host else rank // max(local_world, 1),
        num_nodes=1 if same_host else max(dist.world_size // max(local_world, 1), 1),
        master_addr=addr,
        master_port=port or dist.master_port or DEFAULT_PORT,
        init_method=init,
    )


def _from_torchelastic(env: Mapping[str, str]) -> ClusterEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    if "LOCAL_RANK" in env or env.get("MASTER_ADDR", LOOPBACK) in (LOOPBACK, "localhost", "::1"):
        # torchrun's, or ranks that meet on this machine: LOCAL_RANK, else the rank itself
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", 0)))
    else:
        # torch's env:// alone, across machines (a PyTorchJob's pods without torchrun): a rank a machine
        local_rank, local_world, node_rank = 0, 1, rank
    elastic = environment.ELASTIC_RUN_ID in env
    # ddplab's launcher on one node: its loopback store, held for the whole job, rather than a port
    # the agent found free for rank 0, which another process can take before rank 0 binds it
    launcher_store = env.get(environment.STORE_PORT) if elastic else None
    return ClusterEnv(
        "torchelastic" if elastic else "env",
        rank,
        world,
        local_rank,
        local_world,
        node_rank=node_rank,
        num_nodes=max(world // max(local_world, 1), 1),
        master_addr=LOOPBACK if launcher_store else env.get("MASTER_ADDR", LOOPBACK),
        master_port=int(launcher_store or env.get("MASTER_PORT", DEFAULT_PORT)),
        init_method="env://",
        shared_store=bool(launcher_store) or (elastic and env.get(environment.USE_AGENT_STORE) == "True"),
    )


def agent_and_launcher_ports(env: Mapping[str, str]) -> tuple[str, str] | None:
    """Under ddplab's launcher on one machine: the port torch's agent found free for rank 0's store
    (MASTER_PORT) and the port of the launcher's own store, where the ranks meet instead."""
    held = env.get(environment.STORE_PORT) if environment.ELASTIC_RUN_ID in env else None
    found = env.get("MASTER_PORT")
    return (found, held) if held and found else None


def _from_slurm(env: Mapping[str, str]) -> ClusterEnv | None:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]))
    node_id = int(env.get("SLURM_NODEID", 0))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    job_id = int(env.get("SLURM_JOB_ID", 0) or 0)
    return ClusterEnv(
        "slurm",
        int(env["SLURM_PROCID"]),
        world,
        int(env.get("SLURM_LOCALID", 0)),
        tasks_on_node(per_node, node_id) if per_node else world,
        node_rank=node_id,
        num_nodes=int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", 1))),
        master_addr=env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else LOOPBACK),
        # One port per job, so two jobs sharing a node do not collide on 29500.
        master_port=int(env.get("MASTER_PORT") or 15000 + job_id % 20000),
    )


def _from_mpi(env: Mapping[str, str]) -> ClusterEnv | None:
    if "OMPI_COMM_WORLD_RANK" in env:
        rank = int(env["OMPI_COMM_WORLD_RANK"])
        world = int(env["OMPI_COMM_WORLD_SIZE"])
        local_rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
        local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        rank = int(env["PMI_RANK"])
        world = int(env["PMI_SIZE"])
        local_rank = int(env.get("MPI_LOCALRANKID", env.get("PMI_LOCAL_RANK", 0)))
        local_world = int(env.get("MPI_LOCALNRANKS", env.get("PMI_LOCAL_SIZE", world)))
    else:
        return None
    single_node = local_world == world
    addr = env.get("MASTER_ADDR")
    if addr is None and not single_node:
        raise LaunchError(
            "under mpirun across several nodes, no rank knows the address of rank 0",
            "export MASTER_ADDR=<host of rank 0> (e.g. mpirun -x MASTER_ADDR=node01 ...) or pass dist.master_addr",
        )
    return ClusterEnv(
        "mpi",
        rank,
        world,
        local_rank,
        local_world,
        node_rank=rank // max(local_world, 1),
        num_nodes=max(world // max(local_world, 1), 1),
        master_addr=addr or LOOPBACK,
        master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
    )


def _from_sagemaker(env: Mapping[str, str]) -> ClusterEnv | None:
    """SageMaker starts one process per host; `ddplab run` there starts the per-device workers."""
    if "SM_HOSTS" not in env or "SM_CURRENT_HOST" not in env:
        return None
    hosts = sorted(json.loads(env["SM_HOSTS"]))
    node = hosts.index(env["SM_CURRENT_HOST"])
    return ClusterEnv(
        "sagemaker",
        node,
        len(hosts),
        node_rank=node,
        num_nodes=len(hosts),
        master_addr=hosts[0],
        master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
    )


def sagemaker_procs_per_host(env: Mapping[str, str]) -> int:
    """Workers to start on each SageMaker host: one per GPU, else one."""
    return int(env.get("SM_NUM_GPUS", 0) or 0) or 1


def _apply_address_overrides(c: ClusterEnv, dist: DistConfig) -> ClusterEnv:
    if c.source == "config":
        return c
    keys = ("master_addr", "master_port", "local_rank", "local_world_size")
    changes = {k: getattr(dist, k) for k in keys if getattr(dist, k) is not None}
    if changes and c.source in ("torchelastic", "env"):
        # the given address replaces the launcher's, and its store
        changes["init_method"] = None
        if "master_addr" in changes or "master_port" in changes:
            changes["shared_store"] = False
    return replace(c, **changes) if changes else c


def _parse_init_method(url: str | None) -> tuple[str | None, int | None, str | None]:
    """`tcp://h:p` -> (h, p, None); `file://...` is kept as it is; env:// and none give nothing."""
    parsed = urlparse(url or "")
    if parsed.scheme == "tcp":
        if not parsed.hostname or not parsed.port:
            raise LaunchError(f"dist.init_method '{url}' has no host or port", "write it as tcp://HOST:PORT")
        return parsed.hostname, parsed.port, None
    if parsed.scheme == "file":
        return None, None, url
    if parsed.scheme not in ("env", ""):
        # ddplab.init(DistConfig(...)) does not pass through the settings' rules (config.py)
        raise LaunchError(f"dist.init_method '{url}' is not understood", "use env://, tcp://HOST:PORT or file:///PATH")
    return None, None, None


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")
