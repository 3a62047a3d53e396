"""Checkpoints in object storage: a 100 MB checkpoint saved to and loaded from an S3-compatible
server (moto's, in its own process on 127.0.0.1) against the local disk, and what an upload in the
background costs the training steps it overlaps.

    python benchmarks/bench_object_storage.py [--rounds 5]

Saves: how long the caller is blocked until the checkpoint is committed (local: the rename; bucket:
the local commit, then every object and the marker uploaded) and, with checkpoint.async_save, only
until the state is copied to CPU memory. Loads: from the local copy (checksums checked), from the
bucket on a machine without it, and from the bucket on the machine that wrote it (its local copy,
once its marker matches). Steps: the median time of a CPU training step of a small MLP, alone and
while an asynchronous save (local, or local then bucket) runs beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from common import interleaved, save, table
from ddplab.checkpoint.mirror import RunMirror, Uploads
from ddplab.checkpoint.store import CheckpointManager, load_state

SERVER = """
import logging, sys, time, warnings
warnings.simplefilter("ignore")
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False).start()
print("ready", flush=True)
time.sleep(10**6)
"""


def start_server() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    import boto3

    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
    return proc, "s3://bench/runs/bench/r"


def manager(folder: str, url: str | None, async_save: bool) -> CheckpointManager:
    uploads = Uploads(RunMirror(url, folder), 2, 0, "max") if url else None
    return CheckpointManager(
        os.path.join(folder, "checkpoints"),
        keep_last=2,
        async_save=async_save,
        remote=url and f"{url}/checkpoints",
        uploads=uploads,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    # 100 MB: 25 tensors of a million float32
    state = {"models": {"net": {f"w{i}": torch.randn(1_000_000) for i in range(25)}}, "progress": {"step": 0}}
    server, url = start_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            savers = {
                "local disk": manager(os.path.join(tmp, "local"), None, False),
                "bucket": manager(os.path.join(tmp, "bucket"), url + "-sync", False),
                "bucket, async_save": manager(os.path.join(tmp, "async"), url + "-async", True),
            }
            step = {"n": 0}

            def timed_save(m: CheckpointManager):
                def measure() -> float:
                    m.wait()
                    step["n"] += 1
                    t = time.perf_counter()
                    m.save(state, step["n"], 0, None)
                    return time.perf_counter() - t

                return measure

            saves = interleaved({name: timed_save(m) for name, m in savers.items()}, args.rounds)
            for m in savers.values():
                m.wait()
            local = savers["local disk"].list()[-1].path
            remote_info = savers["bucket"].list()[-1]
            remote = f"{url}-sync/checkpoints/{os.path.basename(remote_info.path)}"
            cache = os.path.join(tmp, "bucket", "checkpoints")

            def timed(fn):
                def measure() -> float:
                    t = time.perf_counter()
                    fn()
                    return time.perf_counter() - t

                return measure

            loads = interleaved(
                {
                    "local disk": timed(lambda: load_state(local)),
                    "bucket, a new machine": timed(lambda: load_state(remote)),
                    "bucket, the machine that wrote it": timed(lambda: load_state(remote, cache=cache)),
                },
                args.rounds,
            )
            steps = step_cost(savers, state, args.rounds, step)
    finally:
        server.kill()
    save(
        "object_storage",
        {
            "rounds": args.rounds,
            "state_bytes": 25 * 4_000_000,
            "blocked_per_save": table(saves, "local disk"),
            "load": table(loads, "local disk"),
            "step_during_async_save": table(steps, "no save"),
        },
    )


def step_cost(savers: dict, state: dict, rounds: int, step: dict) -> dict[str, list[float]]:
    """Median step time of a small MLP over 30 steps, alone or beside an asynchronous save."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(256, 512)
    background = {
        "no save": None,
        "async save, local disk": manager(tempfile.mkdtemp(), None, True),
        "async save, local then bucket": savers["bucket, async_save"],
    }

    def steps_beside(m):
        def measure() -> float:
            if m is not None:
                m.wait()
                step["n"] += 1
                m.save(state, step["n"], 0, None)
            times = []
            for _ in range(30):
                t = time.perf_counter()
                opt.zero_grad()
                net(x).square().mean().backward()
                opt.step()
                times.append(time.perf_counter() - t)
            if m is not None:
                m.wait()
            return statistics.median(times)

        return measure

    return interleaved({name: steps_beside(m) for name, m in background.items()}, rounds)


if __name__ == "__main__":
    main()
