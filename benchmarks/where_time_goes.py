"""Where a contender's step goes: torch.profiler's record of each rank over a window of steps, split
into the categories a step is made of.

    data           the main thread inside the DataLoader's `__next__`, or in the script's own batch
                   reading (a `bench.data` range)
    compute        the main thread inside torch's operators: forward, backward, loss, optimizer
    communication  a collective running while the main thread computes and reads nothing: the wait
                   for gradients that the backward could not hide (its exposed part only)
    host           the rest: Python and the framework's own work between operators

Each contender calls `step_started(step, w)` at the start of every step; with BENCH_PROFILE set,
every rank profiles the steps from the workload's warmup on (the same steps the clock times, at
most PROFILED_STEPS) and writes `BENCH_PROFILE.rank<r>.json`. Every rank is profiled so that the
profiler's own cost slows them alike and no rank waits for another because of it; the figures are
read as shares of the step, the profiler's cost included in no category but host."""

from __future__ import annotations

import json
import os
import resource
import time

import torch
from torch.autograd.profiler import record_function

PROFILE_OUT = os.environ.get("BENCH_PROFILE")
PROFILED_STEPS = 100
CATEGORIES = ("data", "compute", "communication", "host")
# ranges that read a batch: torch's DataLoader names its own, the GPT script is given one
DATA_RANGES = ("enumerate(DataLoader)", "bench.data")
# collectives: gloo's own ranges on its threads, and the ops that start them
COMM_RANGES = ("gloo:", "c10d::", "record_param_comms", "nccl:")

_window: dict = {}


def data_range():
    """The range the GPT script's batch reading runs in (a no-op when not profiling)."""
    return record_function("bench.data")


def step_started(step: int, w) -> None:
    """Start the profiler at the first timed step, stop it and write the split after the last."""
    if not PROFILE_OUT:
        return
    last = w.warmup + min(PROFILED_STEPS, w.steps - w.warmup - 1)
    if step == w.warmup and not _window:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
        _window.update(profiler=profiler, t0=time.perf_counter(), first=step, faults=_page_faults())
    elif step == last and "profiler" in _window:
        wall_s = time.perf_counter() - _window["t0"]
        profiler = _window.pop("profiler")
        profiler.__exit__(None, None, None)
        steps = step - _window["first"]
        faults = (_page_faults() - _window["faults"]) / steps
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(f"{PROFILE_OUT}.rank{rank}.json", "w") as f:
            json.dump({**split(profiler.events(), wall_s, steps), "page_faults": round(faults)}, f)


def _page_faults() -> int:
    """Minor page faults of this process so far: memory the kernel maps in on first touch, which an
    operator writing a freshly allocated output pays for inside its own time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def split(events, wall_s: float, steps: int) -> dict:
    """Milliseconds per step in each category, from the profiler's events over `wall_s` seconds."""
    main = _main_thread(events)
    data = _union([_span(e) for e in events if e.thread == main and e.name.startswith(DATA_RANGES)])
    compute = _union([_span(e) for e in events if e.thread == main and _outermost_op(e)])
    compute = _minus(compute, data)
    comm = _union([_span(e) for e in events if e.name.startswith(COMM_RANGES)])
    exposed = _minus(_minus(comm, compute), data)
    ms = {
        "data": _length(data),
        "compute": _length(compute),
        "communication": _length(exposed),
    }
    per_step = {name: round(us / 1000 / steps, 3) for name, us in ms.items()}
    per_step["step"] = round(1000 * wall_s / steps, 3)
    per_step["host"] = round(per_step["step"] - sum(per_step[c] for c in CATEGORIES[:3]), 3)
    per_step["top_ops_ms"] = _top_ops(events, main, steps)
    return per_step


def _top_ops(events, main: int, steps: int, count: int = 12) -> dict[str, float]:
    """The main thread's operators with the most time of their own, per step: what explains a
    difference in compute between two contenders."""
    own: dict[str, float] = {}
    for e in events:
        if e.thread == main and e.name.startswith("aten::"):
            own[e.name] = own.get(e.name, 0.0) + e.self_cpu_time_total
    top = sorted(own.items(), key=lambda kv: -kv[1])[:count]
    return {name: round(us / 1000 / steps, 3) for name, us in top}


def _main_thread(events) -> int:
    """The thread that ran the most operators: the training loop's (CPU work of the backward runs
    in the thread that called it)."""
    busy: dict[int, float] = {}
    for e in events:
        if _outermost_op(e):
            busy[e.thread] = busy.get(e.thread, 0.0) + e.time_range.elapsed_us()
    return max(busy, key=busy.get)


def _outermost_op(e) -> bool:
    """An operator of torch's not inside another (its time holds its children's)."""
    if not e.name.startswith("aten::"):
        return False
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _span(e) -> tuple[float, float]:
    return (e.time_range.start, e.time_range.end)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _minus(spans: list[tuple[float, float]], taken: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `spans` outside `taken` (both unions: sorted, disjoint)."""
    out, i = [], 0
    for start, end in spans:
        while i < len(taken) and taken[i][1] <= start:
            i += 1
        j, cursor = i, start
        while j < len(taken) and taken[j][0] < end:
            if taken[j][0] > cursor:
                out.append((cursor, taken[j][0]))
            cursor = max(cursor, taken[j][1])
            j += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
