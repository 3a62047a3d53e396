"""`ddplab bench comm`: how fast the interconnect is, with nccl-tests' conventions (PERFORMANCE.md).

Per op and size: warm-up calls, then iterations each after a barrier, timed by the slowest rank;
the median t is reported, with S the bytes and n the world size: algbw = S / t, busbw = algbw ·
2(n-1)/n (all_reduce), · (n-1)/n (all_gather: S gathered; reduce_scatter: S the input), · 1
(broadcast). busbw compares across world sizes and with the link's peak."""

import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import Config, setting
from ..config_rules import Range
from ..errors import DdplabError
from .listing import human_bytes

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
# 8 B, 64 B, ... 16 MB, 64 MB
DEFAULT_SIZES = [8 * 8**k for k in range(8)] + [64 * 2**20]
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
FORMULAS = {
    "algbw": "S / t (bytes per second, reported in GB/s = 1e9 B/s)",
    "busbw": "algbw * 2(n-1)/n for all_reduce; * (n-1)/n for all_gather and reduce_scatter; * 1 for broadcast",
    "S": "all_reduce/broadcast: the tensor; all_gather: the gathered output; reduce_scatter: the full input",
    "time": "median over timed iterations of the slowest rank's time, each iteration after a barrier",
}


@dataclass
class BenchSettings:
    ops: list[str] = setting(default_factory=lambda: list(OPS), help="the collectives to time")
    sizes: list[int] = setting(default_factory=lambda: list(DEFAULT_SIZES), help="message sizes in bytes")
    iters: int = setting(0, "0: adaptive, about 0.5 s of timing per size (3..50 iterations)", rule=Range(0))
    warmup: int = setting(2, "untimed iterations before each size", rule=Range(0))
    json: str = setting("", "also write the results here as JSON")


@dataclass
class BenchConfig(Config):
    bench: BenchSettings = field(default_factory=BenchSettings)


def parse_sizes(text: str) -> list[int]:
    """`8,1K,64M` -> bytes (K/M/G are powers of 1024)."""
    if not text:
        return list(DEFAULT_SIZES)
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", part.upper())
        if not m:
            raise DdplabError(f"cannot read message size '{part}'", "write sizes like 8,1K,64M")
        out.append(int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
    return out


def run_bench(cfg) -> None:
    """Worker target: measure every (op, size) on this rank; rank 0 prints and writes JSON."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    results = [
        measure(op, size, device, cfg.bench.iters, cfg.bench.warmup) for op in cfg.bench.ops for size in cfg.bench.sizes
    ]
    if dist.get_rank() == 0:
        report = {
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "device": str(device),
            "formulas": FORMULAS,
            "results": results,
        }
        print_table(report)
        if cfg.bench.json:
            with open(cfg.bench.json, "w") as f:
                json.dump(report, f, indent=1)


run_bench.config_class = BenchConfig  # type: ignore[attr-defined]


def measure(op: str, size: int, device: torch.device, iters: int = 0, warmup: int = 2) -> dict:
    """One row: the median time of `op` on a message of `size` bytes, and its bandwidths."""
    n = dist.get_world_size()
    call = _make_call(op, size, n, device)
    try:
        for _ in range(warmup):
            call()
        _sync(device)
    except (RuntimeError, ValueError) as e:
        # the backend does not have this op
        return {"op": op, "bytes": size, "status": "unsupported", "message": str(e).splitlines()[0][:160]}
    first = _timed(call, device)
    count = iters or max(3, min(50, int(0.5 / max(first, 1e-6))))
    times = [first] + [_timed(call, device) for _ in range(count - 1)]
    t = statistics.median(times)
    algbw = size / t / 1e9
    return {
        "op": op,
        "bytes": size,
        "status": "ok",
        "iters": count,
        "time_us": t * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * BUS_FACTOR[op](n),
    }


def _make_call(op: str, size: int, n: int, device: torch.device):
    # float32
    elems = max(1, size // 4)
    if op in ("all_reduce", "broadcast"):
        t = torch.ones(elems, device=device)
        return (lambda: dist.all_reduce(t)) if op == "all_reduce" else (lambda: dist.broadcast(t, src=0))
    per_rank = max(1, elems // n)
    if op == "all_gather":
        src = torch.ones(per_rank, device=device)
        out = torch.empty(per_rank * n, device=device)
        return lambda: _all_gather_single(out, src)
    if op == "reduce_scatter":
        src = torch.ones(per_rank * n, device=device)
        out = torch.empty(per_rank, device=device)
        return lambda: _reduce_scatter_single(out, src)
    raise ValueError(op)


# torch 2.13 renamed the tensor-to-tensor variants; keep working on older versions too.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _timed(call, device: torch.device) -> float:
    """The slowest rank's time for one call (the op is done only when every rank is done)."""
    dist.barrier()
    start = time.perf_counter()
    call()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(report: dict) -> None:
    out = sys.stdout
    out.write(
        f"backend {report['backend']}, {report['world_size']} ranks, {report['device']}; "
        "time = median; busbw per nccl-tests\n"
    )
    out.write(f"{'op':<15} {'size':>10} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}\n")
    for row in report["results"]:
        size = human_bytes(row["bytes"])
        if row["status"] != "ok":
            out.write(f"{row['op']:<15} {size:>10}   not supported: {row['message']}\n")
            continue
        out.write(
            f"{row['op']:<15} {size:>10} {row['time_us']:>12.1f} {row['algbw_GBps']:>13.4f} "
            f"{row['busbw_GBps']:>13.4f}\n"
        )
    out.flush()
