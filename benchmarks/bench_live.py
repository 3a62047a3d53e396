"""Live recovery measured beside ddplab's restart path: what a lost process costs, and what the
quorum costs a step when nothing fails.

Failure: the regression of tests/fixtures/live.py with a 0.1 s step (a stand-in for compute), 60
steps of 2 processes, process 1 SIGKILLed inside its backward of step 15 (its peer waits in the
gradients' all_reduce). Live: `-n 2 dist.fault_tolerance=live`, the replacement heals from the peer.
Restart: `-n 2 --max-restarts 1` with a checkpoint every 10 steps: every worker restarts and resumes
from step 10. Each against the same command without the kill, interleaved rounds; the cost of the
failure is the difference in wall time, and the steps it made the job train again are counted from
the run (live.jsonl's attempts; the restart's resume line).

No failure: the same model without the sleep (a step of about a millisecond, where the quorum's
round trips weigh most), 300 steps, 2 processes, DDP against live; time per step from the runs' logs
after their first interval. Results in benchmarks/results/live.json (docs/benchmarks.md).

    python benchmarks/bench_live.py [--rounds 3]
"""

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from common import PYTHON, check, interleaved, run, save, summary

TARGET = "tests/fixtures/live.py:Replicated"
COMMON = ["trainer.global_batch_size=32", "trainer.progress=false", "log.tensorboard=false", "trainer.log_every=10"]
MODES = {"live": ["dist.fault_tolerance=live"], "restart": ["--max-restarts", "1", "trainer.checkpoint_every=10"]}
KILL_STEP = 15


def _cmd(out: Path, name: str, mode: str, steps: int) -> list[str]:
    return [PYTHON, "-m", "ddplab", "run", TARGET, "-n", "2", f"run.dir={out}", f"run.name={name}",
            f"trainer.max_steps={steps}", *COMMON, *MODES[mode]]  # fmt: skip


def failure(out: Path, rounds: int) -> dict:
    counter = {"n": 0}
    redone: dict[str, list[int]] = {"live": [], "restart": []}

    def contender(mode: str, kill: bool):
        def measure() -> float:
            counter["n"] += 1
            name = f"{mode}-{'kill' if kill else 'calm'}-{counter['n']}"
            env = {"DDPLAB_TEST_STEP_S": "0.1"}
            if kill:
                env |= {"DDPLAB_TEST_KILL": f"1:{KILL_STEP}:backward", "DDPLAB_TEST_KILL_ONCE": str(out / name)}
            began = time.perf_counter()
            res = run(_cmd(out, name, mode, 60), env=env)
            seconds = time.perf_counter() - began
            check(res, name)
            if kill:
                redone[mode].append(_redone(out / "replicated" / name, mode, res.stdout + res.stderr))
            return seconds

        return measure

    times = interleaved(
        {f"{mode} {what}": contender(mode, what == "killed") for mode in MODES for what in ("uninterrupted", "killed")},
        rounds,
    )
    rows = {}
    for mode in MODES:
        calm, killed = times[f"{mode} uninterrupted"], times[f"{mode} killed"]
        rows[mode] = {
            "uninterrupted": summary(calm),
            "killed": summary(killed, calm),
            "cost_s": statistics.median(killed) - statistics.median(calm),
            "steps_redone": redone[mode],
        }
    return rows


def _redone(folder: Path, mode: str, output: str) -> int:
    """Steps the failure made the job train again."""
    if mode == "live":
        records = [json.loads(line) for line in (folder / "replica-0" / "live.jsonl").read_text().splitlines()]
        return sum(r["attempts"] - 1 for r in records)
    resumed = int(re.search(r"resumed from .* at step (\d+)", output).group(1))
    return KILL_STEP - 1 - resumed


def calm_steps(out: Path, rounds: int) -> dict:
    counter = {"n": 0}

    def contender(mode: str):
        def measure() -> float:
            counter["n"] += 1
            name = f"steps-{mode}-{counter['n']}"
            check(run(_cmd(out, name, "live" if mode == "live" else "restart", 300)), name)
            folder = out / "replicated" / name / ("replica-0" if mode == "live" else "")
            rates = [
                r["train/samples_per_s"]
                for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                if "train/samples_per_s" in r
            ][1:]
            return 32 / statistics.median(rates)

        return measure

    times = interleaved({"ddp": contender("ddp"), "live": contender("live")}, rounds)
    return {name: summary(values, times["ddp"]) for name, values in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = {"failure": failure(out, args.rounds), "steps": calm_steps(out, args.rounds), "kill_step": KILL_STEP}
    save("live", {"workload": "tests/fixtures/live.py (8-32-1 MLP, global batch 32), 2 processes, CPU", **data})


if __name__ == "__main__":
    main()
