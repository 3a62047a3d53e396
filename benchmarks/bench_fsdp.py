"""Sharded training measured beside DDP: what each rank holds, and what a step costs.

Memory: the wide MLP of comm_bound.py (8 layers of 2048 x 2048 after a 256-wide input, 30 M
parameters, Adam) at 1, 2 and 4 ranks on one machine with dist.strategy=ddp, with
dist.shard_optimizer=true, and with dist.strategy=fsdp (each Linear a unit). Each rank writes the
bytes of weights, gradients (when the optimizer steps) and optimizer state it holds; the run's
summary gives each rank's peak resident memory. Time: the same model at 2 ranks, DDP and FSDP,
interleaved rounds, the time per step from the run's own log after its first interval.
Results in benchmarks/results/fsdp.json (docs/benchmarks.md: `write_report.py`).

    python benchmarks/bench_fsdp.py [--rounds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, interleaved, summary

REPO = Path(__file__).resolve().parents[1]
TARGET = "benchmarks/comm_bound.py:WideMLP"
MODEL = ["model.width=2048", "model.depth=8", "model.optimizer=adam"]
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=64", "checkpoint.at_end=false"]
STRATEGIES = {
    "ddp": ["dist.strategy=ddp"],
    "ddp + shard_optimizer": ["dist.strategy=ddp", "dist.shard_optimizer=true"],
    "fsdp": ["dist.strategy=fsdp", "dist.fsdp_units=Linear"],
    "fsdp, fixed mmap threshold": ["dist.strategy=fsdp", "dist.fsdp_units=Linear"],
}
# glibc raises its mmap threshold after a large block is freed, and then keeps the freed all-gather and
# reduce-scatter buffers in its heap: resident memory grows though the tensors are gone. A fixed threshold
# gives blocks of 64 KiB and more back to the system when freed.
ENV = {"fsdp, fixed mmap threshold": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def _run(out: Path, name: str, ranks: int, settings: list[str], steps: int, env: dict | None = None) -> Path:
    cmd = [sys.executable, "-m", "ddplab", "run", TARGET, "-n", str(ranks), f"run.dir={out}", f"run.name={name}",
           *COMMON, *MODEL, f"trainer.max_steps={steps}", "trainer.log_every=5", *settings]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600, env={**os.environ, **(env or {})})
    return out / "widemlp" / name


def memory(out: Path) -> list[dict]:
    rows = []
    for ranks in (1, 2, 4):
        for strategy, settings in STRATEGIES.items():
            if ranks == 1 and strategy != "ddp":
                # one process: nothing to shard across, every strategy is the plain network
                continue
            name = f"mem-{ranks}-{strategy.replace(' ', '').replace(',', '-')}"
            run = _run(out, name, ranks, settings, steps=4, env=ENV.get(strategy))
            held = [json.loads((run / "results" / f"optimizer-rank{r}.json").read_text()) for r in range(ranks)]
            rss = json.loads((run / "summary.json").read_text())["peak_rss_gib"]
            rows.append(
                {
                    "ranks": ranks,
                    "strategy": strategy,
                    "state_mib": [
                        round((h["param_bytes"] + h["grad_bytes"] + h["state_bytes"]) / 2**20, 1) for h in held
                    ],
                    "params_mib": [round(h["param_bytes"] / 2**20, 1) for h in held],
                    "grads_mib": [round(h["grad_bytes"] / 2**20, 1) for h in held],
                    "optimizer_mib": [round(h["state_bytes"] / 2**20, 1) for h in held],
                    "resident_gib": rss,
                }
            )
            print(f"  {ranks} ranks {strategy}: {rows[-1]['state_mib']} MiB", file=sys.stderr, flush=True)
    return rows


def step_time(out: Path, rounds: int) -> dict:
    def timed(strategy: str):
        def once() -> float:
            run = _run(out, f"time-{strategy.replace(' ', '')}", 2, [*STRATEGIES[strategy], "run.resume=never"], 30)
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            # after the first logged interval (start-up, first all-gathers)
            rates = [row["train/samples_per_s"] for row in rows if "train/samples_per_s" in row][1:]
            return 64 / statistics.median(rates)

        return once

    results = interleaved({name: timed(name) for name in ("ddp", "fsdp")}, rounds)
    return {name: summary(values, results["ddp"]) for name, values in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = memory(Path(tmp))
        times = step_time(Path(tmp), args.rounds)
    ddp = {row["ranks"]: max(row["state_mib"]) for row in rows if row["strategy"] == "ddp"}
    fsdp = {row["ranks"]: max(row["state_mib"]) for row in rows if row["strategy"] == "fsdp"}
    # goal: FSDP's state per rank <= 1.1 / W of DDP's
    goal = {str(w): round(fsdp[w] / (ddp[w] / w), 3) for w in fsdp}
    data = {"workload": "MLP 256-2048x8-10 (30 M parameters), Adam", "memory": rows, "step_s": times, "goal": goal}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fsdp.json").write_text(json.dumps(data, indent=1))
    print(json.dumps({"goal (fsdp / (ddp / W))": goal, "fsdp step ratio": times["fsdp"]["ratio"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
