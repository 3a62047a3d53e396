"""`ddplab collectives`: every torch.distributed primitive acting on real processes, rank by rank.

One small example per primitive, written as plain torch.distributed code to read. Each demo runs
on every rank with small, recognisable tensors (rank r holds values like 10·r + i) and returns what
this rank held before and after the call; rank 0 gathers all ranks' records and prints one block
per primitive. What a backend does not support is discovered by running it: the block says so in
one line and the tour goes on."""

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from ..config import Config, setting
from ..distributed import collectives

REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")
_BITWISE = ("BAND", "BOR", "BXOR")


def _t(rank: int, n: int = 3, dtype=torch.float32) -> torch.Tensor:
    """Rank r's recognisable tensor: [10r, 10r+1, ...]."""
    return (torch.arange(n) + 10 * rank).to(dtype)


def send_recv(r: int, w: int):
    """Even ranks send to the next rank, which receives (blocking)."""
    t = _t(r) if r % 2 == 0 else torch.zeros(3)
    before = t.clone()
    if r % 2 == 0 and r + 1 < w:
        dist.send(t, dst=r + 1)
    elif r % 2 == 1:
        dist.recv(t, src=r - 1)
    return before, t


def isend_irecv(r: int, w: int):
    """Non-blocking ring: every rank sends to the next and receives from the previous."""
    out = _t(r)
    inbox = torch.zeros(3)
    reqs = [dist.isend(out, dst=(r + 1) % w), dist.irecv(inbox, src=(r - 1) % w)]
    for req in reqs:
        req.wait()
    return out, inbox


def _in_place(t: torch.Tensor, collective: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """What `t` held before an in-place collective, and after."""
    before = t.clone()
    collective(t)
    return before, t


def broadcast(r: int, w: int):
    return _in_place(_t(r), lambda t: dist.broadcast(t, src=0))


def broadcast_object_list(r: int, w: int):
    objs = [{"from rank": r}]
    before = list(objs)
    dist.broadcast_object_list(objs, src=0)
    return before, objs


def scatter(r: int, w: int):
    chunks = [torch.full((2,), float(10 * i)) for i in range(w)] if r == 0 else None
    out = torch.zeros(2)
    dist.scatter(out, scatter_list=chunks, src=0)
    return chunks, out


def scatter_object_list(r: int, w: int):
    objs = [f"for rank {i}" for i in range(w)] if r == 0 else None
    out = [None]
    dist.scatter_object_list(out, objs, src=0)
    return objs, out[0]


def gather(r: int, w: int):
    t = _t(r, 2)
    out = [torch.zeros(2) for _ in range(w)] if r == 0 else None
    dist.gather(t, gather_list=out, dst=0)
    return t, out


def gather_object(r: int, w: int):
    obj = {"rank": r, "squared": r * r}
    out = [None] * w if r == 0 else None
    dist.gather_object(obj, out, dst=0)
    return obj, out


def reduce_with(op_name: str) -> Callable:
    def demo(r: int, w: int):
        before, t = _in_place(
            _t(r, 3, torch.int64) + 1 if op_name in _BITWISE else _t(r) + 1,
            lambda t: dist.reduce(t, dst=0, op=getattr(dist.ReduceOp, op_name)),
        )
        # only the destination's result is defined
        return before, t if r == 0 else None

    demo.__doc__ = f"reduce with ReduceOp.{op_name} into rank 0"
    return demo


def reduce_scatter(r: int, w: int):
    inputs = [torch.full((2,), float(10 * r + i)) for i in range(w)]
    out = torch.zeros(2)
    dist.reduce_scatter(out, inputs)
    return inputs, out


def all_gather(r: int, w: int):
    t = _t(r, 2)
    out = [torch.zeros(2) for _ in range(w)]
    dist.all_gather(out, t)
    return t, out


def all_gather_object(r: int, w: int):
    out = [None] * w
    dist.all_gather_object(out, f"hello from rank {r}")
    return f"hello from rank {r}", out


def all_reduce(r: int, w: int):
    return _in_place(_t(r), dist.all_reduce)


def all_reduce_premul_sum(r: int, w: int):
    """all_reduce with ReduceOp.PREMUL_SUM: each tensor is scaled by 0.5 before the sum (NCCL only)."""
    return _in_place(_t(r), lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5)))


def all_to_all(r: int, w: int):
    inputs = [torch.tensor([float(10 * r + j)]) for j in range(w)]
    out = [torch.zeros(1) for _ in range(w)]
    dist.all_to_all(out, inputs)
    return inputs, out


def barrier(r: int, w: int):
    dist.barrier()
    return "waiting", "passed"


def monitored_barrier(r: int, w: int):
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    return "waiting", "passed"


def variable_mean(r: int, w: int):
    """Rank r holds r+1 values; the true mean needs every value, not a mean of per-rank means."""
    values = torch.arange(r + 1, dtype=torch.float32) + 10 * r
    gathered = collectives.gather_concat(values)
    naive = collectives.mean(values.mean().reshape(1))
    return values, {
        "true mean": round(gathered.mean().item(), 4),
        "mean of rank means": round(naive.item(), 4),
        "gathered": gathered,
    }


DEMOS: dict[str, tuple[Callable, str]] = {
    "send_recv": (send_recv, "even ranks send their tensor to the next rank, which receives it into a buffer"),
    "isend_irecv": (isend_irecv, "a non-blocking ring: each rank sends to rank+1 and receives from rank-1"),
    "broadcast": (broadcast, "rank 0's tensor is copied into every rank's tensor"),
    "broadcast_object_list": (
        broadcast_object_list,
        "rank 0's Python objects replace every rank's (src defaults to 0)",
    ),
    "scatter": (scatter, "rank 0 holds one chunk per rank; rank i receives chunk i"),
    "scatter_object_list": (scatter_object_list, "like scatter, with picklable Python objects"),
    "gather": (gather, "rank 0 collects every rank's tensor into a list (index = rank)"),
    "gather_object": (gather_object, "rank 0 collects every rank's Python object"),
    **{
        f"reduce_{op.lower()}": (reduce_with(op), f"element-wise {op} of all ranks' tensors, result on rank 0 only")
        for op in REDUCE_OPS
    },
    "reduce_scatter": (reduce_scatter, "input i of every rank is summed element-wise; rank i receives that sum"),
    "all_gather": (all_gather, "every rank receives the list of all ranks' tensors"),
    "all_gather_object": (all_gather_object, "every rank receives the list of all ranks' Python objects"),
    "all_reduce": (all_reduce, "every rank ends with the element-wise SUM of all ranks' tensors"),
    "all_reduce_premul_sum": (
        all_reduce_premul_sum,
        "every rank ends with the sum of all tensors, each scaled by 0.5 first",
    ),
    "all_to_all": (all_to_all, "rank r sends its j-th tensor to rank j, and receives rank j's r-th tensor"),
    "barrier": (barrier, "no rank passes until every rank has arrived"),
    "monitored_barrier": (monitored_barrier, "a barrier that names the ranks that did not arrive in time"),
    "variable_mean": (
        variable_mean,
        "mean over tensors of different lengths per rank, via ddplab's variable-shape gather",
    ),
}


@dataclass
class TourSettings:
    ops: list[str] = setting(help="empty: all", default_factory=list)
    json: str = setting("", "also write every rank's records here (rank 0)")


@dataclass
class TourConfig(Config):
    tour: TourSettings = field(default_factory=TourSettings)


def run_tour(cfg) -> None:
    """Worker target: run the chosen demos on this rank; rank 0 prints every rank's records."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    names = list(cfg.tour.ops) or list(DEMOS)
    records = [_run_one(name, rank, world) for name in names]
    everyone = [None] * world if rank == 0 else None
    dist.gather_object(records, everyone, dst=0)
    if rank == 0:
        _print_blocks(names, everyone, dist.get_backend())
        if cfg.tour.json:
            with open(cfg.tour.json, "w") as f:
                json.dump({"backend": dist.get_backend(), "world_size": world, "ranks": everyone}, f, indent=1)


run_tour.config_class = TourConfig  # type: ignore[attr-defined]


def _run_one(name: str, rank: int, world: int) -> dict[str, Any]:
    fn, _ = DEMOS[name]
    try:
        before, after = fn(rank, world)
        return {"op": name, "status": "ok", "before": _plain(before), "after": _plain(after)}
    except (RuntimeError, ValueError, NotImplementedError) as e:
        # the backend refused: say so, go on
        return {"op": name, "status": "unsupported", "message": str(e).strip().splitlines()[0][:160]}


def _plain(value: Any) -> Any:
    """Tensors to lists, recursively, so records print and serialise readably."""
    return tree_map_only(torch.Tensor, torch.Tensor.tolist, value)


def _print_blocks(names: list[str], everyone: list[list[dict]], backend: str) -> None:
    out = sys.stdout
    for i, name in enumerate(names):
        recs = [ranks[i] for ranks in everyone]
        out.write(f"\n== {name} " + "=" * max(0, 60 - len(name)) + "\n")
        if any(r["status"] != "ok" for r in recs):
            out.write(f"   not supported by {backend}: {recs[0].get('message', '')}\n")
            continue
        out.write(f"   {DEMOS[name][1]}\n")
        for rank, rec in enumerate(recs):
            out.write(f"   rank {rank}  before {_fmt(rec['before']):<34} after {_fmt(rec['after'])}\n")
    out.flush()


def _fmt(value: Any) -> str:
    return "-" if value is None else json.dumps(value, separators=(", ", ": "))
