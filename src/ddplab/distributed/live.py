"""dist.fault_tolerance=live: this process as one replica of a job whose replicas come and go (torchft).

Each replica is one process holding the whole model. A lighthouse (a small server, `ddplab lighthouse`
or the one `ddplab run` starts) forms a quorum before every step from the replicas that answer; the
replicas of a quorum average their gradients in one all_reduce and then agree whether to commit the
step. A replica that is gone makes its peers' all_reduce fail: nobody commits, and the step is taken
again with the replicas that are left. A replica that starts late, or again after a failure, finds a
peer further on and copies its whole training state from it before its first step (a heal).

torchft is imported here only, and only when a run asks for live recovery (`pip install ddplab[ft]`).
Its own DDP wrapper carries a bug this module replaces (`recovering_comm_hook`: docs/decisions.md)."""

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn

from .. import environment
from ..errors import ConfigError, LaunchError
from .wrapping import PassThrough

# a fresh lighthouse waits this long for replicas that heartbeat but have not asked yet for a quorum
JOIN_TIMEOUT_MS = 1000


def replica_id(dist_cfg) -> int:
    """This process's replica number: the launcher's, else dist.replica_id."""
    return int(os.environ.get(environment.REPLICA_ID, dist_cfg.replica_id))


def lighthouse_of(dist_cfg) -> str:
    """The lighthouse this replica meets the others at: the launcher's, else dist.lighthouse."""
    address = os.environ.get(environment.LIGHTHOUSE) or dist_cfg.lighthouse
    if not address:
        raise ConfigError(
            "dist.fault_tolerance=live needs a lighthouse, and dist.lighthouse is unset in a process ddplab run did "
            "not start",
            "start it with `ddplab run -n N ...` (which serves one), or pass dist.lighthouse=http://HOST:PORT",
        )
    return address


def torchft():
    """The torchft package, or one line that says how to install it."""
    # read when its servers start: a line per quorum and commit otherwise
    os.environ.setdefault(environment.RUST_LOG, "warn")
    # its Python side logs each failure with a traceback: ddplab says what happened in a line
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # a heal reads the peer's tensors from a read-only buffer, and copies them into this replica's own
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    try:
        import torchft
        import torchft.ddp
        import torchft.manager
        import torchft.process_group
    except ImportError as e:
        raise ConfigError(
            f"dist.fault_tolerance=live needs torchft, which does not import here ({e})",
            "pip install 'ddplab[ft]'",
        ) from None
    return torchft


def serve_lighthouse(bind: str, min_replicas: int, heartbeat_timeout_ms: int = 2000):
    """Start torchft's lighthouse in this process (it serves from its own threads); returns the server,
    whose address() the replicas are given and whose shutdown() ends it."""
    torchft()
    from torchft._torchft import LighthouseServer

    try:
        return LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as e:
        raise LaunchError(f"cannot start the lighthouse on {bind} ({e})", "pass a free port: --port PORT") from None


def recovering_comm_hook(replica: "Replica", bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook for a replica: the bucket averaged over the quorum's replicas.

    torchft 0.2.0's own hook (torchft/ddp.py) asserts on a future that its error path never sets, so
    the very failure it exists for, a peer lost inside the backward's all_reduce, ended the survivor
    with an AssertionError. Here the all_reduce is waited on, its failure is left to the manager (it
    marks the step as not to be committed), and the bucket is handed back either way."""
    work = replica.manager.allreduce(bucket.buffer())
    work.wait()
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class Replica:
    """This process's membership of the job: the manager that asks the lighthouse for each step's
    quorum, the process group it reconfigures for each quorum, and the store it is reached through.

    They are made just before the first quorum (join), not when the replica starts: from its first
    heartbeat on, the lighthouse counts the replica as live, and torchft forms no quorum of half the
    live replicas or fewer, so a replacement that heartbeats while it builds its model, reads its data
    and resumes would hold a lone peer's steps all that time instead of letting it go on."""

    def __init__(self, dist_cfg, device: torch.device):
        # one line now, not at the first step, when torchft is missing
        torchft()
        self.dist_cfg = dist_cfg
        self.device = device
        self.lighthouse = lighthouse_of(dist_cfg)
        self.replica_id = replica_id(dist_cfg)
        self.timeout_s = dist_cfg.timeout_s
        # a peer's state that this replica could not load (serve_state)
        self.heal_error: Exception | None = None
        # the replicas started with this one have all come to their first quorum (meet_at_start)
        self.met = False
        # what a healing peer copies and how this one loads a peer's (serve_state), until join()
        self.state_fns: tuple[Callable, Callable] | None = None
        self.manager = None
        # since when the quorums have been smaller than dist.min_replicas (too_few)
        self.short_since: float | None = None

    def join(self) -> None:
        """The store, the process group and torchft's manager, which heartbeats from now on (once)."""
        if self.manager is not None:
            return
        ft = torchft()
        timeout = timedelta(seconds=self.timeout_s)
        # the address the other replicas reach this one's store at (one machine: loopback)
        host = "127.0.0.1" if _is_local(self.lighthouse) else socket.gethostname()
        self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if self.device.type == "cuda":
            group = ft.process_group.ProcessGroupNCCL(timeout=timeout)
        else:
            group = ft.process_group.ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = ft.manager.Manager(
                pg=group,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=self.dist_cfg.min_replicas,
                # the quorum is known before the forward: it says which share of the batch is this one's
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timedelta(seconds=min(self.timeout_s, 30)),
                rank=0,
                world_size=1,
                store_addr=host,
                store_port=self.store.port,
                lighthouse_addr=self.lighthouse,
                replica_id=f"replica_{self.replica_id}",
                hostname=host,
                # every replica builds the same weights from the run's seed
                init_sync=False,
            )
        except Exception as e:
            raise self.lost(e) from None
        if self.state_fns is not None:
            self._register_state(*self.state_fns)

    def serve_state(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]) -> None:
        """What a healing peer copies from this replica, and how this one takes a peer's."""
        self.state_fns = (state_dict, load_state_dict)
        if self.manager is not None:
            self._register_state(state_dict, load_state_dict)

    def _register_state(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None]) -> None:
        def heal(saved: dict) -> None:
            # torchft calls it inside start_quorum, whose other failures mean a lost lighthouse
            try:
                load_state_dict(saved)
            except Exception as e:
                self.heal_error = e

        self.manager.register_state_dict_fn("ddplab", heal, state_dict)

    def wrap(self, network: nn.Module) -> nn.Module:
        """The network under torchft's DDP, its gradients averaged over each step's quorum."""
        ddp = torchft().ddp.DistributedDataParallel

        class ReplicaDDP(PassThrough, ddp):
            """torchft's DDP with the hook above, and the network's own attributes passed through."""

            _comm_hook = staticmethod(recovering_comm_hook)

        # the hook's state is this replica: its manager is made at the first quorum, after wrapping
        return ReplicaDDP(self, network)

    def quorum(self, step: int) -> tuple[int, int, int]:
        """Join step `step`'s quorum (healing from a peer first when one is further on): this replica's
        place among its participants, their number, and the quorum's id (a new one: other members)."""
        if not self.met:
            self.met = True
            # heartbeating before it says it has come: the lighthouse then waits for the others
            self.join()
            meet_at_start(os.environ.get(environment.REPLICAS_START), self.replica_id, self.timeout_s)
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        try:
            self.manager.start_quorum()
        except Exception as e:
            raise self.lost(e) from None
        failed = self.heal_error or (err.original_exception if (err := self.manager.errored()) else None)
        if failed is not None:
            # A copy of the training state between this replica and a peer failed (the peer went
            # during the copy, or the state could not be read or loaded): with a state that may not
            # be its peers', this replica must not join their all_reduce. It ends, not as a user's
            # mistake (exit 1), so that `ddplab run` starts its replacement, which heals again.
            raise SystemExit(
                f"ddplab: replica {self.replica_id} left its quorum: copying the training state between it and a "
                f"peer failed ({failed}); its replacement heals again"
            )
        # torchft numbers its quorums, a new number for new members; 0.2.0 keeps it unexposed
        quorum_id = getattr(self.manager, "_quorum_id", -1)
        return self.manager.participating_rank(), self.manager.num_participants(), quorum_id

    def finished_peers(self) -> list[int]:
        """The replicas of this launch that have finished the run (read before each step: a folder's
        listing). Replicas started by another machine's launch, or by hand, are not known here."""
        folder = _start_folder()
        return [r for r in finished_replicas(folder) if r != self.replica_id] if folder else []

    def finished(self) -> None:
        """This replica has taken the run's last step: the other replicas of its launch learn it."""
        if folder := _start_folder():
            mark_finished(folder, self.replica_id)

    def start_sum(self, tensor: torch.Tensor):
        """Start summing `tensor` over the quorum, in place; `wait()` on what it returns says whether
        it went through (a failure started before the commit makes the step not committed)."""
        from torch.distributed import ReduceOp

        return self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)

    def mean(self, tensor: torch.Tensor) -> None:
        """`tensor` made, in place, the mean over the quorum's replicas (the gradients of a module two
        networks share); a failure is the manager's, as in the hook above: the step is not committed."""
        self.manager.allreduce(tensor).wait()

    def commit(self) -> bool:
        """Whether every replica of the quorum got through the step, so each may take it."""
        try:
            return self.manager.should_commit()
        except Exception as e:
            raise self.lost(e) from None

    def too_few(self, size: int) -> bool:
        """Whether a quorum of SIZE replicas is below dist.min_replicas (a lighthouse started with a
        lower --min-replicas formed it): torchft would let the step run and never commit it, and the
        replicas would take it again forever. The step waits for more instead, up to dist.timeout_s,
        then one line."""
        least = self.dist_cfg.min_replicas
        if size >= least:
            self.short_since = None
            return False
        now = time.monotonic()
        self.short_since = self.short_since or now
        if now - self.short_since > self.timeout_s:
            raise LaunchError(
                f"replica {self.replica_id} found no quorum of dist.min_replicas={least} within "
                f"dist.timeout_s={self.timeout_s:g} s: the lighthouse at {self.lighthouse} forms quorums of {size}",
                f"start at least {least} replicas (ddplab run -n, on every node that takes part), or lower "
                "dist.min_replicas; then run the same command: every replica resumes from its last checkpoint",
            )
        time.sleep(0.5)
        return True

    def lost(self, e: BaseException) -> LaunchError:
        """The lighthouse (or this replica's own manager) stopped answering: one line."""
        why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        timed_out = isinstance(e, TimeoutError) or "Timeout expired" in str(e)
        if timed_out and _answers(self.lighthouse):
            # the lighthouse is there: what it waits for is replicas
            return LaunchError(
                f"replica {self.replica_id} found no quorum within dist.timeout_s={self.timeout_s:g} s: the lighthouse "
                f"at {self.lighthouse} answers, and fewer replicas came to it than it forms a quorum of (its "
                "--min-replicas)",
                "start that many replicas (ddplab run -n, on every node that takes part), or start the lighthouse "
                "with a lower --min-replicas; then run the same command: every replica resumes from its last "
                "checkpoint",
            )
        if timed_out:
            why = f"no answer within dist.timeout_s={self.timeout_s:g} s"
        return LaunchError(
            f"replica {self.replica_id} lost the lighthouse at {self.lighthouse} ({why})",
            "start the lighthouse again and run the same command: every replica resumes from its last checkpoint",
        )

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def meet_at_start(place: str | None, replica: int, timeout_s: float) -> None:
    """Before its first quorum, a replica started with others waits until each of them has come to its
    own (or timeout_s has passed): the lighthouse forms a quorum of the replicas it has heard from, so
    one still importing torch or building its model would be left out of step 1 and heal from a peer
    at once. `place` is "FOLDER:COUNT" (the launcher's): each replica leaves a file there (the
    launcher leaves one for a replica that ended for good); a replacement finds its predecessor's
    and never waits."""
    if not place:
        return
    folder, _, count = place.rpartition(":")
    arrived(folder, replica)
    deadline = time.monotonic() + timeout_s
    # the folder holds the launcher's lock file (launch/scratch.py) besides the replicas' files
    while sum(name.startswith("replica-") for name in os.listdir(folder)) < int(count):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def arrived(folder: str, replica: int) -> None:
    """Replica `replica` is at its first quorum, or has ended and will not come: its peers stop
    waiting for it (meet_at_start)."""
    open(os.path.join(folder, f"replica-{replica}"), "w").close()


def mark_finished(folder: str, replica: int) -> None:
    """Replica `replica` has taken the run's last step: a replica of this launch that still asks for a
    quorum after that is behind, with nobody left to heal from (finished_replicas)."""
    open(os.path.join(folder, f"finished-{replica}"), "w").close()


def finished_replicas(folder: str) -> list[int]:
    """The replicas of this machine's launch that have taken the run's last step (mark_finished)."""
    return sorted(int(name.split("-", 1)[1]) for name in os.listdir(folder) if name.startswith("finished-"))


def _start_folder() -> str | None:
    """The folder the replicas of this machine's launch meet in (meet_at_start), if `ddplab run` started this one."""
    place = os.environ.get(environment.REPLICAS_START)
    return place.rpartition(":")[0] if place else None


def _is_local(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def _answers(address: str) -> bool:
    """Whether a lighthouse takes connections at `address` now."""
    host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def wait_for_lighthouse(address: str, timeout_s: float) -> None:
    """Before a replica starts: the lighthouse answers at `address`, else one line."""
    host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"no lighthouse answers at {address} ({e.strerror or e})",
                    "start it first: ddplab lighthouse --port PORT (or leave dist.lighthouse unset on one machine)",
                ) from None
            time.sleep(0.2)
