"""The run directory: `run.dir/<experiment>/<run.name or start time>/`, one job's at a time.

Rank 0 chooses the name and every rank receives it; without `run.name` it is the start time (launch/plan.py),
kept across agent restarts so restarted workers find their checkpoints. While a job trains rank 0 holds
a lock on the folder; `run.json` records its owner."""

import contextlib
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from .. import environment
from ..checkpoint import objects
from ..checkpoint.objects import is_url, join
from ..config import save_config
from ..entries import entry_of
from ..errors import ConfigError, DdplabError

if TYPE_CHECKING:
    from ..checkpoint.store import CheckpointManager

SUBDIRS = ("checkpoints", "tensorboard", "results", "final")
# run folder -> the open lock file this process holds on it, and its lease in a bucket
_HELD: dict[str, object] = {}
_LEASES: dict[str, object] = {}


def new_run_name() -> str:
    """The start time and eight random hex digits: 50 runs in one second clash 3 times in 10 million."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def prepare_run_dir(cfg, experiment: str, identity: str, is_main: bool) -> str:
    """Rank 0 makes, locks and checks the folder; every rank gets it, or the same one-line error."""
    # here, not above: the command line reads run folders (names, locks, records) without torch
    from ..checkpoint.mirror import RunMirror
    from ..distributed import collectives, live

    name = cfg.run.name or new_run_name()
    # a run in object storage is written to its local copy first (checkpoint/mirror.py)
    root = cfg.run.local_dir if is_url(cfg.run.dir) else cfg.run.dir
    objects.TIMEOUT_S[0] = cfg.run.storage_timeout_s
    # dist.fault_tolerance=live: each replica keeps a whole run of its own (train/live.py)
    replica = (
        [f"replica-{live.replica_id(cfg.dist)}"] if OmegaConf.select(cfg, "dist.fault_tolerance") == "live" else []
    )
    path = collectives.broadcast_object(os.path.join(root, experiment, name, *replica) if is_main else None)
    problem = None
    if is_main:
        try:
            for sub in SUBDIRS:
                os.makedirs(os.path.join(path, sub), exist_ok=True)
            _lock(path)
            url = run_url(cfg, path)
            if url:
                _hold_in_bucket(path, url, cfg.run.storage_lease_s)
                RunMirror(url, path).fetch_record()
            _check_owner(path, identity, cfg.run.resume, url)
        except OSError as e:
            key = "run.local_dir" if is_url(cfg.run.dir) else "run.dir"
            problem = (f"cannot write the run directory {path} ({e.strerror})", f"pass a writable {key}=PATH")
        except DdplabError as e:
            problem = (e.cause, e.fix)
    problem = collectives.broadcast_object(problem)
    if problem is not None:
        release_run_dir(path)
        raise ConfigError(*problem)
    if not is_main:
        # a node whose disk is its own (a run in object storage needs no shared disk): the folder
        # exists here too, for what each rank writes itself (results, profiles, flight records)
        for sub in SUBDIRS:
            with contextlib.suppress(OSError):
                os.makedirs(os.path.join(path, sub), exist_ok=True)
    return path


def run_url(cfg, path: str) -> str | None:
    """The run's folder in object storage (run.dir/<experiment>/<name>, and /replica-<id> for a replica
    of dist.fault_tolerance=live), or None for a run on disk. `path` is its local copy."""
    if not is_url(cfg.run.dir):
        return None
    return join(cfg.run.dir, *Path(os.path.relpath(path, cfg.run.local_dir)).parts)


def checkpoint_manager(cfg, path: str, is_main: bool) -> "CheckpointManager":
    """The run's checkpoints, in `path`/checkpoints, and with run.dir in object storage also in the
    bucket (uploaded by rank 0, read by every rank)."""
    from ..checkpoint.mirror import RunMirror, Uploads
    from ..checkpoint.store import CheckpointManager

    c = cfg.checkpoint
    url = run_url(cfg, path)
    lease = _LEASES.get(path)
    uploads = Uploads(RunMirror(url, path), c.keep_last, c.keep_best, c.mode, lease) if url and is_main else None
    return CheckpointManager(
        os.path.join(path, "checkpoints"),
        keep_last=c.keep_last,
        keep_best=c.keep_best,
        monitor=c.monitor or None,
        mode=c.mode,
        async_save=c.async_save,
        is_main=is_main,
        remote=join(url, "checkpoints") if url else None,
        uploads=uploads,
    )


def write_run_record(path: str, cfg, info: dict) -> None:
    """config.yaml and run.json, once the run really proceeds (its resume, if any, accepted): a
    refused resume leaves the run's own record as it was."""
    save_config(cfg, os.path.join(path, "config.yaml"))
    write_run_info(path, info)


def run_info(exp, identity: str, plan, steps_per_epoch: int | None, resumed_at_step: int) -> dict:
    """run.json: who trained this folder, where, and with which batch plan."""
    return {
        "experiment": exp.experiment_name,
        "target": identity,
        "entry": entry_of(type(exp)),
        "world_size": exp.rt.world_size,
        "backend": exp.rt.backend,
        "device": exp.device.type,
        "global_batch": plan.global_batch,
        "micro_batch": plan.micro_batch,
        "accumulate": plan.accumulate,
        "steps_per_epoch": steps_per_epoch,
        "resumed_at_step": resumed_at_step,
    }


def experiment_identity(cls: type) -> str:
    """`module.Class` (a class run as `__main__` is named by its file, as `ddplab run file.py:Class` does;
    one a session sent its workers by the session's name for it, so both may write the same run)."""
    module = cls.__module__
    if module == "__main__":
        module = os.environ.get(environment.SESSION_MAIN) or main_module_name()
    return f"{module}.{cls.__qualname__}"


def main_module_name() -> str:
    """What this process's `__main__` is called: its file's name, `__main__` in a notebook."""
    return os.path.splitext(os.path.basename(getattr(sys.modules["__main__"], "__file__", "__main__")))[0]


def release_run_dir(path: str) -> None:
    lease = _LEASES.pop(path, None)
    if lease is not None:
        lease.release()
    held = _HELD.pop(path, None)
    if held is not None:
        held.close()


def _hold_in_bucket(path: str, url: str, lease_s: float) -> None:
    """The run's lease in its bucket (checkpoint/lease.py), held while this process trains it, as
    `.lock` is on disk."""
    from ..checkpoint.lease import RunLease
    from ..checkpoint.objects import store_for
    from ..distributed.console import print_rank

    lease = RunLease(store_for(url), lease_s, warn=lambda line: print_rank(line, file=sys.stderr))
    lease.take(say=lambda line: print_rank(f"ddplab: {line}"))
    _LEASES[path] = lease


def is_locked(path: str) -> bool:
    """A training job holds `.lock` (_lock below); the OS lets it go when the job ends, even killed."""
    lock = os.path.join(path, ".lock")
    # a FIFO or a folder where the lock should be (a damaged folder) would block or fail the open
    if not os.path.isfile(lock):
        return False
    with contextlib.suppress(OSError), open(lock) as f:
        # none: it never trained
        with contextlib.suppress(BlockingIOError):
            # free: let go at once, as the file closes
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        return True
    return False


def _lock(path: str) -> None:
    """flock `<run>/.lock` while this process trains: the OS drops it when the process dies, so it is never stale."""
    # this process's own earlier fit() in the same folder
    release_run_dir(path)
    # held open, and so locked, until release_run_dir() or the process's end
    f = open(os.path.join(path, ".lock"), "a+")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.readline().strip() or "another process"
        f.close()
        raise ConfigError(
            f"run folder {path} is in use by {holder}", "wait for that job to end, or give this one another run.name"
        ) from None
    # "a+": the write below lands at the start
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _HELD[path] = f


def _check_owner(path: str, identity: str, resume: str, url: str | None) -> None:
    """A run folder belongs to one experiment, and run.resume=never never writes into a used one
    (nor into a run whose checkpoints are in its bucket)."""
    from ..checkpoint.store import list_checkpoints

    owner = read_json(os.path.join(path, "run.json")).get("target")
    if owner and owner != identity:
        raise ConfigError(
            f"run folder {path} belongs to experiment {owner}, not {identity}", "give this run another run.name"
        )
    used = list_checkpoints(os.path.join(path, "checkpoints")) or (url and list_checkpoints(join(url, "checkpoints")))
    if resume == "never" and used and not environment.restart_count():
        raise ConfigError(
            f"run.resume=never, but run folder {path} already holds checkpoints of a run (it would overwrite them)",
            "give this run another run.name, or drop run.resume=never to resume it",
        )


def write_run_info(run_dir: str, info: dict) -> None:
    """`run.json`: what the config alone does not say (world size, batch plan, backend), for
    `ddplab report`. It keeps the first start time, and the start of every attempt (each start of
    the workers: a resume, an elastic restart), so wall time can count training, not the time between."""
    before = read_json(os.path.join(run_dir, "run.json"))
    now = time.time()
    # a run.json of an older ddplab has no attempts: its first start stands for them
    attempts = before.get("attempts") or ([before["started_at"]] if before.get("started_at") else [])
    with open(os.path.join(run_dir, "run.json"), "w") as f:
        json.dump({**info, "started_at": before.get("started_at") or now, "attempts": [*attempts, now]}, f, indent=1)


def read_json(path: str | None) -> dict:
    """A small JSON file a run writes (run.json, summary.json, a stop note), or {} when it is not there
    (yet), is no regular file (a FIFO would block the read for good) or holds something else than an
    object (a damaged folder)."""
    if not (path and os.path.isfile(path)):
        return {}
    with contextlib.suppress(OSError, TypeError, ValueError), open(path) as f:
        found = json.load(f)
        return found if isinstance(found, dict) else {}
    return {}
