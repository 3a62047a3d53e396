"""Elastic jobs (`--nnodes MIN:MAX`): their defaults, what the agent does said in one line each, and
a rendezvous store that outlives every node of the job (`ddplab rendezvous`).

torch's elastic agent restarts the workers in two cases: a worker failed (a node died: its peers'
collectives fail), which counts against --max-restarts, and a node asks to join, which does not.
Either way ddplab's workers resume from the last checkpoint with the same global batches, re-planned
for the new world size (train/data.py)."""

import errno
import logging
import os
import signal
import socket
import sys
import time

from .. import environment
from ..errors import DdplabError

# restarts an elastic job gets when --max-restarts is not given: each node lost costs one
ELASTIC_RESTARTS = 3
# the agent's logger: its record of a membership change is the only sign of one
_AGENT_LOG = "torch.distributed.elastic.agent.server.api"


def is_elastic(nnodes: str) -> bool:
    """--nnodes MIN:MAX with MIN < MAX: nodes may leave and join while the job runs."""
    low, _, high = nnodes.partition(":")
    return bool(high) and low != high


def default_restarts(nnodes: str) -> int:
    """torchrun restarts nothing by default; an elastic job must survive losing a node."""
    return ELASTIC_RESTARTS if is_elastic(nnodes) else 0


class _MembershipLine(logging.Handler):
    """The agent's record of why it restarts the workers, made a ddplab line and told to the workers
    it starts next (they inherit this process's environment): a node that asks to join ("Detected N
    new nodes ... will restart worker group"), or a failure ("... attempts left; will restart")."""

    def emit(self, record: logging.LogRecord) -> None:
        text = str(record.msg)
        if "new nodes" in text and len(record.args or ()) >= 2:
            print(
                f"ddplab: {record.args[1]} node(s) ask to join: the workers stop (saving a checkpoint if every "
                "rank still answers) and go on with the larger group from the latest one",
                flush=True,
            )
            os.environ[environment.REGROUPED] = "1"
        elif "attempts left" in text:
            os.environ.pop(environment.REGROUPED, None)


def watch_membership(verbose: bool) -> None:
    """Say when the agent regroups the job for a joining node (its own log lines stay hidden
    unless DDPLAB_VERBOSE is set)."""
    agent_log = logging.getLogger(_AGENT_LOG)
    if not any(isinstance(h, _MembershipLine) for h in agent_log.handlers):
        agent_log.addHandler(_MembershipLine())
    agent_log.setLevel(logging.INFO)
    # the record reaches our handler; torch's own handlers print it only when asked to
    agent_log.propagate = verbose


def rendezvous_lost(endpoint: str | None, error: BaseException) -> DdplabError:
    """The one line for an agent that lost its rendezvous store: the node that hosted it is gone."""
    return DdplabError(
        f"the rendezvous store at {endpoint} stopped answering ({type(error).__name__}): the node that "
        "hosted it left the job, and an elastic job survives the loss of any node but that one",
        "run `ddplab rendezvous --port PORT` on a host that outlives the job and pass "
        "--rdzv-endpoint THAT_HOST:PORT to every node; the run resumes from its last checkpoint",
    )


def rendezvous_closed(endpoint: str | None, rdzv_id: str) -> DdplabError:
    return DdplabError(
        f"the rendezvous {rdzv_id!r} at {endpoint} is closed: a job with this --rdzv-id already ended there",
        "give this job a new --rdzv-id (the same on every node)",
    )


def add_command(sub) -> None:
    store = sub.add_parser(
        "rendezvous",
        help="host the rendezvous store of elastic jobs here, until stopped (a host that outlives every node)",
    )
    store.add_argument("--port", type=int, default=29400, help="port to listen on (default 29400)")
    store.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    store.set_defaults(handler=lambda args, rest: serve_store(args.host, args.port))


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or one line at once: a name that does not resolve, an address
    that is not this machine's, a port in use."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise DdplabError(
            f"--host {host} does not resolve to an address ({e.strerror})",
            "pass a name or address of this machine, or leave --host out to listen on every interface",
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise DdplabError(
                f"cannot listen on {host}:{port} (the port is already in use on this machine)",
                "pass a free --port, or stop what uses it",
            ) from None
        raise DdplabError(
            f"cannot listen on {host}:{port} ({address[0]}: {e.strerror}): --host must be an address of this "
            "machine, the one the nodes reach it at",
            "pass one of this machine's addresses (`hostname -I`), or leave --host out to listen on every interface",
        ) from None
    sock.listen(1024)
    return sock


def serve_store(host: str, port: int) -> int:
    """Serve a TCPStore until SIGINT or SIGTERM. Agents that find it on their --rdzv-endpoint join
    it as clients, so the job outlives any one of its nodes."""
    import datetime

    import torch.distributed as dist

    if not 1 <= port <= 65535:
        raise DdplabError(f"--port {port} is not between 1 and 65535", "pass a port from 1 to 65535")
    sock = _listening_socket(host, port)
    try:
        # the socket bound here, handed over: torch's store would wait on a bad --host in silence
        store = dist.TCPStore(
            host,
            port,
            None,
            True,
            datetime.timedelta(seconds=60),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
        )
    except (RuntimeError, OSError) as e:
        raise DdplabError(
            f"cannot listen on {host}:{port} ({str(e).splitlines()[0]})", "pass a free --port, or stop what uses it"
        ) from None
    print(f"ddplab: rendezvous store listening on {host}:{port}; pass --rdzv-endpoint HOST:{port}", flush=True)
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    while not stopping:
        time.sleep(0.2)
    del store
    print("ddplab: rendezvous store stopped", file=sys.stderr, flush=True)
    return 0
