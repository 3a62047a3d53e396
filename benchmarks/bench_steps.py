"""Step overhead: the same workload on 2 gloo ranks by a raw DDP loop, ddplab, Lightning Fabric,
Lightning Trainer and Accelerate; and scaling of the raw loop and ddplab from 1 rank up.

    python benchmarks/bench_steps.py [--rounds mlp=12,lstm=5] [--workloads mlp,lstm] [--scaling] [--profile]

The MLP gets more rounds: its runs differ by several percent from one pair of processes to the
next, and the ratios it ranks differ by a few percent.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from common import PYTHON, RESULTS, check, interleaved, run, save, table
from workloads import WORKLOADS

CONTENDERS = ("raw", "ddplab", "fabric", "trainer", "accelerate")
# the GPT workload also races a script written the way GPT scripts usually are
EXTRA = {"gpt": ("handwritten",)}


def ddplab_command(target: str, workload: str, out: str, nproc: int) -> list[str]:
    """`ddplab run TARGET` with the workload's settings: a line every 10 steps, no bar, no saving."""
    w = WORKLOADS[workload]()
    return [
        PYTHON,
        "-m",
        "ddplab",
        "run",
        target,
        "-n",
        str(nproc),
        f"bench.workload={workload}",
        f"bench.out={out}",
        f"trainer.max_steps={w.steps}",
        f"trainer.global_batch_size={w.global_batch}",
        "trainer.log_every=10",
        "trainer.progress=false",
        "log.tensorboard=false",
        "checkpoint.at_end=false",
        f"run.dir={os.path.dirname(out)}/runs",
    ]


def command(contender: str, workload: str, out: str, nproc: int) -> list[str]:
    if contender == "ddplab":
        return ddplab_command("benchmarks/step_contenders.py:DdplabStep", workload, out, nproc)
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--standalone",
        "benchmarks/step_contenders.py",
        contender,
        workload,
        out,
    ]


def one_run(contender: str, workload: str, tmp: str, nproc: int = 2, rss: list | None = None):
    def measure() -> float:
        out = os.path.join(tmp, f"{contender}-{workload}-{nproc}.json")
        if os.path.exists(out):
            os.remove(out)
        res = run(command(contender, workload, out, nproc))
        if not os.path.exists(out):
            # a gloo abort at exit after writing is not a failed run
            check(res, f"{contender} on {workload}")
        with open(out) as f:
            result = json.load(f)
        if rss is not None and "rss_mib" in result:
            rss.append(result["rss_mib"])
        return result["step_s"]

    return measure


def where_time_goes(contenders: list[str], workload: str, tmp: str) -> dict:
    """Each contender once under torch.profiler (where_time_goes.py): rank 0's milliseconds per step
    in data, compute, exposed communication and host work."""
    split = {}
    for contender in contenders:
        out = os.path.join(tmp, f"profiled-{contender}-{workload}")
        res = run(command(contender, workload, out + ".json", 2), env={"BENCH_PROFILE": out})
        if not os.path.exists(out + ".rank0.json"):
            check(res, f"{contender} on {workload}, profiled")
        with open(out + ".rank0.json") as f:
            split[contender] = json.load(f)
        print(f"  where the step goes, {contender}: {split[contender]}", flush=True)
    return split


def same_parameters(tmp: str, workload: str) -> dict:
    a = torch.load(os.path.join(tmp, f"raw-{workload}-2.json.pt"))
    b = torch.load(os.path.join(tmp, f"ddplab-{workload}-2.json.pt"))
    return {
        "bitwise_equal": all(torch.equal(a[k], b[k]) for k in a),
        "max_abs_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", default="mlp=12,lstm=5,gpt=3", help="N, or WORKLOAD=N,... (default mlp=12,lstm=5,gpt=3)")
    p.add_argument("--workloads", default="mlp,lstm,gpt")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--scaling", action="store_true", help="also samples/s at 1..cores ranks (raw and ddplab)")
    p.add_argument("--profile", action="store_true", help="also one profiled run per contender: where the step goes")
    args = p.parse_args()
    contenders = args.contenders.split(",")
    rounds = rounds_per_workload(args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        # the workloads not measured this time keep their last results
        results = (load_results("steps") or {}).get("results", {})
        for workload in args.workloads.split(","):
            print(f"step overhead, {workload}", flush=True)
            these = [*contenders, *EXTRA.get(workload, ())]
            rss: dict[str, list[float]] = {c: [] for c in these}
            # no rounds: keep the last timings (e.g. to add only the profiled split)
            if rounds(workload):
                raw = interleaved({c: one_run(c, workload, tmp, rss=rss[c]) for c in these}, rounds(workload))
                results[workload] = {
                    "per_step_s": table(raw, "raw"),
                    "rss_mib": {c: sorted(v)[len(v) // 2] for c, v in rss.items() if v},
                    "raw_vs_ddplab_parameters": same_parameters(tmp, workload),
                    "global_batch": WORKLOADS[workload]().global_batch,
                    "rounds": rounds(workload),
                }
            if args.profile:
                results[workload]["where_time_goes"] = where_time_goes(these, workload, tmp)
        save("steps", {"ranks": 2, "results": results})
        if args.scaling:
            scaling(tmp, min(rounds(w) for w in ("mlp", "lstm")))


def load_results(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rounds_per_workload(spec: str):
    """'7' -> 7 for every workload; 'mlp=12,lstm=5' -> per workload (5 for one not named; 0: keep the
    last timings)."""
    if "=" not in spec:
        return lambda workload: int(spec)
    given = {k: int(v) for k, v in (part.split("=") for part in spec.split(","))}
    return lambda workload: given.get(workload, 5)


def scaling(tmp: str, rounds: int) -> None:
    cores = len(os.sched_getaffinity(0))
    out = {}
    for workload in ("mlp", "lstm"):
        batch = WORKLOADS[workload]().global_batch
        runs = {f"{c}@{n}": one_run(c, workload, tmp, n) for n in range(1, cores + 1) for c in ("raw", "ddplab")}
        measured = interleaved(runs, rounds)
        rows = {}
        for name, secs in measured.items():
            contender, n = name.split("@")
            rows[name] = {"ranks": int(n), "contender": contender, "samples_per_s": [batch / s for s in secs]}
        for row in rows.values():
            one = rows[f"{row['contender']}@1"]["samples_per_s"]
            row["efficiency"] = sorted(row["samples_per_s"])[len(secs) // 2] / (
                row["ranks"] * sorted(one)[len(one) // 2]
            )
        out[workload] = rows
    save("scaling", {"rounds": rounds, "results": out})


if __name__ == "__main__":
    main()
