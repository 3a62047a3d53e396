"""Turn a distributed hang into an error that says which collective and which ranks, with stacks.

When ranks disagree (a skipped collective, another one, another shape) the rest wait until `dist.timeout_s`
and gloo names neither. So every rank's watcher thread answers, through the store on a connection of its
own, with its stack and what it is doing; the rank whose collective failed reports every rank's answer.

Beside the stacks, torch's flight recorder keeps each rank's last collectives (gloo and NCCL alike:
what each was, its sequence number, its sizes, whether it completed). With dist.flight_recorder on
(by default with NCCL) and in a training run, every rank that reports or answers writes its buffer
to RUN/flight_recorder/rank_<r>, the files torch's `torchfrtrace` reads; NCCL's own dump on a
watchdog timeout lands there too."""

import contextlib
import functools
import itertools
import json
import os
import socket
import sys
import threading
import time
import traceback
from types import FrameType, TracebackType

import torch.distributed as dist

from .. import environment
from ..config_rules import switch_value
from ..errors import DdplabError

PREFIX = "ddplab/diagnosis/"
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_TORCH_DISTRIBUTED = os.path.join("torch", "distributed", "")
# source file -> what the collectives called from it are, named by the layers above (name_site)
_SITES: dict[str, str] = {}
_watcher: "StackWatcher | None" = None
# the collectives each rank remembers: 2,000 records, a few hundred KB
FLIGHT_RECORDER_ENTRIES = 2000
# where this rank writes its flight recorder (a run's RUN/flight_recorder; None: not in a run)
_flight_folder: str | None = None


def enable_flight_recorder(setting: bool | str, backend: str) -> None:
    """dist.flight_recorder, before the process group is made: torch reads the sizes when it makes
    the group (NCCL) or records the first collective (gloo). `auto` keeps it on with NCCL, as
    torchtitan does, and off with gloo, where it cost about 5 % of a small CPU step
    (benchmarks/bench_flight_recorder.py). A size the user set in the environment wins."""
    setting = switch_value(setting)
    on = setting is True or (setting == "auto" and backend == "nccl")
    size = os.environ.get(environment.FR_BUFFER_SIZE) or os.environ.get(environment.NCCL_TRACE_BUFFER_SIZE)
    size = size or (str(FLIGHT_RECORDER_ENTRIES) if on else "0")
    # torch reads the NCCL name too, warning on each rank that it is deprecated: set the new one only
    os.environ.setdefault(environment.FR_BUFFER_SIZE, size)
    if size != "0":
        os.environ.setdefault(environment.NCCL_DUMP_ON_TIMEOUT, "1")


def record_flight_to(folder: str) -> None:
    """A training run's folder for the dumps; NCCL's watchdog, which dumps by itself on a timeout,
    is pointed there too (it reads the prefix when it first dumps, into a folder that must exist)."""
    global _flight_folder
    if dist.is_initialized() and dist.get_backend() == "nccl":
        os.makedirs(folder, exist_ok=True)
    _flight_folder = folder
    os.environ[environment.FR_DUMP_FILE] = os.path.join(folder, "rank_")


def dump_flight_recorder(rank: int) -> str | None:
    """Write this rank's flight recorder to the run's folder; the folder, or None (not in a run,
    recorder off, a torch without it, a disk that refuses)."""
    if _flight_folder is None or os.environ.get(environment.FR_BUFFER_SIZE, "0") == "0":
        return None
    try:
        from torch._C import _distributed_c10d as c10d

        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        dump = getattr(c10d, "_dump_nccl_trace", None) if nccl else None
        dump = dump or getattr(c10d, "_dump_fr_trace", None)
        if dump is None:
            return None
        data = dump() if nccl else _name_groups(dump())
        os.makedirs(_flight_folder, exist_ok=True)
        with open(os.path.join(_flight_folder, f"rank_{rank}"), "wb") as f:
            f.write(data)
    except Exception:
        # the diagnosis must go on without it
        return None
    return _flight_folder


def name_site(source_file: str, description: str) -> None:
    """A collective called from `source_file` is named `description` when it hangs (the layers
    above register their own: the training loop's heartbeat is one)."""
    _SITES[os.path.abspath(source_file)] = description


def _name_groups(dump: bytes) -> bytes:
    """gloo's dump describes its groups under one empty name, which torchfrtrace cannot match with
    the entries (keyed by each group's id): describe every group of this process by its id."""
    import pickle

    from torch.distributed.distributed_c10d import _world

    trace = pickle.loads(dump)
    trace["pg_config"] = {
        group.group_name: {
            "name": group.group_name,
            "desc": group.group_desc,
            "ranks": str(dist.get_process_group_ranks(group)),
        }
        for group in _world.pg_map
    }
    return pickle.dumps(trace)


class StackWatcher(threading.Thread):
    """Answers stack requests from other ranks; marks this rank as finished when it is done."""

    def __init__(self, store: dist.Store, rank: int, poll_s: float = 0.5):
        super().__init__(name="ddplab-stack-watcher", daemon=True)
        self.store = store
        self.rank = rank
        self.poll_s = poll_s
        self.main_thread = threading.main_thread().ident
        # set by this rank's own diagnosis too, so its entry is not overwritten; the lock makes
        # "not answered yet, so answer" one step against the diagnosis claiming the entry
        self.answered = False
        self.lock = threading.Lock()
        # not `_stop`: that is a method of Thread, called in forked children
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            try:
                with self.lock:
                    if not self.answered and self.store.check([PREFIX + "request"]):
                        self.answered = True
                        dump_flight_recorder(self.rank)
                        self.store.set(f"{PREFIX}stack/{self.rank}", json.dumps(self.describe()))
            except Exception:
                # the store went away with the job: nothing left to answer
                return

    def describe(self) -> dict:
        frame = sys._current_frames().get(self.main_thread)
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "doing": doing(frame),
            "stack": "".join(traceback.format_stack(frame)) if frame else "",
        }

    def claim(self) -> None:
        """This rank's own diagnosis will publish its entry (naming the collective that failed): from
        now on a peer's request is not answered with wherever the main thread happens to be, e.g.
        formatting the error after its collective already ended."""
        with self.lock:
            self.answered = True

    def finish(self) -> None:
        """This rank's work is done: a peer still waiting on it learns that it had finished."""
        self.stopping.set()
        with contextlib.suppress(Exception):
            # the store may have gone with the job
            self.store.set(f"{PREFIX}finished/{self.rank}", "1")


def start(store: dist.Store, rank: int) -> None:
    """Answer other ranks' stack requests from now on; a second call (ddplab.init() in a script whose
    worker already watches) changes nothing."""
    global _watcher
    if _watcher is not None:
        return
    _watcher = StackWatcher(store, rank)
    _watcher.start()


def watch_own_groups() -> None:
    """A plain script's own `init_process_group()` under ddplab's launcher: each rank answers stack
    requests from when its group is made, in the group's own store. Started only when a collective
    of its own failed, a rank that waits elsewhere (in a sleep, in its data) would never answer, and
    a peer's report would call it exited."""
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.init_process_group, "watched", False):
        return
    init = c10d.init_process_group

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        init(*args, **kwargs)
        # (a group without a store of its own to meet in: nothing to answer through)
        with contextlib.suppress(Exception):
            start(c10d._get_default_store(), dist.get_rank())

    init_process_group.watched = True
    c10d.init_process_group = dist.init_process_group = init_process_group


def explain(e: BaseException, world_size: int, timeout_s: float) -> DdplabError | None:
    """For a collective that timed out or mismatched: print every rank's stack once and return the
    one-line error naming the collective and the ranks; None for any other exception."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _watcher is None:
        # a process group the script made itself: its ranks meet in the group's own store
        with contextlib.suppress(Exception):
            start(dist.distributed_c10d._get_default_store(), dist.get_rank())
    found = diagnose(e, world_size, timeout_s)
    if found is None:
        return None
    cause, stacks = found
    if stacks:
        print(
            f"ddplab: the Python stack of every rank when the collective failed:\n{stacks}", file=sys.stderr, flush=True
        )
    return DdplabError(
        cause,
        "every rank must call the same collectives in the same order with the same shapes "
        "(work done on one rank only must not contain any); in a script without DDP, "
        "dist.debug=detail checks each collective as it is called",
    )


def explain_uncaught(world_size: int, timeout_s: float) -> None:
    """A script that joined with ddplab.init() under another launcher (torchrun, srun) and let a failed
    collective end it gets the line an Experiment gets, not a traceback from each rank."""
    previous = sys.excepthook

    def hook(kind, e, tb):
        found = explain(e, world_size, timeout_s) if isinstance(e, Exception) else None
        if found is None:
            previous(kind, e, tb)
            return
        print(f"ddplab: error: {found} (rank {getattr(_watcher, 'rank', '?')})", file=sys.stderr, flush=True)

    sys.excepthook = hook


def finish() -> None:
    """Mark this rank as done (call after a successful run)."""
    if _watcher is not None:
        _watcher.finish()


def stop() -> None:
    global _watcher
    if _watcher is not None:
        _watcher.stopping.set()
    _watcher = None


def doing(frame: FrameType | None) -> str:
    """'in all_reduce (train.py:42 in step)' or 'not in a collective (train.py:57 in main)'."""
    # outermost first
    frames = [f for f, _ in traceback.walk_stack(frame)][::-1] if frame else []
    user = next(
        (
            f
            for f in reversed(frames)
            if _TORCH_DISTRIBUTED not in f.f_code.co_filename and os.sep + "threading.py" not in f.f_code.co_filename
        ),
        None,
    )
    where = f"{os.path.basename(user.f_code.co_filename)}:{user.f_lineno} in {user.f_code.co_name}" if user else "?"
    op = _collective_named(frames)
    return f"in {op}" if op else f"not in a collective ({where})"


def is_peer_lost(e: BaseException) -> bool:
    """A collective failed because another rank's process is gone (crashed, killed, or finished), or this rank's
    DataLoader workers were terminated: the launcher stops every rank once one has failed."""
    return any(
        s in f"{e} {e.__cause__}"
        for s in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "killed by signal: Terminated",
        )
    )


def diagnose(e: BaseException, world_size: int, timeout_s: float, wait_s: float = 5.0) -> tuple[str, str] | None:
    """(one-line summary, every rank's stack) for a failed collective, or None when it was not a
    disagreement between ranks (e.g. a peer that crashed: its own error says more). Only the first
    rank to report gets the stacks; the others get "" so they are printed once."""
    me = getattr(_watcher, "rank", None)
    text = str(e)
    failed = isinstance(e, (RuntimeError, dist.DistError)) and (
        "timed out" in text.lower() or is_peer_lost(e) or "mismatch between collectives" in text
    )
    if _watcher is None or not failed:
        # a collective that timed out, or that torch found mismatched
        return None
    _watcher.claim()
    finished = [r for r in range(world_size) if r != me and _has(f"{PREFIX}finished/{r}")]
    # A lost peer is either one that died (the launcher reports its error) or one whose own wait
    # timed out first: gloo then closes its connections, and this rank learns of it as a lost peer.
    # The second has published its stack (or is about to) to report the timeout.
    reporting = _peers_reporting(world_size, me) if is_peer_lost(e) and not finished else []
    if is_peer_lost(e) and not finished and not reporting:
        return None
    mine = _what_failed(e.__traceback__)
    own = {
        "rank": me,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "doing": f"in {mine}",
        "stack": "".join(traceback.format_tb(e.__traceback__)),
    }
    peers, first = _exchange_stacks(own, world_size, world_size - len(finished), wait_s)
    cause = _cause(text, me, mine, finished, reporting, timeout_s)
    others = {r: p for r, p in peers.items() if r != me}
    if others:
        cause += "; " + ", ".join(f"rank {r} {p['doing']}" for r, p in sorted(others.items()))
    silent = [r for r in range(world_size) if r != me and r not in peers and r not in finished]
    if silent:
        cause += f"; rank(s) {silent} did not answer (exited or stuck outside Python)"
    if folder := dump_flight_recorder(me):
        cause += (
            f"; each rank's last collectives (torch's flight recorder) are in {folder}: "
            f"`torchfrtrace {folder}` names the collective that a rank never joined"
        )
    elif _flight_folder is not None:
        cause += "; dist.flight_recorder=true would also keep each rank's last collectives"
    stacks = (
        "".join(
            f"---- rank {r} ({p['host']}, pid {p['pid']}) {p['doing']} ----\n{p['stack']}"
            for r, p in sorted({**peers, me: own}.items())
        )
        if first
        else ""
    )
    return cause, stacks


def _cause(text: str, me, mine: str, finished: list[int], reporting: list[int], timeout_s: float) -> str:
    """What went wrong, seen from this rank: which collective, and why it ended."""
    if "mismatch between collectives" in text:
        # torch's own fingerprints name its internal operations (a barrier shows as REDUCE or
        # GATHER); the stacks say what the user's code called.
        return f"ranks called different collectives (found by dist.debug=detail): rank {me} in {mine}"
    if finished:
        return (
            f"rank {me} was in {mine} while rank(s) {finished} had already finished: the ranks called "
            "different numbers of collectives"
        )
    if reporting:
        return f"{mine} on rank {me} ended when rank(s) {reporting} timed out after {timeout_s:g} s (dist.timeout_s)"
    return f"{mine} timed out on rank {me} after {timeout_s:g} s (dist.timeout_s)"


def _peers_reporting(world_size: int, me: int | None, wait_s: float = 2.0) -> list[int]:
    """The other ranks that published a stack to report a failed collective, waiting a moment for
    one: a peer that timed out publishes it within milliseconds of closing its connections."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [r for r in range(world_size) if r != me and _has(f"{PREFIX}stack/{r}")]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _exchange_stacks(own: dict, world_size: int, expected: int, wait_s: float) -> tuple[dict[int, dict], bool]:
    """Publish this rank's entry, ask every rank for theirs, and collect what arrives in time
    (until `expected` entries, ranks that finished cannot answer).
    Returns the entries and whether this rank is the first to report (the one that prints)."""
    store = _watcher.store
    try:
        store.set(f"{PREFIX}stack/{own['rank']}", json.dumps(own))
        first = store.add(PREFIX + "reporters", 1) == 1
        store.set(PREFIX + "request", str(own["rank"]))
    except Exception:
        # the store is gone (its host exited): report without the others
        return {}, True
    deadline = time.monotonic() + wait_s
    found: dict[int, dict] = {}
    while time.monotonic() < deadline and len(found) < expected:
        for r in range(world_size):
            key = f"{PREFIX}stack/{r}"
            if r not in found and _has(key):
                found[r] = json.loads(store.get(key))
        time.sleep(0.1)
    return found, first


def _what_failed(tb: TracebackType | None) -> str:
    frames = [f for f, _ in traceback.walk_tb(tb)]
    if op := _collective_named(frames):
        return op
    if any("autograd" in f.f_code.co_filename for f in frames):
        return "DDP's gradient all_reduce (in backward)"
    for frame in frames:
        site = os.path.abspath(frame.f_code.co_filename)
        if site in _SITES:
            return _SITES[site]
    return "a collective"


def _has(key: str) -> bool:
    with contextlib.suppress(Exception):
        # the store went away with the job
        return _watcher.store.check([key])
    return False


def _collective_named(frames: list[FrameType]) -> str | None:
    """'all_reduce (train.py:42 in step)': the torch.distributed function the user called (the
    outermost frame in distributed_c10d) and the user's line that called into torch.distributed."""
    op = next(
        (
            f.f_code.co_name
            for f in frames
            if f.f_code.co_filename.endswith(_C10D_FILE) and not f.f_code.co_name.startswith("_")
        ),
        None,
    )
    callers = [
        f"{os.path.basename(p.f_code.co_filename)}:{p.f_lineno} in {p.f_code.co_name}"
        for p, f in itertools.pairwise(frames)
        if _TORCH_DISTRIBUTED in f.f_code.co_filename
        and
        # past torch's own logging wrappers
        _TORCH_DISTRIBUTED not in p.f_code.co_filename
    ]
    return f"{op} ({callers[0]})" if op and callers else op
