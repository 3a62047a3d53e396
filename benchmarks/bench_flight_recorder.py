"""What keeping torch's flight recorder on costs a DDP step: ddplab turns it on for every job
(distributed/hangs.py). The recorder is a process-wide singleton sized when the first collective
runs, so it cannot be toggled inside one process: separate launches of a raw DDP loop alternate
off and on (ABBA order, so drift over time hits both alike), and the ratio of their medians is
reported with each pair's own ratio.

    python benchmarks/bench_flight_recorder.py [--pairs 4] [--steps 200] [--blocks 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from common import PYTHON, machine, save

SIZE = "2000"


def child(steps: int, blocks: int) -> None:
    """One rank of the raw loop: median seconds per step over `blocks` blocks of `steps` steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU()]
    net = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(256, 2)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 2, (32,))

    def run(n: int) -> None:
        for _ in range(n):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()

    run(steps)
    times = []
    for _ in range(blocks):
        dist.barrier()
        start = time.perf_counter()
        run(steps)
        times.append((time.perf_counter() - start) / steps)
    if dist.get_rank() == 0:
        print(f"SECONDS_PER_STEP {statistics.median(times)!r}")
    dist.destroy_process_group()


def launch(size: str, steps: int, blocks: int) -> float:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": size, "TORCH_NCCL_TRACE_BUFFER_SIZE": size}
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, "--child"]
    out = subprocess.run(
        [*command, "--steps", str(steps), "--blocks", str(blocks)], env=env, capture_output=True, text=True, check=True
    )
    return float(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("SECONDS_PER_STEP")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.steps, args.blocks)
        return
    off, on = [], []
    for pair in range(args.pairs):
        order = [("0", off), (SIZE, on)] if pair % 2 == 0 else [(SIZE, on), ("0", off)]
        for size, into in order:
            into.append(launch(size, args.steps, args.blocks))
            print(f"  pair {pair + 1}/{args.pairs} recorder {size}: {1000 * into[-1]:.3f} ms/step", file=sys.stderr)
    pairs = [b / a for a, b in zip(off, on, strict=True)]
    result = {
        "machine": machine(),
        "entries": int(SIZE),
        "off_ms": [1000 * s for s in off],
        "on_ms": [1000 * s for s in on],
        "ratio": statistics.median(on) / statistics.median(off),
        "pair_ratios": pairs,
    }
    save("flight_recorder", result)
    print(f"flight recorder on / off = {result['ratio']:.3f} (pairs: {', '.join(f'{r:.3f}' for r in pairs)})")


if __name__ == "__main__":
    main()
