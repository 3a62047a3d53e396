"""Metric aggregation on the alignment_stats workload: seed 000's per-batch collectives against
ddplab's packed ones (see metric_aggregation.py), 2 gloo ranks, interleaved.

    python benchmarks/bench_metrics.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from common import PYTHON, check, interleaved, run, save, table


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:

        def mode(name: str):
            def measure() -> float:
                out = os.path.join(tmp, f"{name}.json")
                res = run(
                    [
                        PYTHON,
                        "-m",
                        "torch.distributed.run",
                        "--nproc-per-node",
                        "2",
                        "--standalone",
                        "benchmarks/metric_aggregation.py",
                        name,
                        out,
                    ]
                )
                if not os.path.exists(out):
                    check(res, name)
                with open(out) as f:
                    data = json.load(f)
                os.remove(out)
                counts[name] = data["collectives_per_logged_step"]
                return data["step_s"]

            return measure

        results = interleaved({"seed000": mode("seed000"), "ddplab": mode("ddplab")}, args.rounds)
    save(
        "metrics",
        {
            "rounds": args.rounds,
            "log_every": 10,
            "per_step_s": table(results, "seed000"),
            "collectives_per_logged_step": counts,
        },
    )


if __name__ == "__main__":
    main()
