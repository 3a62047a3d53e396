"""Every environment variable ddplab reads or writes, named once. The variables of whatever started
the process (torchrun's RANK, WORLD_SIZE, …, SLURM_*, OMPI_*, PMI_*, SM_*) are read by
distributed/cluster.py alone, which names each; the few read anywhere else are here."""

import os
import sys

# what ddplab's own variables are named with; each is read as ddplab's code runs, none as its
# modules are imported (a fork server kept across launches relies on it: launch/fork_server.py)
OWN_PREFIX = "DDPLAB_"

# the run plan (JSON): the one channel from launcher to workers (launch/plan.py)
PLAN = "DDPLAB_PLAN"
# set by ddplab's launcher: its launch flags (-n, --nnodes, --rdzv-*...), for the resume command
LAUNCH_FLAGS = "DDPLAB_LAUNCH_FLAGS"
# set by ddplab's launcher for workers started after the job regrouped for a joining node
REGROUPED = "DDPLAB_REGROUPED"
# set by `ddplab sweep` for the run of one trial (JSON: the study and the trial rank 0 reports
# to, the pruner that judges it; launch/sweep.py, train/pruning.py)
SWEEP_TRIAL = "DDPLAB_SWEEP_TRIAL"
# set by ddplab.run in a Python session: where rank 0 leaves a function's return value (launch/notebook.py)
RETURNED = "DDPLAB_RETURNED"
# set by ddplab.run: the session's name for its __main__, which names the classes it sends (train/rundir.py)
SESSION_MAIN = "DDPLAB_SESSION_MAIN"
# set by ddplab's launcher for each replica of dist.fault_tolerance=live (launch/replicas.py): its
# number and the lighthouse it meets the others at (not settings: the run's config.yaml stays the user's)
REPLICA_ID = "DDPLAB_REPLICA_ID"
LIGHTHOUSE = "DDPLAB_LIGHTHOUSE"
# set by ddplab's launcher for the replicas it starts together: "FOLDER:COUNT", where each leaves a
# file before its first quorum and waits for the others' (launch/replicas.py, distributed/live.py)
REPLICAS_START = "DDPLAB_REPLICAS_START"
# each replica of dist.fault_tolerance=live on a GPU machine sees one GPU (launch/replicas.py)
VISIBLE_GPUS = "CUDA_VISIBLE_DEVICES"
# set by ddplab's launcher in its workers: the file a failing worker of this node touches before it
# exits, so that the others read the SIGTERM torch's agent then sends as the job's end, not as a
# preemption to save at (launch/stops.py, train/signals.py)
PEER_FAILED = "DDPLAB_PEER_FAILED"
# set by ddplab's launcher on one node: the port of its loopback store, which its workers join too
# (distributed/cluster.py)
STORE_PORT = "DDPLAB_STORE_PORT"
# set by a user to see the elastic agent's own log lines
VERBOSE = "DDPLAB_VERBOSE"
# set by a user to 0: each worker starts as its own `python -m` process, not forked from a server
# that imported torch and ddplab once (launch/fork_server.py)
FORK_SERVER = "DDPLAB_FORK_SERVER"

# set by ddplab's launcher for Python's resource tracker alone (launch/fork_server.py)
PYTHON_WARNINGS = "PYTHONWARNINGS"

# Set by ddplab for torch, each unless the user set it first (but the last two).
# FATAL: ddplab reports socket failures in one line
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
# cores per worker
OMP_THREADS = "OMP_NUM_THREADS"
# loopback for one node, else the interface routing to node 0
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
# the agent's own store is not the workers' (launch/launcher.py)
NO_SHARED_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# from dist.debug
DISTRIBUTED_DEBUG = "TORCH_DISTRIBUTED_DEBUG"
# :4096:8, which deterministic cuBLAS needs (trainer.deterministic)
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
# torch's flight recorder, on for every job (distributed/hangs.py): its size (gloo and the
# generic recorder, NCCL's), NCCL's dump on a watchdog timeout, where NCCL dumps it
FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
FR_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
# warn: torchft's servers (the lighthouse, each replica's manager) log every quorum at info
RUST_LOG = "RUST_LOG"
# 6: kineto's own lines at each profiler start and stop left out (train/profiling.py)
KINETO_LOG_LEVEL = "KINETO_LOG_LEVEL"

# Set by torch's elastic agent or a scheduler, read outside cluster.py.
ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
# written into the launching process by torch's elastic_launch at every launch (launch/fork_server.py)
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
SAGEMAKER_HOSTS = "SM_HOSTS"
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
# A process started by one of these is already a rank of a job: it runs in place, never launches.
WORKER_MARKERS = (ELASTIC_RUN_ID, "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", RANK)


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this job's workers (0 on the first try)."""
    return int(os.environ.get(RESTART_COUNT, "0") or 0)


def working_folder_last() -> None:
    """`python -m` puts the working folder first on sys.path, where a json.py would hide the
    standard json from torch and ddplab: it goes last instead (still importable)."""
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.append(sys.path.pop(0))
