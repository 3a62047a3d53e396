"""One timed training run on one GPU by one contender, for bench_gpu.py.

    python benchmarks/gpu_contenders.py CONTENDER WORKLOAD PRECISION COMPILE OUT [--device cuda]
    python -m ddplab run benchmarks/gpu_contenders.py:DdplabGpu bench.workload=wide bench.out=OUT ...

CONTENDER: raw (the loop a careful user writes by hand), fabric (Lightning Fabric), accelerate
(Hugging Face Accelerate); ddplab runs as an experiment. WORKLOAD: small (the CPU benchmark's MLP,
batch 64), wide (8 layers of 4096, batch 512) or gpt (a decoder-only transformer with tied embeddings,
width 512, 8 blocks, 32 windows of 256 tokens). PRECISION: fp32 or bf16 (autocast). COMPILE: 0 or 1
(torch.compile, the way each contender offers it). Every contender reads pinned batches from a
DataLoader, copies them with non_blocking, reads the loss on the host every 10 steps (a log line)
and saves nothing. The clock starts after `warmup` steps (which include compiling), behind a
torch.cuda.synchronize, and stops behind another after the last step; OUT gets
{"step_s", "samples_per_s", "peak_mem_gib", "first_step_s"}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddplab

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_contenders import StepCfg

LOG_EVERY = 10


@dataclass
class GpuWorkload:
    name: str
    width: int
    depth: int
    batch: int
    steps: int
    warmup: int

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(self.width if i else 64, self.width) for i in range(self.depth)]
        return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())], nn.Linear(self.width, 10))

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.batch * 64, 64, generator=g)
        return TensorDataset(x, (x[:, :10].argmax(1) + (x[:, 10] > 0).long()) % 10)

    def loader(self) -> DataLoader:
        return DataLoader(
            self.dataset(),
            batch_size=self.batch,
            shuffle=True,
            drop_last=True,
            pin_memory=True,
            generator=torch.Generator().manual_seed(0),
        )


@dataclass
class GptWorkload(GpuWorkload):
    """The workload users bring most: the CPU benchmark's GPT (decoder-only, tied embeddings) at a
    GPU's size, on windows of the same token file (workloads.py). `batch` counts sequences."""

    block: int = 256
    heads: int = 8

    def build(self) -> nn.Module:
        from workloads import GPT

        torch.manual_seed(0)
        return GPT(block=self.block, width=self.width, depth=self.depth, heads=self.heads)

    def dataset(self):
        from workloads import Windows, token_file

        return Windows(token_file(), block=self.block)


# the CPU benchmark's MLP: overhead-bound
WORKLOADS = {
    "small": GpuWorkload("small", 128, 2, 64, 3000, 200),
    # compute-bound
    "wide": GpuWorkload("wide", 4096, 8, 512, 400, 50),
    # 25 M parameters, 8192 tokens a step
    "gpt": GptWorkload("gpt", 512, 8, 32, 300, 30),
}
if os.environ.get("BENCH_GPU_CHECK"):
    # bench_gpu.py --device cpu: a few small steps, to check that the code runs
    for _w in WORKLOADS.values():
        _w.steps, _w.warmup, _w.width = 12, 2, min(_w.width, 256)


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy over the last dimension (a class per sample, or a token per position)."""
    x, y = batch
    return nn.functional.cross_entropy(model(x).float().flatten(0, -2), y.flatten())


class Clock:
    """Seconds per step over the steps after `warmup`, each end behind a device synchronisation."""

    def __init__(self, w: GpuWorkload, device: torch.device):
        self.w, self.device, self.started, self.t0 = w, device, time.perf_counter(), 0.0
        self.first_step_s = 0.0

    def at_step(self, step: int) -> None:
        """Call before step `step` (0-based) runs."""
        if step == 1:
            self._sync()
            # building, first batch, compiling
            self.first_step_s = time.perf_counter() - self.started
        if step == self.w.warmup:
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.t0 = time.perf_counter()

    def result(self) -> dict:
        self._sync()
        step_s = (time.perf_counter() - self.t0) / (self.w.steps - self.w.warmup)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {
            "step_s": step_s,
            "samples_per_s": self.w.batch / step_s,
            "peak_mem_gib": peak,
            "first_step_s": self.first_step_s,
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def endless(loader: DataLoader):
    while True:
        yield from loader


def write(out: str, result: dict) -> None:
    with open(out, "w") as f:
        json.dump(result, f)


def timed_steps(w: GpuWorkload, device: torch.device, batches, one_step) -> dict:
    """The loop every contender but ddplab runs: `one_step(batch)` returns the loss, read every LOG_EVERY steps."""
    clock = Clock(w, device)
    for step in range(w.steps):
        clock.at_step(step)
        loss = one_step(next(batches))
        if (step + 1) % LOG_EVERY == 0:
            loss.item()
    return clock.result()


# ---- (a) the loop a careful user writes by hand ---------------------------------------------------
def raw(w: GpuWorkload, precision: str, compiled: bool, device: torch.device) -> dict:
    model = w.build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_model = torch.compile(model) if compiled else model

    def one_step(batch):
        x, y = (t.to(device, non_blocking=True) for t in batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(step_model, (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return timed_steps(w, device, endless(w.loader()), one_step)


def framework_step(model, opt, backward):
    def one_step(batch):
        loss = loss_of(model, batch)
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return one_step


# ---- (b) Lightning Fabric ------------------------------------------------------------------------
def fabric(w: GpuWorkload, precision: str, compiled: bool, device: torch.device) -> dict:
    from lightning.fabric import Fabric

    f = Fabric(accelerator=device.type, devices=1, precision="bf16-mixed" if precision == "bf16" else "32-true")
    model = w.build()
    # Fabric's advice: compile, then setup
    model = torch.compile(model) if compiled else model
    model, opt = f.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return timed_steps(w, device, endless(f.setup_dataloaders(w.loader())), framework_step(model, opt, f.backward))


# ---- (c) Hugging Face Accelerate -----------------------------------------------------------------
def accelerate(w: GpuWorkload, precision: str, compiled: bool, device: torch.device) -> dict:
    from accelerate import Accelerator

    acc = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision="bf16" if precision == "bf16" else "no",
        dynamo_backend="inductor" if compiled else "no",
    )
    model = w.build()
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), w.loader())
    return timed_steps(w, device, endless(loader), framework_step(model, opt, acc.backward))


# ---- (d) ddplab's Experiment ---------------------------------------------------------------------
class DdplabGpu(ddplab.Experiment):
    """The same work as `raw`, written as an experiment; run with trainer.max_steps = the workload's steps."""

    # bench.workload, bench.out
    config_class = StepCfg

    def build(self):
        self.w = WORKLOADS[self.cfg.bench.workload]
        self.net = self.w.build()
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-3)
        self.clock = Clock(self.w, self.device)

    def train_dataset(self):
        return self.w.dataset()

    def training_step(self, batch):
        self.clock.at_step(self.step)
        return loss_of(self.net, batch)

    def on_fit_end(self):
        write(self.cfg.bench.out, self.clock.result())


def ddplab_command(workload: str, precision: str, compiled: bool, out: str, run_dir: str) -> list[str]:
    w = WORKLOADS[workload]
    return [
        sys.executable,
        "-m",
        "ddplab",
        "run",
        "benchmarks/gpu_contenders.py:DdplabGpu",
        f"bench.workload={workload}",
        f"bench.out={out}",
        f"trainer.max_steps={w.steps}",
        f"trainer.global_batch_size={w.batch}",
        f"trainer.precision={precision}",
        f"trainer.compile={str(compiled).lower()}",
        "trainer.progress=false",
        "log.tensorboard=false",
        "checkpoint.at_end=false",
        "trainer.deterministic=false",
        f"run.dir={run_dir}",
    ]


if __name__ == "__main__":
    contender, workload, precision, compiled, out = sys.argv[1:6]
    device = torch.device(sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda")
    run = {"raw": raw, "fabric": fabric, "accelerate": accelerate}[contender]
    write(out, run(WORKLOADS[workload], precision, compiled == "1", device))
