"""A run in object storage (run.dir=s3://bucket/prefix): written to a local copy first, then mirrored.

    s3://bucket/prefix/<experiment>/<name>/   the run, in the same layout as on disk
    run.local_dir/<experiment>/<name>/        its local copy: checkpoints are committed here first,
                                              logs and TensorBoard stay here

Object storage has no atomic rename (S3's move is a copy then a delete), so the local commit by
rename cannot be repeated there. A checkpoint is uploaded object by object, and its marker,
COMMITTED, goes last, holding the meta and each object's size and SHA-256: a reader (store.py)
sees a checkpoint only once its marker exists, and checks every object against it. Retention in
the bucket deletes a checkpoint's marker before its objects, and only after the newer one is
committed, so no reader ever sees half a checkpoint, and a kill at any moment loses at most the
checkpoint being uploaded. Rank 0 uploads, from the thread that wrote the checkpoint (with
checkpoint.async_save, in the background)."""

import os
import sys

from ..distributed.console import print_rank
from ..errors import DdplabError
from .objects import StorageError, join, store_for
from .store import COMMITTED, META, STATE, STEP_NAME, CheckpointInfo, kept, list_checkpoints

# the run's own record, uploaded with every checkpoint and at the end; summary.json last of all
RECORD = ("config.yaml", "run.json", "metrics.jsonl", "log.txt")
SUMMARY = "summary.json"


def run_of(url: str) -> str:
    """The run a URL points into: itself, or the run of a checkpoint (…/checkpoints/step-N[/state.pt])."""
    parts = url.rstrip("/").split("/")
    if parts[-1] == STATE:
        parts = parts[:-1]
    if len(parts) > 2 and parts[-2] == "checkpoints":
        parts = parts[:-2]
    return "/".join(parts)


class NotUploaded(DdplabError):
    """The newest checkpoint is on this machine's disk and not in the bucket (`cause`: why)."""

    def __init__(self, message: str, fix: str, cause: str):
        super().__init__(message, fix)
        self.cause = cause


class RunMirror:
    """The bucket's copy of one run, kept by rank 0."""

    def __init__(self, url: str, local: str):
        self.url = url.rstrip("/")
        self.local = local
        self.store = store_for(self.url)

    @property
    def checkpoints(self) -> str:
        return join(self.url, "checkpoints")

    def fetch_record(self) -> None:
        """The run's record from the bucket into this machine's copy, where the bucket's is further
        along (a new node, an empty disk, a disk another machine's run went on from): its owner and
        settings (config.yaml, run.json) are checked, and its history (metrics.jsonl, log.txt, each
        attempt's start) goes on from where it was, as if the run had always been here. A local file
        that already holds the bucket's and more (lines written after the last upload) stays."""
        names = set(self.store.find())
        for name in RECORD:
            local = os.path.join(self.local, name)
            if name not in names:
                continue
            remote = self.store.read_bytes(name)
            here = _read(local)
            if here is not None and (remote.startswith(here) and len(remote) > len(here)):
                here = None
            elif here is not None and not here.startswith(remote) and self._bucket_is_ahead():
                # each went on from a common part: the bucket's is the run that goes on now
                here = None
            if here is None:
                with open(local, "wb") as f:
                    f.write(remote)

    def fetch_for_reading(self) -> None:
        """The run's record and summary into an empty folder, for the tools that read a run
        (`ddplab report`): what is there, as it is."""
        names = set(self.store.find())
        for name in (*RECORD, SUMMARY):
            if name in names:
                with open(os.path.join(self.local, name), "wb") as f:
                    f.write(self.store.read_bytes(name))

    def _bucket_is_ahead(self) -> bool:
        """The bucket holds a newer checkpoint than this machine's copy (the run went on elsewhere)."""
        remote = list_checkpoints(self.checkpoints)
        local = list_checkpoints(os.path.join(self.local, "checkpoints"))
        return bool(remote) and (not local or remote[-1].step > local[-1].step)

    def upload_checkpoint(self, folder: str) -> None:
        """A committed local checkpoint folder: its objects, then its marker. A same-named one in the
        bucket (the same step saved again) loses its marker first, so it is never seen half replaced."""
        name = os.path.basename(folder)
        self.store.remove("checkpoints", name, COMMITTED)
        for part in (STATE, META):
            self.store.put_file(os.path.join(folder, part), "checkpoints", name, part)
        self.store.put_file(os.path.join(folder, COMMITTED), "checkpoints", name, COMMITTED)

    def prune(self, keep_last: int, keep_best: int, mode: str) -> None:
        """The bucket's retention, by the same rule as the local folder's (store.kept); a folder
        without a marker is an upload cut short, and goes too."""
        keep = {os.path.basename(i.path) for i in kept(list_checkpoints(self.checkpoints), keep_last, keep_best, mode)}
        folders = {key.split("/")[1] for key in self.store.find("checkpoints") if "/" in key}
        # only checkpoint folders: anything else a user keeps there stays
        folders = {name for name in folders if STEP_NAME.match(name)}
        for name in sorted(folders - keep):
            self.store.remove("checkpoints", name, COMMITTED)
            self.store.remove("checkpoints", name)

    def upload_record(self, final: bool = False) -> None:
        """The run's record; at the end also final/, results/ and, last, summary.json (a finished run's mark)."""
        for name in RECORD:
            path = os.path.join(self.local, name)
            if os.path.isfile(path):
                self.store.put_file(path, name)
        if not final:
            return
        for sub in ("final", "results"):
            folder = os.path.join(self.local, sub)
            for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
                if os.path.isfile(os.path.join(folder, name)):
                    self.store.put_file(os.path.join(folder, name), sub, name)
        if os.path.isfile(os.path.join(self.local, SUMMARY)):
            self.store.put_file(os.path.join(self.local, SUMMARY), SUMMARY)


def _read(path: str) -> bytes | None:
    """A file's bytes, or None where there is none."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


class Uploads:
    """What CheckpointManager's writer does after each local commit, with the bucket's failures kept
    apart: a save whose upload fails is still committed locally, the run goes on, and the next save
    uploads again. What is not in the bucket at the end is an error (confirm)."""

    def __init__(self, mirror: RunMirror, keep_last: int, keep_best: int, mode: str, lease=None):
        self.mirror = mirror
        self.rule = (keep_last, keep_best, mode)
        # this job's hold on the run (checkpoint/lease.py): once another job took it over, nothing is uploaded
        self.lease = lease
        # the newest local checkpoint that is not in the bucket, and why
        self.missing: tuple[str, StorageError] | None = None

    def after_commit(self, folder: str) -> None:
        if self.lease is not None and self.lease.lost is not None:
            holder = self.lease.lost
            cause = (
                f"process {holder.get('pid', '?')} on {holder.get('host', '?')} took the run over after this job "
                f"did not renew its hold for run.storage_lease_s={self.lease.lease_s:g} s"
            )
            self.missing = (folder, StorageError(cause, "let that job train the run; this one's last steps are local"))
            return
        try:
            self.mirror.upload_checkpoint(folder)
            self.mirror.prune(*self.rule)
            self.mirror.upload_record()
            self.missing = None
        except StorageError as e:
            self.missing = (folder, e)
            print_rank(
                f"ddplab: warning: checkpoint {os.path.basename(folder)} is saved in {os.path.dirname(folder)} but "
                f"not in {self.mirror.checkpoints} ({e.cause}); training goes on and the next save uploads again",
                file=sys.stderr,
            )

    def confirm(self) -> None:
        """At the end of training or a stop: the newest checkpoint must be in the bucket (tried once more)."""
        if self.missing is None:
            return
        folder, _ = self.missing
        self.after_commit(folder)
        if self.missing is not None:
            cause = self.missing[1].cause
            taken = self.lease is not None and self.lease.lost is not None
            raise NotUploaded(
                f"checkpoint {os.path.basename(folder)} is saved in {os.path.dirname(folder)} but could not be "
                f"uploaded to {self.mirror.checkpoints} ({cause})",
                self.missing[1].fix
                if taken
                else "run the same command again once the store answers: it uploads that checkpoint first "
                "(a machine without this disk would resume from the bucket's older one)",
                self.missing[1].reason or cause,
            )

    def catch_up(self, local: list[CheckpointInfo]) -> None:
        """Before a resume: a local checkpoint newer than the bucket's newest (its upload failed) goes
        up first, so every rank, on whatever machine, resumes from the same one."""
        remote = list_checkpoints(self.mirror.checkpoints)
        if local and (not remote or local[-1].step > remote[-1].step):
            self.mirror.upload_checkpoint(local[-1].path)
            self.mirror.prune(*self.rule)
