"""`ddplab collectives`: every torch.distributed primitive acting on real processes, rank by rank.

Each demo (experiments/collectives_tour.py, examples to read) runs on every rank and returns what
this rank held before and after. Rank 0 gathers all ranks' records and prints one block per
primitive. What a backend does not support is discovered by running it: the block says so in one
line and the tour goes on."""

import json, sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from ..config import Config
from ..experiments.collectives_tour import DEMOS


@dataclass
class TourSettings:
    ops: list[str] = field(default_factory=list)  # empty: all
    json: str = ""  # also write every rank's records here (rank 0)


@dataclass
class TourConfig(Config):
    tour: TourSettings = field(default_factory=TourSettings)


def run_tour(cfg) -> None:
    """Worker target: run the chosen demos on this rank; rank 0 prints every rank's records."""
    rank, world = dist.get_rank(), dist.get_world_size()
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
    except (RuntimeError, ValueError, NotImplementedError) as e:  # the backend refused: say so, go on
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
