"""Resume cost: time from the command to the first training step when resuming at 0 %, 50 % and
90 % of an epoch (the mlp workload: 16,384 samples, 256 steps per epoch, one process).

    python benchmarks/bench_resume.py [--rounds 5]

ddplab's sampler state is (epoch, step in epoch), so a resume jumps straight to its batch; a
framework that replays batches to get there pays in proportion to the position.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import PYTHON, check, interleaved, run, save, table

# optimizer steps: epoch 1 starts at step 256
POSITIONS = {"0 %": 256, "50 %": 384, "90 %": 486}


def base(tmp: str, name: str, steps: int) -> list[str]:
    return [
        PYTHON,
        "-m",
        "ddplab",
        "run",
        "benchmarks/step_contenders.py:DdplabStep",
        "bench.workload=mlp",
        f"bench.out={tmp}/{name}.json",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=64",
        "trainer.progress=false",
        "log.tensorboard=false",
        f"run.dir={tmp}/runs",
        f"run.name={name}",
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for steps in POSITIONS.values():
            # one checkpoint at each position
            check(run(base(tmp, f"at{steps}", steps)), f"training to step {steps}")
        counter = {"n": 0}

        def resume_from(steps: int):
            def measure() -> float:
                counter["n"] += 1
                marker = os.path.join(tmp, "first-step")
                if os.path.exists(marker):
                    os.remove(marker)
                checkpoint = os.path.join(tmp, "runs", "ddplabstep", f"at{steps}")
                started = time.time()
                res = run(
                    [*base(tmp, f"resume{counter['n']}", steps + 5), f"run.resume={checkpoint}"],
                    env={"BENCH_FIRST_STEP_FILE": marker},
                )
                check(res, f"resume at step {steps}")
                return float(open(marker).read()) - started

            return measure

        results = interleaved({label: resume_from(steps) for label, steps in POSITIONS.items()}, args.rounds)
    save("resume", {"rounds": args.rounds, "steps_per_epoch": 256, "time_to_first_step": table(results, "0 %")})


if __name__ == "__main__":
    main()
