"""Resuming mid-epoch on data bigger than memory: time to the first batch at 0 % and 90 % of an epoch.

    python benchmarks/bench_data_resume.py [--rounds 5]

The same 65,536 samples (a 64-float tensor and a class each) are written once as webdataset shards
(`ddplab.write_shards`, 4,096 samples a shard) and read two ways, each resumed at step 0 and at 90 %
of an epoch of 1,024 steps (global batch 64, one rank): by position (`ddplab.ShardedDataset`: the
sampler jumps to its step) and as a stream without a state_dict (a webdataset pipeline, which a
resume has to read up to its step). In process: what is timed is building the loader and taking
its first batch.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import ddplab
from common import interleaved, save, table
from ddplab.train.data import BatchPlan, train_loader
from ddplab.train.sources import RankStream

N, G, PER_SHARD = 65_536, 64, 4_096
STEPS = N // G


def first_batch_by_position(index: str, step: int) -> float:
    started = time.perf_counter()
    data = ddplab.ShardedDataset(index, transform=lambda s: (s["x.pth"], s["cls"]))
    loader = train_loader(data, BatchPlan(G, 1, 1), 0, 0, 0, step, torch.utils.data.default_collate, 0, False)
    next(iter(loader))
    return time.perf_counter() - started


def first_batch_of_stream(urls: list[str], step: int) -> float:
    import webdataset as wds

    started = time.perf_counter()
    stream = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False)
    source = RankStream(
        stream.decode().map(lambda s: (s["x.pth"], s["cls"])), BatchPlan(G, 1, 1), 0, torch.utils.data.default_collate
    )
    next(source.epoch(0, step))
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    at90 = int(STEPS * 0.9)
    with tempfile.TemporaryDirectory() as tmp:
        g = torch.Generator().manual_seed(0)
        index = ddplab.write_shards(
            ({"x.pth": torch.randn(64, generator=g), "cls": i % 10} for i in range(N)), f"{tmp}/shards", PER_SHARD
        )
        urls = [s["path"] for s in ddplab.ShardedDataset(index).shards]
        results = interleaved(
            {
                "by position, 0 %": lambda: first_batch_by_position(index, 0),
                "by position, 90 %": lambda: first_batch_by_position(index, at90),
                "stream, 0 %": lambda: first_batch_of_stream(urls, 0),
                "stream, 90 %": lambda: first_batch_of_stream(urls, at90),
            },
            args.rounds,
        )
    position = table({k: v for k, v in results.items() if k.startswith("by")}, "by position, 0 %")
    stream = table({k: v for k, v in results.items() if k.startswith("stream")}, "stream, 0 %")
    save(
        "data_resume",
        {"samples": N, "steps_per_epoch": STEPS, "resume_step": at90, "by_position": position, "stream": stream},
    )


if __name__ == "__main__":
    main()
