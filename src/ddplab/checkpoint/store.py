"""Checkpoints that survive kills: atomic, pruned safely, loadable without unpickling code.

    <run>/checkpoints/step-00000040/  state.pt, meta.json, COMMITTED (last: a folder without it is ignored)

A save writes `.tmp-step-…/`, fsyncs, renames it into place and fsyncs the parent; only then are older
ones pruned. Rank 0 writes; with `async_save` a thread writes a CPU copy. COMMITTED records each
file's size and SHA-256, checked on load: a file changed or cut short after its commit is never
loaded. The same folder in object storage (run.dir=s3://...) is read here too; mirror.py uploads it."""

import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.serialization import default_restore_location
from torch.utils._pytree import tree_map_only

from ..distributed.console import print_rank
from ..errors import DdplabError
from . import sharded
from .objects import StorageError, is_url, store_for

STATE = "state.pt"
META = "meta.json"
COMMITTED = "COMMITTED"
# a checkpoint folder's name
STEP_NAME = re.compile(r"^step-(\d{8})$")
# the fix for a checkpoint that cannot be read
ANOTHER = "pass another checkpoint (`ddplab checkpoints RUN_DIR` lists them) or start a new run (another run.name)"
# checkpoints with a damaged meta.json this process has already warned of
_WARNED: set[str] = set()


@dataclass
class CheckpointInfo:
    path: str
    step: int
    epoch: int
    metric: float | None
    size: int
    time: float
    # which way the metric is better ("max"/"min"), as the run's settings said; None before it was kept
    mode: str | None = None


class CheckpointManager:
    """Writes, lists, prunes and finds checkpoints of one run directory."""

    def __init__(
        self,
        directory: str,
        keep_last: int = 2,
        keep_best: int = 0,
        monitor: str | None = None,
        mode: str = "max",
        async_save: bool = False,
        is_main: bool = True,
        remote: str | None = None,
        uploads=None,
    ):
        self.directory = directory
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.async_save = async_save
        self.is_main = is_main
        # run.dir in object storage: the bucket's checkpoints (every rank), and on rank 0 mirror.Uploads,
        # told of each local commit
        self.remote = remote
        self.uploads = uploads
        # a background save, and its failure for wait() to raise; a rank's shards still being written
        # (sharded async save) and the process group they are written over
        self._thread = None
        self._error = None
        self._pending = None
        self._group = None
        os.makedirs(directory, exist_ok=True)

    # ---- writing -----------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, epoch: int, metric: float | None) -> None:
        """Commit `state` as the checkpoint of `step`: every rank calls it after the collectives; rank 0
        writes, and with sharded networks (dist.strategy=fsdp) every rank writes its own shards first."""
        self.wait()
        state, shards = sharded.split(state)
        if not self.is_main and not shards:
            return
        meta = {
            "step": step,
            "epoch": epoch,
            "metric": metric,
            "monitor": self.monitor,
            "mode": self.mode,
            "time": time.time(),
        }
        written = self._save_shards(shards, meta) if shards else None
        if not self.is_main:
            return
        staged = bool(shards)
        if self.async_save:
            # a CPU copy: training may change the live tensors meanwhile
            snapshot = tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)
            args = (snapshot, meta, staged, written)
            self._thread = threading.Thread(target=self._write_guarded, args=args, daemon=True)
            self._thread.start()
        else:
            self._write(state, meta, staged)

    def _save_shards(self, shards: dict, meta: dict[str, Any]):
        """Every rank writes its shards into the step's temporary folder, which rank 0 has made empty
        (before anyone writes: a barrier); the commit stays rank 0's. Returns what the commit waits
        for: None (written), or, with async_save, DCP's future (on rank 0; elsewhere wait() holds it)."""
        tmp = os.path.join(self.directory, f".tmp-step-{meta['step']:08d}")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        from torch.distributed.checkpoint.api import CheckpointException

        if self.async_save and self._group is None:
            # DCP's background collectives on a group of their own, never interleaved with training's
            self._group = dist.new_group(backend="gloo")
        try:
            future = sharded.save_shards(shards, os.path.join(tmp, sharded.SHARDS), self._group, self.async_save)
        except (OSError, CheckpointException) as e:
            raise _write_failed(os.path.join(self.directory, os.path.basename(tmp)[5:]), e) from None
        if self.is_main:
            return future
        self._pending = future
        return None

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error here, in the main thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        if self._error is not None:
            error = self._error
            self._error = None
            raise error

    def settle(self, final: bool = False) -> None:
        """wait(), and with run.dir in object storage: the newest checkpoint is in the bucket or this
        raises; `final`: the run's final/ and summary.json go up too."""
        self.wait()
        if self.uploads is not None:
            self.uploads.confirm()
            if final:
                self.uploads.mirror.upload_record(final=True)

    def shared(self, path: str) -> str:
        """Where every rank, on any machine, reads checkpoint `path` of this run: its copy in the
        bucket when run.dir is in object storage (a rank beside rank 0 reads the local copy then)."""
        return f"{self.remote}/{os.path.basename(path)}" if self.remote else path

    def _write_guarded(self, state, meta, staged: bool = False, written=None) -> None:
        try:
            if written is not None:
                # every rank's shards first (DCP's future completes on rank 0 once all are written)
                written.result()
            self._write(state, meta, staged)
        except BaseException as e:
            # surfaced by wait()
            self._error = e

    def _write(self, state: dict[str, Any], meta: dict[str, Any], staged: bool = False) -> None:
        """Write, then commit by renaming; `staged`: the temporary folder holds the shards already."""
        name = f"step-{meta['step']:08d}"
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".tmp-{name}")
        if staged:
            state = {**state, sharded.SHARDS: sharded.SHARDS}
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        try:
            self._write_files(tmp, state, meta)
        except (OSError, RuntimeError) as e:
            # torch.save reports a failed write as a RuntimeError
            cause = e if isinstance(e, OSError) else e.__context__
            if not isinstance(cause, OSError):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_failed(final, cause) from None
        old = None
        if os.path.exists(final):
            # the same step saved again: move the old one aside, never delete first
            old = os.path.join(self.directory, f".old-{name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self.prune()
        if self.uploads is not None:
            self.uploads.after_commit(final)

    def _write_files(self, tmp: str, state: dict[str, Any], meta: dict[str, Any]) -> None:
        _atomic_file(os.path.join(tmp, STATE), lambda f: torch.save(state, f))
        files = [STATE, *sharded.shard_files(tmp)]
        meta["size"] = sum(os.path.getsize(os.path.join(tmp, name)) for name in files)
        _atomic_file(os.path.join(tmp, META), lambda f: f.write(json.dumps(meta).encode()))
        marker = commit_marker(tmp, meta)
        _atomic_file(os.path.join(tmp, COMMITTED), lambda f: f.write(marker))

    # ---- reading -----------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        return list_checkpoints(self.directory)

    def prune(self) -> None:
        """Delete committed checkpoints that are neither among the last K nor the best K."""
        infos = self.list()
        keep = {i.path for i in kept(infos, self.keep_last, self.keep_best, self.mode)}
        for info in infos:
            if info.path not in keep:
                shutil.rmtree(info.path, ignore_errors=True)
        for leftover in os.listdir(self.directory):
            # temp dirs of saves that were killed
            if leftover.startswith((".tmp-", ".old-")):
                shutil.rmtree(os.path.join(self.directory, leftover), ignore_errors=True)

    def best(self) -> "list[CheckpointInfo]":
        return best_checkpoints(self.list(), self.mode, self.keep_best)


def kept(infos: "list[CheckpointInfo]", keep_last: int, keep_best: int, mode: str) -> "list[CheckpointInfo]":
    """Retention: the last keep_last (0: all) and the best keep_best; the rest may be deleted."""
    best = {i.path for i in best_checkpoints(infos, mode, keep_best)}
    last = {i.path for i in (infos[-keep_last:] if keep_last > 0 else infos)}
    return [i for i in infos if i.path in best | last]


def best_checkpoints(infos: "list[CheckpointInfo]", mode: str, k: int) -> "list[CheckpointInfo]":
    """The k best by the monitored metric, best first; a NaN or infinite value is never among them
    (a NaN sorts anywhere, and would make the real best the one pruned, or the one marked best)."""
    scored = [info for info in infos if info.metric is not None and math.isfinite(info.metric)]
    scored.sort(key=lambda info: info.metric, reverse=mode == "max")
    return scored[:k]


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """The committed checkpoints of `directory` (a folder or an object-storage URL), oldest first.
    One whose meta.json is damaged (unreadable, empty, a field missing) is named in a warning, once,
    and left out: never resumed from in silence, never fatal to the tools that list checkpoints."""
    if is_url(directory):
        return _list_remote(directory)
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if STEP_NAME.match(name) and os.path.exists(os.path.join(path, COMMITTED)):
            info = _read_meta(path)
            if info is not None:
                out.append(info)
    return out


def _list_remote(url: str) -> list[CheckpointInfo]:
    """A bucket's committed checkpoints: one listing, then each marker (which holds the meta)."""
    store = store_for(url)
    names = {key.split("/")[0] for key in store.find() if key.endswith("/" + COMMITTED)}
    out = []
    for name in sorted(n for n in names if STEP_NAME.match(n)):
        path = f"{store.url}/{name}"
        # the marker holds the meta, and is what a damage there is named by
        info = _read_meta(path, lambda name=name: json.loads(store.read_bytes(name, COMMITTED))["meta"], COMMITTED)
        if info is not None:
            out.append(info)
    return out


def _read_meta(path: str, read=None, source: str = META) -> CheckpointInfo | None:
    try:
        if read is not None:
            meta = read()
        elif not os.path.isfile(os.path.join(path, META)):
            # a FIFO would block the read for good
            raise ValueError("not a regular file")
        else:
            with open(os.path.join(path, META)) as f:
                meta = json.load(f)
        step, epoch = meta["step"], meta["epoch"]
        if not (isinstance(step, int) and isinstance(epoch, int)):
            raise TypeError("step and epoch must be whole numbers")
    except (OSError, ValueError, KeyError, TypeError) as e:
        if path not in _WARNED:
            _WARNED.add(path)
            why = f"no field {e}" if isinstance(e, KeyError) else (getattr(e, "strerror", None) or str(e) or "empty")
            print_rank(
                f"ddplab: warning: checkpoint {path} has a damaged {source} ({why}); it is skipped", file=sys.stderr
            )
        return None
    metric = meta.get("metric")
    if not isinstance(metric, (int, float)) or isinstance(metric, bool):
        metric = None
    mode = meta.get("mode") if meta.get("mode") in ("max", "min") else None
    return CheckpointInfo(path, step, epoch, metric, meta.get("size", 0), meta.get("time", 0.0), mode)


def as_saved_onto(device: str | torch.device):
    """torch.load's map_location for a resume onto `device`: a tensor saved from an accelerator comes
    onto this rank's, and one saved from the CPU stays there. Weights and optimizer state (saved from
    the GPU) land on the GPU; random streams' states and the experiment's own CPU state (a generator
    of augmentations) come back on the CPU, the only place torch sets a generator from."""
    device = torch.device(device)
    if device.type == "cpu":
        return device

    def onto(storage, location: str):
        return storage if location == "cpu" else default_restore_location(storage, str(device))

    return onto


def load_state(path: str, map_location: str | torch.device = "cpu", cache: str | None = None) -> dict[str, Any]:
    """Load one checkpoint (a step directory or its state.pt, a folder or a URL) with `weights_only=True`,
    after checking its files against COMMITTED. A URL's checkpoint is read from `cache`/<step> instead
    when that local copy has the same marker (the folder this run wrote it from)."""
    if is_url(path):
        file, source = path, _fetch(path, cache)
    else:
        file = os.path.join(path, STATE) if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise DdplabError(
                f"checkpoint {path} does not exist", "check the path; `ddplab checkpoints RUN_DIR` lists them"
            )
        _verify_local(file)
        source = file
    try:
        saved = torch.load(source, map_location=as_saved_onto(map_location), weights_only=True)
    except Exception as e:
        # torch's advice to unpickle anyway is not ours to give: "damaged" then
        text = "" if "Weights only load failed" in str(e) else str(e)
        why = (
            "it holds pickled Python objects, which ddplab never loads (weights_only=True)"
            if "Unsupported global" in str(e)
            else f"{type(e).__name__}: {text.splitlines()[0][:100] if text else 'damaged or not a checkpoint'}"
        )
        raise CorruptCheckpoint(
            f"checkpoint {file} cannot be read ({why})",
            ANOTHER,
        ) from None
    if isinstance(saved, dict) and sharded.SHARDS in saved:
        if is_url(path):
            raise DdplabError(
                f"checkpoint {path} is sharded (dist.strategy=fsdp), and ddplab reads sharded checkpoints from a "
                "disk only",
                "copy the run's folder to a disk and pass that path",
            )
        # where the shards are, for sharded.fill
        saved[sharded.SHARDS] = os.path.join(os.path.dirname(file), sharded.SHARDS)
    return saved


class CorruptCheckpoint(DdplabError):
    """A checkpoint file exists but does not load (truncated, overwritten, not a checkpoint)."""


# ---- the commit marker ---------------------------------------------------------------------------
def commit_marker(folder: str, meta: dict[str, Any]) -> bytes:
    """COMMITTED's content: the meta, and each file's size and SHA-256 (read back from the disk)."""
    names = (STATE, META, *sharded.shard_files(folder))
    files = {name: file_digest(os.path.join(folder, name)) for name in names}
    return json.dumps({"meta": meta, "files": files}).encode()


def file_digest(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {"size": os.path.getsize(path), "sha256": digest.hexdigest()}


def read_marker(folder: str) -> dict[str, Any] | None:
    """A local checkpoint's marker; None when it records no files (written before ddplab checked them)."""
    try:
        with open(os.path.join(folder, COMMITTED), "rb") as f:
            marker = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None


def _verify_local(file: str) -> None:
    """state.pt, and a sharded checkpoint's shards, against the marker."""
    folder = os.path.dirname(file)
    marker = read_marker(folder)
    if not marker:
        return
    names = [os.path.basename(file), *(name for name in marker["files"] if name.startswith(sharded.SHARDS + "/"))]
    for name in names:
        path = os.path.join(folder, name)
        expected = marker["files"].get(name)
        if expected and (not os.path.isfile(path) or file_digest(path) != expected):
            raise CorruptCheckpoint(
                f"checkpoint {path} cannot be read (its size or SHA-256 is not what COMMITTED recorded: changed, "
                "cut short or gone after its commit)",
                ANOTHER,
            )


def _write_failed(final: str, cause: BaseException) -> DdplabError:
    why = getattr(cause, "strerror", None) or str(cause).splitlines()[0]
    return DdplabError(
        f"could not write checkpoint {final} ({why}); older checkpoints are untouched",
        "free disk space or point run.dir at a writable disk",
    )


def _fetch(url: str, cache: str | None) -> io.BytesIO:
    """A bucket's state.pt, checked against its marker; the local copy in `cache` when it is the same.
    A missing or damaged object is a damaged checkpoint (the caller falls back to the previous one);
    a store that does not answer is not, and stops the read."""
    folder = url[: -len(STATE) - 1] if url.endswith("/" + STATE) else url.rstrip("/")
    store, name = store_for(folder.rsplit("/", 1)[0]), folder.rsplit("/", 1)[1]

    try:
        expected = json.loads(_read_object(store, folder, name, COMMITTED))["files"][STATE]
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpoint(f"checkpoint {folder} cannot be read (its {COMMITTED} is damaged)", ANOTHER) from None
    local = os.path.join(cache, name, STATE) if cache else None
    if local and os.path.isfile(local):
        with open(local, "rb") as f:
            data = f.read()
        if _digest(data) == expected:
            return io.BytesIO(data)
    data = _read_object(store, folder, name, STATE)
    if _digest(data) != expected:
        raise CorruptCheckpoint(
            f"checkpoint {folder}/{STATE} cannot be read (its size or SHA-256 is not what {COMMITTED} recorded)",
            ANOTHER,
        )
    return io.BytesIO(data)


def _read_object(store, folder: str, *parts: str) -> bytes:
    try:
        return store.read_bytes(*parts)
    except StorageError as e:
        if "FileNotFoundError" not in e.reason:
            raise
        raise CorruptCheckpoint(
            f"checkpoint {folder} cannot be read ({parts[-1]} is gone)",
            ANOTHER,
        ) from None


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def load_latest_valid(
    directory: str, map_location="cpu", cache: str | None = None
) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest checkpoint that loads (a corrupt one is reported and skipped); none: an error, not step 0."""
    infos = list_checkpoints(directory)
    for info in reversed(infos):
        try:
            return info, load_state(info.path, map_location, cache)
        except CorruptCheckpoint as e:
            print_rank(f"ddplab: warning: {e.cause}; falling back to the previous checkpoint", file=sys.stderr)
    if infos:
        names = ", ".join(os.path.basename(i.path) for i in infos)
        raise DdplabError(
            f"none of the checkpoints in {directory} can be read ({names}); nothing was changed",
            "resume from a good copy (run.resume=PATH), or start a new run (another run.name)",
        )
    return None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, a state.pt, or a run directory (its latest checkpoint); in object
    storage too, where a run is known by its committed checkpoints."""
    if is_url(path):
        infos = [] if STEP_NAME.match(path.rstrip("/").rsplit("/", 1)[-1]) else list_checkpoints(path + "/checkpoints")
        return infos[-1].path if infos else path
    if not os.path.exists(path):
        raise DdplabError(
            f"checkpoint {path} does not exist", "check the path; `ddplab checkpoints RUN_DIR` lists them"
        )
    if os.path.isdir(os.path.join(path, "checkpoints")):
        infos = list_checkpoints(os.path.join(path, "checkpoints"))
        if not infos:
            raise DdplabError(f"run {path} has no committed checkpoint", "train it with checkpoints enabled first")
        return infos[-1].path
    return path


def _atomic_file(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
