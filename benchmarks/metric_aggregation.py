"""Metric aggregation on the alignment_stats workload, two ways, timed and counted on every rank.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/metric_aggregation.py MODE OUT

The same training (5 replicate MLPs 64-100-100-50-10 on the digits, DDP, Adam, global batch 128)
with alignment measured at every step, its measurements aggregated either
  seed000: as seed 000 describes: loss and accuracy all_reduced and read on the host every
           batch, and one all_gather per layer per step for the alignment replicates;
  ddplab:  loss and accuracy accumulated on the device (MetricTracker: one packed all_reduce per
           log interval of 10 steps), alignment of all layers in one all_gather (gather_nested).
Rank 0 writes seconds per step and the number of metric collectives per logged step to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ddplab import collectives
from ddplab.experiments.alignment import AlignmentMLP, alignment, covariance
from ddplab.experiments.alignment_stats import Replicates
from ddplab.experiments.images import load_images
from ddplab.train.metrics import MetricTracker

STEPS, WARMUP, LOG_EVERY, GLOBAL_BATCH = 110, 10, 10, 128
CALLS = {"n": 0}


def count_collectives() -> None:
    """Wrap the collectives the metric code can call, so each call is counted (DDP's own gradient
    all_reduce runs in C++ and is not)."""
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            CALLS["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def layer_alignments(nets, x) -> list[torch.Tensor]:
    """[(replicates, neurons) per layer] on this rank's batch."""
    per_layer: list[list[torch.Tensor]] = []
    for net in nets:
        _, inputs = net(x, capture=True)
        for layer, (w, inp) in enumerate(zip(net.alignment_weights(), inputs, strict=False)):
            if len(per_layer) <= layer:
                per_layer.append([])
            per_layer[layer].append(alignment(w, covariance(inp)).float())
    return [torch.stack(v) for v in per_layer]


def seed000_aggregate(loss, acc, aligned, world):
    for value in (loss, acc):
        t = value.detach().clone()
        dist.all_reduce(t)
        (t / world).item()
    for layer in aligned:
        # one all_gather per layer, every step
        parts = [torch.empty_like(layer) for _ in range(world)]
        dist.all_gather(parts, layer)


def main(mode: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    count_collectives()
    train, _, side, classes = load_images("", 0)
    torch.manual_seed(0)
    nets = Replicates([AlignmentMLP(side * side, classes, (100, 100, 50)) for _ in range(5)])
    model = torch.nn.parallel.DistributedDataParallel(nets)
    opts = [torch.optim.Adam(n.parameters(), lr=1e-3) for n in nets.nets]
    tracker, per_rank = MetricTracker(torch.device("cpu")), GLOBAL_BATCH // world
    x_all, y_all = train.tensors
    t0, calls0 = 0.0, 0
    for step in range(STEPS):
        if step == WARMUP:
            t0, calls0 = time.perf_counter(), CALLS["n"]
        start = (step * GLOBAL_BATCH) % (len(x_all) - GLOBAL_BATCH) + rank * per_rank
        x, y = x_all[start : start + per_rank], y_all[start : start + per_rank]
        with torch.no_grad():
            aligned = layer_alignments(nets.nets, x)
        logits = model(x)
        loss = torch.stack([F.cross_entropy(out, y) for out in logits]).sum()
        acc = (logits.argmax(2) == y).float().mean()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        if mode == "seed000":
            seed000_aggregate(loss, acc, aligned, world)
        else:
            tracker.add("loss", loss)
            tracker.add("acc", acc)
            collectives.gather_nested(aligned)
            if (step + 1) % LOG_EVERY == 0:
                tracker.compute()
    elapsed, calls = time.perf_counter() - t0, CALLS["n"] - calls0
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "step_s": elapsed / (STEPS - WARMUP),
                    "collectives_per_logged_step": calls / ((STEPS - WARMUP) / LOG_EVERY),
                    "alignment_layers": len(aligned),
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)
