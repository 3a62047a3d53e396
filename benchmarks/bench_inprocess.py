"""Step overhead without process-to-process noise: one pair of gloo ranks runs, round after
round in a rotating order, a block of steps of the raw DDP loop, of a second copy of the raw loop
(the control), and of ddplab's training loop.

Separate runs of one program differ by 5-8 % on this machine (2 shared cores: where each
process's threads land and what else runs decide it), so bench_steps.py's ratios carry that
noise even over many rounds. Here the loops share the processes, the process group, the threads,
the data, and the very same DDP model and optimizer: two copies of one network, identical but
for where their memory lies, were measured 1-4 % apart, which would swamp a 2 % goal. Only the
loop differs, so the ratio is the loop's overhead. Each round gives a ratio to the raw block
next to it; the median of those ratios is reported with a bootstrap 95 % interval, and the
control shows how far a loop reads from an identical one. ddplab's block runs the real loop body
(`Trainer.train_step`: the optimizer step, metrics, log lines and the heartbeat), not a copy.

    python benchmarks/bench_inprocess.py [--workloads mlp] [--launches 3] [--rounds 300] [--block 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check, run, save, summary
from step_contenders import DdplabStep, raw_loader, raw_step, script_batches, script_step


class Alternating(DdplabStep):
    """Started by `ddplab run`, so ddplab's launcher, runtime and settings are the real ones."""

    def fit(self):
        t = self.trainer
        t.setup()
        t._begin_training()
        blocks = {"raw": self._raw_block(), "raw_control": self._raw_block(), "ddplab": self._ddplab_block()}
        if self.w.name == "gpt":
            blocks["script"] = self._script_block()
        for run_block in blocks.values():
            run_block(self.w.warmup)
        times: dict[str, list[float]] = {name: [] for name in blocks}
        names, size = list(blocks), int(os.environ["BENCH_BLOCK"])
        for r in range(int(os.environ["BENCH_ROUNDS"])):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                # who goes first rotates
                dist.barrier()
                t0 = time.perf_counter()
                blocks[name](size)
                times[name].append((time.perf_counter() - t0) / size)
        t.flush_log()
        t._end_training()
        if self.rt.is_main:
            with open(self.cfg.bench.out, "w") as f:
                json.dump(times, f)
        return {}

    def _raw_block(self):
        """The raw loop (step_contenders.raw_step) on ddplab's DDP model and optimizer."""
        model, opt = self.net, self.opt
        batches, rank = iter(raw_loader(self.w, self.rt.rank, self.rt.world_size)), self.rt.rank
        done = [0]

        def run_block(steps: int) -> None:
            for _ in range(steps):
                raw_step(self.w, model, opt, next(batches), done[0], rank)
                done[0] += 1

        return run_block

    def _script_block(self):
        """The GPT script's step (step_contenders.script_step: random windows of the memory-mapped
        token file, the next batch read after the forward) on ddplab's DDP model and optimizer."""
        model, opt, rank = self.net, self.opt, self.rt.rank
        get_batch = script_batches(self.w, rank, self.rt.world_size)
        state = {"batch": get_batch(), "step": 0}

        def run_block(steps: int) -> None:
            for _ in range(steps):
                state["batch"] = script_step(self.w, model, opt, get_batch, state["batch"], state["step"], rank)
                state["step"] += 1

        return run_block

    def _ddplab_block(self):
        t = self.trainer
        batches = [t.data.epoch(t.progress.epoch, t.progress.step_in_epoch)]

        def run_block(steps: int) -> None:
            # The heartbeat paces itself by wall time per step; the other loops' blocks are not
            # this loop's step time, so its clock restarts here (as after an evaluation).
            t.intervals.restart_clock(t.progress.step)
            for _ in range(steps):
                if not batches[0].has_step(t.progress.step_in_epoch):
                    # as fit() does at an epoch's end
                    t._end_epoch()
                    batches[0] = t.data.epoch(t.progress.epoch, t.progress.step_in_epoch)
                    batches[0].has_step(0)
                t.train_step(batches[0])

        return run_block


def main() -> None:
    from bench_steps import ddplab_command

    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="mlp")
    p.add_argument("--rounds", type=int, default=300, help="rounds per launch")
    p.add_argument("--launches", type=int, default=3, help="separate launches, pooled")
    p.add_argument("--block", type=int, default=100, help="steps per block")
    args = p.parse_args()
    from bench_steps import load_results

    # the workloads not measured this time keep their last results
    last = load_results("inprocess") or {}
    results = last.get("results", {})
    for row in results.values():
        row.setdefault("setup", {k: last[k] for k in ("rounds", "launches", "block_steps") if k in last})
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            times: dict[str, list[float]] = {}
            per_launch: dict[str, list[float]] = {"raw_control": [], "ddplab": []}
            if workload == "gpt":
                per_launch["script"] = []
            for launch in range(args.launches):
                # where each launch's memory lies differs: pool them
                out = os.path.join(tmp, f"{workload}-{launch}.json")
                cmd = ddplab_command("benchmarks/bench_inprocess.py:Alternating", workload, out, 2)
                res = run(cmd, env={"BENCH_ROUNDS": str(args.rounds), "BENCH_BLOCK": str(args.block)}, timeout=3600)
                if not os.path.exists(out):
                    check(res, f"alternating blocks on {workload}")
                with open(out) as f:
                    got = json.load(f)
                for name, values in got.items():
                    times.setdefault(name, []).extend(values)
                for name in per_launch:
                    per_launch[name].append(paired_ratio(got[name], got["raw"], resamples=0)["median"])
                print(
                    f"{workload} launch {launch + 1}: "
                    + ", ".join(f"{n} / raw = {v[-1]:.4f}" for n, v in per_launch.items()),
                    file=sys.stderr,
                )
            results[workload] = {
                "setup": {"rounds": args.rounds, "launches": args.launches, "block_steps": args.block},
                "raw": summary(times["raw"]),
            }
            if "script" in times:
                # the goal of the GPT workload: ddplab's loop against the script's, block by block
                results[workload]["ddplab_vs_script"] = paired_ratio(times["ddplab"], times["script"])
                print(f"{workload}: ddplab / script = {results[workload]['ddplab_vs_script']}", file=sys.stderr)
            for name in per_launch:
                row = results[workload][name] = summary(times[name], times["raw"])
                row["paired"] = {**paired_ratio(times[name], times["raw"]), "per_launch": per_launch[name]}
                print(
                    f"{workload}: {name} / raw = {row['paired']['median']:.4f} (median of {len(times[name])} "
                    f"paired blocks; 95 % interval {row['paired']['low']:.4f}-{row['paired']['high']:.4f})",
                    file=sys.stderr,
                )
    save(
        "inprocess",
        {"rounds": args.rounds, "launches": args.launches, "block_steps": args.block, "ranks": 2, "results": results},
    )


def paired_ratio(times: list[float], baseline: list[float], resamples: int = 5000) -> dict:
    """Median of the rounds' ratios to the baseline block of the same round, with a bootstrap
    95 % interval of that median."""
    ratios = [t / b for t, b in zip(times, baseline, strict=True)]
    if not resamples:
        return {"median": statistics.median(ratios)}
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {
        "median": statistics.median(ratios),
        "low": medians[int(0.025 * resamples)],
        "high": medians[int(0.975 * resamples)],
    }


if __name__ == "__main__":
    main()
