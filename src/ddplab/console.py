"""Rank-aware printing.

With several processes writing to one terminal, a line is only useful if it says which rank wrote
it, and most lines should be written once, not W times. `print0` prints on rank 0 only,
`print_local0` once per node, `print_rank` from any rank with a `[rank r/W]` prefix.
"""

import functools
import sys
from typing import Any, Callable, TypeVar

from .distributed import runtime

F = TypeVar("F", bound=Callable[..., Any])


def print_rank(*args: Any, file=None) -> None:
    """Print from this rank, prefixed with `[rank r/W]` when there is more than one.

    One write call per line: lines from ranks sharing a terminal or pipe do not interleave.
    """
    rt, stream = runtime.current(), file or sys.stdout
    prefix = f"[rank {rt.rank}/{rt.world_size}] " if rt.world_size > 1 else ""
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
