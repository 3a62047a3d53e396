"""Measuring on a shared, noisy machine: contenders run interleaved, round after round, in a
rotating order, and are compared by the ratio of their medians to the baseline's."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PYTHON = sys.executable


def interleaved(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every contender once per round, rotating who goes first, so drift in the machine's load
    hits all of them alike. Each callable returns one measurement (seconds)."""
    names = list(contenders)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(contenders[name]())
            print(f"  round {r + 1}/{rounds} {name}: {out[name][-1]:.6g}", file=sys.stderr, flush=True)
    return out


def summary(values: list[float], baseline: list[float] | None = None) -> dict:
    """Median, spread (min..max) and, given a baseline, the ratio of medians."""
    med = statistics.median(values)
    row = {"median": med, "min": min(values), "max": max(values), "n": len(values), "values": values}
    if baseline:
        row["ratio"] = med / statistics.median(baseline)
    return row


def table(results: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    return {name: summary(v, results[baseline]) for name, v in results.items()}


def run(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    # benchmarks/ first, then whatever the caller had (gpu-check puts src/ there where ddplab is not installed)
    path = os.pathsep.join(p for p in (str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        full_env.pop(key, None)
    return subprocess.run(cmd, cwd=str(REPO), env=full_env, capture_output=True, text=True, timeout=timeout)


def check(res: subprocess.CompletedProcess, what: str) -> None:
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def machine() -> dict:
    import torch

    return {
        "cpu": _cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=1))
    print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)
    return path


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
