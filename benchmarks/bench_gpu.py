"""ddplab on one GPU, side by side with the loop a careful user writes by hand, Lightning Fabric and
Hugging Face Accelerate: the same workloads (a small MLP whose step is overhead, a wide one whose
step is compute, and a GPT with tied embeddings on windows of a token file), fp32 and bf16, without
and with torch.compile; and ddplab's translation transformer with and without trainer.compile.
Step-time ratios to the raw loop, samples/s and peak GPU memory.

    python benchmarks/bench_gpu.py [--rounds 5] [--workloads small,wide,gpt] [--contenders raw,ddplab,fabric,accelerate]
    make bench-gpu

Every configuration runs each contender once per round, in an order that rotates from round to
round, each in a fresh process; the median of the rounds is reported with its spread (min..max).
Without CUDA it says so and exits 0, writing nothing (`--device cpu --rounds 1` runs the same code on
the CPU with a few small steps and keeps nothing: a check that the benchmark itself works).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    # before gpu_contenders is imported, here and in every contender
    os.environ["BENCH_GPU_CHECK"] = "1"
from common import PYTHON, interleaved, run, save
from gpu_contenders import WORKLOADS, ddplab_command

CONTENDERS = ("raw", "ddplab", "fabric", "accelerate")


def measure(contender: str, workload: str, precision: str, compiled: bool, tmp: str, device: str):
    """A callable for `interleaved`: one fresh process, its seconds per step (NaN when it failed)."""

    def once() -> float:
        out = os.path.join(tmp, f"{contender}-{workload}-{precision}-{int(compiled)}.json")
        if os.path.exists(out):
            os.remove(out)
        if contender == "ddplab":
            cmd = ddplab_command(workload, precision, compiled, out, os.path.join(tmp, "runs"))
        else:
            cmd = [
                PYTHON,
                "benchmarks/gpu_contenders.py",
                contender,
                workload,
                precision,
                str(int(compiled)),
                out,
                "--device",
                device,
            ]
        env = (
            {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
            if device == "cuda"
            else {"CUDA_VISIBLE_DEVICES": ""}
        )
        res = run(cmd, env=env, timeout=1800)
        if not os.path.exists(out):
            print(
                f"  {contender} {workload} {precision} compile={compiled} failed (exit {res.returncode}): "
                f"{(res.stderr or res.stdout).strip().splitlines()[-1:]}",
                file=sys.stderr,
            )
            return float("nan")
        with open(out) as f:
            found = json.load(f)
        RUNS.setdefault((contender, workload, precision, compiled), []).append(found)
        return found["step_s"]

    return once


RUNS: dict[tuple, list[dict]] = {}


def summarise(times: dict[str, list[float]], key: tuple) -> dict:
    """Per contender: median step time, its spread, the ratio to the raw loop's median, samples/s, memory."""
    ok = {c: [t for t in v if t == t] for c, v in times.items()}
    raw = statistics.median(ok["raw"]) if ok.get("raw") else None
    rows = {}
    for contender, values in ok.items():
        if not values:
            rows[contender] = {"failed": True}
            continue
        runs = RUNS[(contender, *key)]
        median = statistics.median(values)
        rows[contender] = {
            "step_ms": 1e3 * median,
            "min_ms": 1e3 * min(values),
            "max_ms": 1e3 * max(values),
            "rounds": len(values),
            "ratio_to_raw": median / raw if raw else None,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
            "peak_mem_gib": max((r["peak_mem_gib"] or 0) for r in runs) or None,
            "first_step_s": statistics.median(r["first_step_s"] for r in runs),
            "step_ms_each": [1e3 * v for v in values],
        }
    return rows


def translation(rounds: int, tmp: str, steps: int) -> dict:
    """ddplab's translation transformer, trainer.compile false vs true: steady samples/s (the log
    intervals after the first) and the time the first interval took beyond a steady one (compiling)."""

    def once(compiled: bool):
        def go() -> float:
            run_dir = os.path.join(tmp, f"translation-{int(compiled)}-{next(COUNT)}")
            res = run(
                [
                    PYTHON,
                    "-m",
                    "ddplab",
                    "run",
                    "translation",
                    f"run.dir={run_dir}",
                    f"trainer.max_steps={steps}",
                    "trainer.precision=bf16",
                    f"trainer.compile={str(compiled).lower()}",
                    "trainer.progress=false",
                    f"trainer.eval_every={10 * steps}",
                    "log.tensorboard=false",
                    "checkpoint.at_end=false",
                    "trainer.deterministic=false",
                ],
                timeout=1800,
            )
            rows = [
                json.loads(line) for path in _metrics_files(run_dir) for line in Path(path).read_text().splitlines()
            ]
            speeds = [r["train/samples_per_s"] for r in rows if "train/samples_per_s" in r]
            if res.returncode or len(speeds) < 3:
                print(f"  translation compile={compiled} failed (exit {res.returncode})", file=sys.stderr)
                return float("nan")
            TRANSLATION.setdefault(compiled, []).append({"steady": statistics.median(speeds[1:]), "first": speeds[0]})
            return 1 / statistics.median(speeds[1:])

        return go

    interleaved({"eager": once(False), "compiled": once(True)}, rounds)
    out = {}
    for compiled, found in TRANSLATION.items():
        out["compiled" if compiled else "eager"] = {
            "samples_per_s": statistics.median(f["steady"] for f in found),
            "first_interval_samples_per_s": statistics.median(f["first"] for f in found),
        }
    if "eager" in out and "compiled" in out:
        out["speedup"] = out["compiled"]["samples_per_s"] / out["eager"]["samples_per_s"]
    return out


TRANSLATION: dict[bool, list[dict]] = {}
COUNT = itertools.count()


def _metrics_files(run_dir: str) -> list[str]:
    return [os.path.join(d, "metrics.jsonl") for d, _, files in os.walk(run_dir) if "metrics.jsonl" in files]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workloads", default="small,wide,gpt")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--compile", default="0,1", help="0, 1 or 0,1: without and/or with torch.compile")
    p.add_argument("--translation-steps", type=int, default=300, help="0 leaves the translation comparison out")
    p.add_argument("--device", default="cuda", help="cpu: a quick check that this script works (few steps)")
    p.add_argument("--out", default="", help="write the results to this JSON file, not benchmarks/results (gpu-check)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device here, nothing measured; run `make bench-gpu` on a machine with a GPU",
            file=sys.stderr,
        )
        return
    results, contenders = {}, args.contenders.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            for precision in args.precisions.split(","):
                for compiled in (c == "1" for c in args.compile.split(",")):
                    key = (workload, precision, compiled)
                    print(f"{workload} {precision} compile={compiled}", file=sys.stderr, flush=True)
                    times = interleaved({c: measure(c, *key, tmp, args.device) for c in contenders}, args.rounds)
                    results[f"{workload}/{precision}/{'compiled' if compiled else 'eager'}"] = summarise(times, key)
        if args.translation_steps and args.device == "cuda":
            results["translation"] = translation(args.rounds, tmp, args.translation_steps)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    elif args.device == "cuda":
        # a check on the CPU measures nothing worth keeping
        save(
            "gpu",
            {
                "device": torch.cuda.get_device_name(0),
                "cuda": torch.version.cuda,
                "rounds": args.rounds,
                "workloads": {
                    n: {"width": w.width, "depth": w.depth, "batch": w.batch, "steps": w.steps, "warmup": w.warmup}
                    for n, w in WORKLOADS.items()
                },
                "results": results,
            },
        )
    for name, rows in results.items():
        if name != "translation":
            print(
                name
                + ": "
                + ", ".join(f"{c} {r['ratio_to_raw']:.3f}x" for c, r in rows.items() if r.get("ratio_to_raw")),
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
