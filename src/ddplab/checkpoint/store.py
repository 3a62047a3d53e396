"""Checkpoints that survive kills: atomic, pruned safely, loadable without unpickling code.

    <run>/checkpoints/step-00000040/  state.pt, meta.json, COMMITTED (last: a folder without it is ignored)

A save writes `.tmp-step-…/`, fsyncs, renames it into place and fsyncs the parent; only then are older
ones pruned. Rank 0 writes; with `async_save` a thread writes a CPU copy."""

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
from torch.utils._pytree import tree_map_only

from ..distributed.console import print_rank
from ..errors import DdplabError

STATE = "state.pt"
META = "meta.json"
COMMITTED = "COMMITTED"
_NAME = re.compile(r"^step-(\d{8})$")
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
    ):
        self.directory = directory
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.async_save = async_save
        self.is_main = is_main
        # a background save, and its failure for wait() to raise
        self._thread = None
        self._error = None
        os.makedirs(directory, exist_ok=True)

    # ---- writing -----------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, epoch: int, metric: float | None) -> None:
        """Commit `state` as the checkpoint of `step` (rank 0 only; call after the collectives)."""
        self.wait()
        if not self.is_main:
            return
        meta = {"step": step, "epoch": epoch, "metric": metric, "monitor": self.monitor, "time": time.time()}
        if self.async_save:
            # a CPU copy: training may change the live tensors meanwhile
            snapshot = tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)
            self._thread = threading.Thread(target=self._write_guarded, args=(snapshot, meta), daemon=True)
            self._thread.start()
        else:
            self._write(state, meta)

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error here, in the main thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error = self._error
            self._error = None
            raise error

    def _write_guarded(self, state, meta) -> None:
        try:
            self._write(state, meta)
        except BaseException as e:
            # surfaced by wait()
            self._error = e

    def _write(self, state: dict[str, Any], meta: dict[str, Any]) -> None:
        name = f"step-{meta['step']:08d}"
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".tmp-{name}")
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
            raise DdplabError(
                f"could not write checkpoint {final} ({cause.strerror or cause}); older checkpoints are untouched",
                "free disk space or point run.dir at a writable disk",
            ) from None
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

    def _write_files(self, tmp: str, state: dict[str, Any], meta: dict[str, Any]) -> None:
        _atomic_file(os.path.join(tmp, STATE), lambda f: torch.save(state, f))
        meta["size"] = os.path.getsize(os.path.join(tmp, STATE))
        _atomic_file(os.path.join(tmp, META), lambda f: f.write(json.dumps(meta).encode()))
        _atomic_file(os.path.join(tmp, COMMITTED), lambda f: f.write(b"ok\n"))

    # ---- reading -----------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        return list_checkpoints(self.directory)

    def prune(self) -> None:
        """Delete committed checkpoints that are neither among the last K nor the best K."""
        infos = self.list()
        keep = {i.path for i in infos[-self.keep_last :]} if self.keep_last > 0 else {i.path for i in infos}
        keep |= {i.path for i in self.best()}
        for info in infos:
            if info.path not in keep:
                shutil.rmtree(info.path, ignore_errors=True)
        for leftover in os.listdir(self.directory):
            # temp dirs of saves that were killed
            if leftover.startswith((".tmp-", ".old-")):
                shutil.rmtree(os.path.join(self.directory, leftover), ignore_errors=True)

    def best(self) -> "list[CheckpointInfo]":
        return best_checkpoints(self.list(), self.mode, self.keep_best)


def best_checkpoints(infos: "list[CheckpointInfo]", mode: str, k: int) -> "list[CheckpointInfo]":
    """The k best by the monitored metric, best first; a NaN or infinite value is never among them
    (a NaN sorts anywhere, and would make the real best the one pruned, or the one marked best)."""
    scored = [info for info in infos if info.metric is not None and math.isfinite(info.metric)]
    scored.sort(key=lambda info: info.metric, reverse=mode == "max")
    return scored[:k]


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """The committed checkpoints of `directory`, oldest first. One whose meta.json is damaged
    (unreadable, empty, a field missing) is named in a warning, once, and left out: never resumed
    from in silence, never fatal to the tools that list checkpoints."""
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        if _NAME.match(name) and os.path.exists(os.path.join(path, COMMITTED)):
            info = _read_meta(path)
            if info is not None:
                out.append(info)
    return out


def _read_meta(path: str) -> CheckpointInfo | None:
    try:
        if not os.path.isfile(os.path.join(path, META)):
            # a FIFO would block the read for good
            raise ValueError("not a regular file")
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
                f"ddplab: warning: checkpoint {path} has a damaged {META} ({why}); it is skipped", file=sys.stderr
            )
        return None
    metric = meta.get("metric")
    if not isinstance(metric, (int, float)) or isinstance(metric, bool):
        metric = None
    return CheckpointInfo(path, step, epoch, metric, meta.get("size", 0), meta.get("time", 0.0))


def load_state(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one checkpoint (a step directory or its state.pt) with `weights_only=True`."""
    file = os.path.join(path, STATE) if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise DdplabError(
            f"checkpoint {path} does not exist", "check the path; `ddplab checkpoints RUN_DIR` lists them"
        )
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
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
            "pass another checkpoint (`ddplab checkpoints RUN_DIR` lists them) or start a new run (another run.name)",
        ) from None


class CorruptCheckpoint(DdplabError):
    """A checkpoint file exists but does not load (truncated, overwritten, not a checkpoint)."""


def load_latest_valid(directory: str, map_location="cpu") -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest checkpoint that loads (a corrupt one is reported and skipped); none: an error, not step 0."""
    infos = list_checkpoints(directory)
    for info in reversed(infos):
        try:
            return info, load_state(info.path, map_location)
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
    """A checkpoint directory, a state.pt, or a run directory (its latest checkpoint)."""
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
