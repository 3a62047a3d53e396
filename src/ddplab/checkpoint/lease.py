"""One job at a time writes a run in object storage: a lease in the bucket, taken by a create the
store enforces.

A run folder on disk is locked with flock (train/rundir.py), which the OS lets go when the process
dies. A bucket has no lock, and two jobs given the same run name would both write it: one's config,
the other's checkpoints, an overwritten final/, both exiting 0. So the job that trains a run in a
bucket holds a lease there, `RUN/.ddplab-lease/NNNNNNNN` (a JSON record: the job, its host and
process, a counter), created with If-None-Match, which the store refuses for a name that exists,
and rewritten (its counter raised) every quarter of run.storage_lease_s while the job runs. A job
that finds the newest lease another's:

- takes it over at once when it is the same job (torch's agent restarted its workers: the same
  TORCHELASTIC_RUN_ID), or when its process, on this machine, no longer exists;
- else watches it for run.storage_lease_s: renewed, the run is in use, and the job is refused in one
  line; not renewed, its job is gone (killed, its machine lost), and the run is taken over by
  creating the next number: of several jobs that try, the store lets one succeed.

A holder that finds a newer number than its own stalled for longer than the lease, and another job
took the run over: it uploads nothing more, and its run ends in one line saying so."""

import contextlib
import json
import os
import socket
import threading
import time

from .. import environment
from ..errors import DdplabError
from .objects import ObjectStore, StorageError

LEASES = ".ddplab-lease"


def job_id() -> str:
    """This job: the id torch's agent gives every worker of one launch (restarts included), else this process."""
    return os.environ.get(environment.ELASTIC_RUN_ID) or f"{socket.gethostname()}:{os.getpid()}"


class RunLease:
    """This job's hold on one run in a bucket (module docstring)."""

    def __init__(self, store: ObjectStore, lease_s: float, warn=print):
        self.store = store
        self.lease_s = lease_s
        self.warn = warn
        self.number: int | None = None
        self.beat = 0
        # the record of the job that took the run over from this one, once it did
        self.lost: dict | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def take(self, say=print) -> None:
        """Hold the run, or raise one line naming the job that holds it. `say`: a line while it waits."""
        while True:
            newest = self._newest()
            if newest is not None and not self._may_take(*newest, say):
                number, held = newest
                raise DdplabError(
                    f"run {self.store.url} is being written by another job ({_who(held)}), whose hold on it in "
                    f"the bucket was renewed within run.storage_lease_s={self.lease_s:g} s",
                    "wait for that job to end, or give this run another run.name",
                )
            number = 1 if newest is None else newest[0] + 1
            if self.store.create_bytes(self._record(), LEASES, f"{number:08d}"):
                break
            # another job created that number first: look again
        self.number = number
        for older in self._numbers():
            if older < number:
                self.store.remove(LEASES, f"{older:08d}")
        self._renewer = threading.Thread(target=self._renew, name="ddplab-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """The end of the job: the run is free for the next one at once."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.lease_s)
        if self.number is not None and self.lost is None:
            # (a store that does not answer: the next job finds the lease not renewed, and takes the
            # run over after run.storage_lease_s)
            with contextlib.suppress(StorageError):
                self.store.remove(LEASES, f"{self.number:08d}")
        self.number = None

    def _may_take(self, number: int, held: dict, say) -> bool:
        """Whether the run held by `held` (lease `number`) may be taken: the same job, a process of
        this machine that is gone, or a lease not renewed for run.storage_lease_s."""
        if held.get("job") == job_id():
            return True
        if held.get("host") == socket.gethostname() and not _alive(held.get("pid")):
            return True
        say(
            f"run {self.store.url} is held by another job ({_who(held)}): watching for up to "
            f"{self.lease_s:g} s (run.storage_lease_s) whether it still renews its hold"
        )
        deadline = time.monotonic() + self.lease_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.lease_s / 8))
            now = self._newest()
            if now is None or now[0] != number:
                # let go (the job ended), or taken over by a third: look again
                return now is None
            if now[1].get("beat") != held.get("beat"):
                return False
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                newest = self._newest()
                if newest is not None and newest[0] > self.number:
                    self.lost = newest[1]
                    self.warn(
                        f"ddplab: warning: run {self.store.url} was taken over by another job ({_who(newest[1])}) "
                        f"after this one did not renew its hold for run.storage_lease_s={self.lease_s:g} s; "
                        "nothing more is uploaded"
                    )
                    return
                self.beat += 1
                self.store.put_bytes(self._record(), LEASES, f"{self.number:08d}")
            except StorageError:
                # a store that does not answer now: the next beat tries again
                continue

    def _record(self) -> bytes:
        record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(), "beat": self.beat}
        return json.dumps(record).encode()

    def _numbers(self) -> list[int]:
        names = (key.rsplit("/", 1)[-1] for key in self.store.find(LEASES))
        return sorted(int(name) for name in names if name.isdigit())

    def _newest(self) -> tuple[int, dict] | None:
        """The newest lease and its record, or None when the run is free."""
        numbers = self._numbers()
        if not numbers:
            return None
        try:
            held = json.loads(self.store.read_bytes(LEASES, f"{numbers[-1]:08d}"))
        except (StorageError, ValueError):
            # let go between the listing and the read, or written half: the holder is still to be known
            held = {}
        return numbers[-1], held if isinstance(held, dict) else {}


def _who(held: dict) -> str:
    return f"process {held.get('pid', '?')} on {held.get('host', '?')}"


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
