"""Import and start-up: `import ddplab` against `import torch`, and the time from the command to
the first training step, `ddplab run -n 2` against `torchrun` of the raw loop.

    python benchmarks/bench_startup.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench_steps import command
from common import PYTHON, check, interleaved, run, save, table


def import_time(statement: str):
    def measure() -> float:
        t = time.perf_counter()
        check(run([PYTHON, "-c", statement]), statement)
        return time.perf_counter() - t

    return measure


def first_step(contender: str, tmp: str):
    def measure() -> float:
        marker = os.path.join(tmp, f"first-{contender}")
        if os.path.exists(marker):
            os.remove(marker)
        started = time.time()
        res = run(
            command(contender, "mlp", os.path.join(tmp, f"{contender}.json"), 2), env={"BENCH_FIRST_STEP_FILE": marker}
        )
        if not os.path.exists(marker):
            check(res, contender)
        return float(open(marker).read()) - started

    return measure


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    imports = interleaved(
        {
            "import torch": import_time("import torch"),
            "import ddplab": import_time("import ddplab"),
            "import ddplab; ddplab.Experiment": import_time("import ddplab; ddplab.Experiment"),
            "import lightning": import_time("import lightning"),
            "import accelerate": import_time("import accelerate"),
        },
        args.rounds,
    )
    with tempfile.TemporaryDirectory() as tmp:
        starts = interleaved({"raw": first_step("raw", tmp), "ddplab": first_step("ddplab", tmp)}, args.rounds)
    save(
        "startup",
        {"rounds": args.rounds, "imports": table(imports, "import torch"), "time_to_first_step": table(starts, "raw")},
    )


if __name__ == "__main__":
    main()
