"""DDP's levers measured side by side: gradient compression over a slow link, optimizer sharding's memory.

Compression: two nodes in network namespaces joined by a veth pair that tc's tbf qdisc limits to
1 Gbit/s and to 10 Gbit/s each way (scripts/two-nodes.sh --rate), one rank per node, the
communication-bound wide MLP (comm_bound.py). For each hook: the step time (from the run's own log,
after the first logged interval), the bytes one node sends per step (its veth's counter, read while
the run is between two logged steps), and the eval loss after the same number of steps (what the
compression costs in accuracy). Sharding: the optimizer state (Adam) each rank holds at 1, 2 and 4
ranks on one machine, sharded and not. Needs root and iproute2; results in
benchmarks/results/comm_hooks.json.

    python benchmarks/bench_comm_hooks.py [--steps 60] [--rates 1gbit,10gbit] [--rounds 3] [--contenders ...]
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = "benchmarks/comm_bound.py:WideMLP"
# the two nodes share this machine's cores: one thread each, or they would fight over them (every
# framework gets the same: OMP_NUM_THREADS=1 for the contenders)
COMMON = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=64",
    "checkpoint.at_end=false",
    "dist.cpu_threads=1",
]
# a contender that has not finished by then is stopped and reported as hung (a few runs take 30 s)
CONTENDER_LIMIT_S = 240
HOOKS = {
    "none": [],
    "fp16": ["dist.comm_hook=fp16"],
    # ddplab only: Lightning registers no hook on the CPU, and DDP refuses torch's bf16 hook without NCCL
    "bf16": ["dist.comm_hook=bf16"],
    "powersgd": ["dist.comm_hook=powersgd", "dist.powersgd_rank=4", "dist.powersgd_start_iter=2"],
    # ddplab only: smaller buckets leave less of the last one's all_reduce after the backward
    "fp16, 2 MiB buckets": ["dist.comm_hook=fp16", "dist.bucket_cap_mb=2"],
}
# the hooks Lightning and Accelerate are run with too
CONTENDED = ("none", "fp16", "powersgd")


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sent_bytes(prefix: str) -> int | None:
    """Bytes node 0's end of the link has sent so far (None before the namespaces exist)."""
    veth = f"{prefix[:11]}v0"
    got = subprocess.run(
        ["ip", "netns", "exec", f"{prefix}n0", "cat", f"/sys/class/net/{veth}/statistics/tx_bytes"],
        capture_output=True,
        text=True,
    )
    return int(got.stdout) if got.returncode == 0 and got.stdout.strip() else None


def _watch_bytes(prefix: str, sent: list[int], done: threading.Event) -> None:
    """Keep the last reading of node 0's sent-bytes counter until its namespace goes with the run."""
    while not done.is_set():
        reading = _sent_bytes(prefix)
        if reading is not None:
            sent[0] = reading
        time.sleep(0.05)


def _two_nodes(hook: str, rate: str, steps: int, out: Path, port: int) -> tuple[Path, int]:
    """One run over the shaped link: its folder, and the bytes node 0 sent in all."""
    prefix = f"dlb{os.getpid() % 10000}{port % 100}"
    run_dir = out / "widemlp" / f"{hook}-{rate}-{steps}"
    settings = [*COMMON, f"trainer.max_steps={steps}", "trainer.log_every=5", *HOOKS[hook]]
    env = {**os.environ, "PYTHON": sys.executable, "NETNS": prefix, "LOG_DIR": str(out / "logs" / run_dir.name)}
    sent = [0]
    done = threading.Event()
    watcher = threading.Thread(target=_watch_bytes, args=(prefix, sent, done), daemon=True)
    watcher.start()
    try:
        res = subprocess.run(
            ["bash", "scripts/two-nodes.sh", "--rate", rate, "--port", str(port), TARGET, f"run.dir={out}",
             f"run.name={run_dir.name}", *settings],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    finally:
        done.set()
        watcher.join()
    if res.returncode != 0:
        raise RuntimeError(f"{hook} at {rate} failed:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
    return run_dir, sent[0]


def run_hook(hook: str, rate: str, steps: int, out: Path, port: int) -> dict:
    """Step time and losses from a run of `steps`; bytes per step from it and a run of a third as many
    (start-up and evaluation send the same in both)."""
    run_dir, sent_long = _two_nodes(hook, rate, steps, out, port)
    _, sent_short = _two_nodes(hook, rate, steps // 3, out, port + 100)
    train = [m for m in _metrics(run_dir) if "train/loss" in m]
    evals = [m for m in _metrics(run_dir) if "eval/loss" in m]
    # per step, from the second logged interval on (the first holds start-up)
    step_s = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in itertools.pairwise(train[1:])]
    return {
        "hook": hook,
        "rate": rate,
        "step_ms": round(1000 * statistics.median(step_s), 1),
        "sent_mb_per_step": round((sent_long - sent_short) / (steps - steps // 3) / 2**20, 3),
        "eval_loss": round(evals[-1]["eval/loss"], 4),
        "train_loss": round(train[-1]["train/loss"], 4),
    }


def ddplab_rounds(rates: list[str], steps: int, rounds: int, out: Path) -> list[dict]:
    """Every hook at every rate, `rounds` times interleaved (the machine drifts by a few percent
    between runs): each row's step is the median of its rounds, the rounds kept beside it."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in range(rounds):
        for i, rate in enumerate(rates):
            for j, hook in enumerate(HOOKS):
                got = run_hook(hook, rate, steps, out, 29600 + 20 * i + 3 * j)
                rows.setdefault((rate, hook), []).append(got)
                print(f"round {r + 1}/{rounds}: {json.dumps(got)}", flush=True)
    merged = []
    for runs in rows.values():
        steps_ms = [run["step_ms"] for run in runs]
        merged.append({**runs[0], "step_ms": statistics.median(steps_ms), "step_ms_rounds": steps_ms})
    return merged


def run_contender(framework: str, hook: str, rate: str, steps: int, out: Path, port: int) -> float | str:
    """The same workload and hook in Lightning or Accelerate over the same link: its median step in ms,
    or what ended it."""
    prefix = f"dlc{os.getpid() % 10000}{port % 100}"
    result = out / f"{framework}-{hook}-{rate}.json"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "NETNS": prefix,
        "LOG_DIR": str(out / "logs" / result.stem),
        "OMP_NUM_THREADS": "1",
    }
    try:
        res = subprocess.run(
            ["bash", "scripts/two-nodes.sh", "--torchrun", "--rate", rate, "--port", str(port),
             "benchmarks/comm_contenders.py", framework, hook, str(steps), str(result)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=CONTENDER_LIMIT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        # two-nodes.sh removes its namespaces, and with them the workers, when it is killed
        subprocess.run(["pkill", "-KILL", "-f", str(result)], capture_output=True)
        return f"hung: no end in {CONTENDER_LIMIT_S} s"
    if res.returncode != 0:
        errors = [line for line in res.stdout.splitlines() if "Error" in line or "what():" in line]
        return "failed: " + (errors[0].strip()[:200] if errors else f"exit {res.returncode}")
    return json.loads(result.read_text())["step_ms"]


# ZeRO shares out whole parameters: eight equal 512 x 512 layers can be shared out evenly over 4 ranks
MEMORY_MODEL = ["model.width=512", "model.depth=8"]


def sharded_memory(out: Path) -> list[dict]:
    """Adam's state per rank at 1, 2 and 4 ranks on this machine, sharded and not."""
    rows = []
    for ranks in (1, 2, 4):
        for shard in (False, True):
            if ranks == 1 and shard:
                continue
            name = f"adam-{ranks}-{'sharded' if shard else 'plain'}"
            cmd = [sys.executable, "-m", "ddplab", "run", TARGET, "-n", str(ranks), f"run.dir={out}",
                   f"run.name={name}", *COMMON, "trainer.max_steps=4", "model.optimizer=adam", *MEMORY_MODEL,
                   f"dist.shard_optimizer={str(shard).lower()}"]  # fmt: skip
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600)
            held = [
                json.loads((out / "widemlp" / name / "results" / f"optimizer-rank{r}.json").read_text())["state_bytes"]
                for r in range(ranks)
            ]
            rows.append({"ranks": ranks, "sharded": shard, "state_mb_per_rank": [round(b / 2**20, 2) for b in held]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--rounds", type=int, default=3, help="ddplab's runs of each hook and rate")
    parser.add_argument(
        "--contenders", default="lightning,accelerate", help="'' keeps their last figures (each hang costs 4 min)"
    )
    args = parser.parse_args()
    path = REPO / "benchmarks" / "results" / "comm_hooks.json"
    last = {(r["rate"], r["hook"]): r for r in json.loads(path.read_text())["hooks"]} if path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rates = args.rates.split(",")
        hooks = ddplab_rounds(rates, args.steps, args.rounds, out)
        for row in hooks:
            for k, framework in enumerate(("lightning", "accelerate")):
                key = f"{framework}_step_ms"
                if row["hook"] not in CONTENDED:
                    row[key] = "-"
                elif framework in args.contenders.split(","):
                    port = 29601 + 20 * rates.index(row["rate"]) + 3 * list(HOOKS).index(row["hook"]) + k
                    row[key] = run_contender(framework, row["hook"], row["rate"], args.steps, out, port)
                else:
                    row[key] = last.get((row["rate"], row["hook"]), {}).get(key, "not run")
            print(json.dumps(row), flush=True)
        memory = sharded_memory(out)
        for row in memory:
            print(json.dumps(row), flush=True)
    result = {
        "workload": "wide MLP 256-1024-1024-1024-10 (2.4 M parameters), global batch 64, SGD, one rank per node",
        "rounds": args.rounds,
        "memory_workload": "MLP 256-512x8-10 (2.0 M parameters), Adam",
        "hooks": hooks,
        "zero": memory,
    }
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
