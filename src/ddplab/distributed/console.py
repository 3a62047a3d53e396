"""Rank-aware printing: a line says which rank wrote it, and most lines are written once, not W times.

`print0` prints on rank 0, `print_local0` once per node, `print_rank` from any rank with a `[rank r/W]`
prefix; under `ddplab run` every other rank's prints get that prefix too (`label_rank_output`)."""

import functools
import io
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from . import runtime

F = TypeVar("F", bound=Callable[..., Any])


def print_rank(*args: Any, file=None) -> None:
    """Print from this rank, prefixed with `[rank r/W]` when there is more than one.

    One write call per line: lines from ranks sharing a terminal or pipe do not interleave."""
    rt = runtime.current()
    stream = file or sys.stdout
    labelled = isinstance(stream, RankLines) and stream.prefix
    prefix = f"[rank {rt.rank}/{rt.world_size}] " if rt.world_size > 1 and not labelled else ""
    stream.write(prefix + " ".join(str(a) for a in args) + "\n")
    stream.flush()


def print0(*args: Any, **kwargs: Any) -> None:
    """Print once for the whole job (rank 0), without a prefix."""
    if runtime.current().is_main:
        print(*args, flush=True, **kwargs)


def print_local0(*args: Any, **kwargs: Any) -> None:
    """Print once per node (local rank 0), prefixed with the node."""
    rt = runtime.current()
    if rt.is_local_main:
        prefix = f"[node {rt.node_rank}] " if rt.cluster.num_nodes > 1 else ""
        print(prefix + " ".join(str(a) for a in args), flush=True, **kwargs)


def rank_zero_only(fn: F) -> F:
    """Run `fn` on rank 0 only; other ranks get None. Never put a collective inside it."""
    return _only_where(fn, lambda rt: rt.is_main)


def local_rank_zero_only(fn: F) -> F:
    """Run `fn` on local rank 0 of each node only; other ranks get None."""
    return _only_where(fn, lambda rt: rt.is_local_main)


def _only_where(fn: F, chosen: Callable[[runtime.Runtime], bool]) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        return fn(*args, **kwargs) if chosen(runtime.current()) else None

    return wrapper  # type: ignore[return-value]


class RankLines(io.TextIOBase):
    """A rank's sys.stdout or sys.stderr under the launcher: each whole line goes to the file in one
    write, with the rank's prefix, so lines of ranks sharing a terminal or pipe never tear (a
    buffered stream writes 8 KB blocks that end mid-line). `shown=False`: a rank filtered out."""

    encoding = "utf-8"
    errors = "backslashreplace"

    def __init__(self, fd: int, prefix: str, shown: bool = True):
        self.fd = fd
        self.prefix = prefix
        self.shown = shown
        self.partial = ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines if self.shown else ():
            data = (self.prefix + line + "\n").encode(self.encoding, self.errors)
            while data:
                data = data[os.write(self.fd, data) :]
        return len(text)

    def flush(self) -> None:
        """Also ends a line left open (the process may leave through os._exit next)."""
        if self.partial:
            self.write("\n")

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        # rank 0's stdout on a terminal stays one for colour and width checks
        return os.isatty(self.fd)


def label_rank_output(rank: int, world_size: int, local_rank: int, shown_ranks: list[int] | None) -> None:
    """Route prints through RankLines: `[rank r/W] ` before each line but rank 0's (the run's log;
    its stderr, line-buffered already, keeps the progress bar's in-place updates). Local ranks not
    in `shown_ranks` (torchrun's --local-ranks-filter) print nothing on stdout; stderr always shows."""
    prefix = f"[rank {rank}/{world_size}] " if rank else ""
    sys.stdout.flush()
    sys.stdout = RankLines(1, prefix, shown_ranks is None or local_rank in shown_ranks)
    if rank:
        sys.stderr.flush()
        sys.stderr = RankLines(2, prefix)
