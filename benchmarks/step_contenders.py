"""One training run of a workload by one contender, timed from inside the workers.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/step_contenders.py CONTENDER WORKLOAD OUT
    python -m torch.distributed.run --nproc-per-node 2 -m ddplab run benchmarks/step_contenders.py:DdplabStep \
        bench.workload=mlp bench.out=OUT

CONTENDER: raw (a hand-written DDP loop), handwritten (gpt only: a GPT script as they are usually
written), fabric, trainer (Lightning), accelerate. Every contender
logs the loss to the host every 10 steps, shows no progress bar and saves nothing while timed.
The clock starts at step `warmup` and stops after the last optimizer step; rank 0 writes
{"step_s": seconds per step} to OUT and its final parameters to OUT.pt.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddplab
from where_time_goes import data_range, step_started
from workloads import WORKLOADS

LOG_EVERY = 10
# rank 0 writes the wall time of its first step here
FIRST_STEP_FILE = os.environ.get("BENCH_FIRST_STEP_FILE")


def mark_first_step(step: int, rank: int) -> None:
    if FIRST_STEP_FILE and step == 0 and rank == 0:
        with open(FIRST_STEP_FILE, "w") as f:
            f.write(repr(time.time()))


def write_result(out: str, step_s: float, model: torch.nn.Module) -> None:
    # rank 0's peak resident memory (the ranks hold the same)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(out, "w") as f:
        json.dump({"step_s": step_s, "rss_mib": rss_mib}, f)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out + ".pt")


def timed_loop(w, loader, model, opt, backward, is_main: bool) -> float:
    """The training loop Fabric and Accelerate users write; returns seconds per timed step."""
    step, t0 = 0, 0.0
    while step < w.steps:
        for batch in loader:
            step_started(step, w)
            if step == w.warmup:
                t0 = time.perf_counter()
            loss = w.loss(model, batch)
            opt.zero_grad(set_to_none=True)
            backward(loss)
            opt.step()
            step += 1
            if step % LOG_EVERY == 0 and is_main:
                loss.item()
            if step == w.steps:
                break
    return (time.perf_counter() - t0) / (w.steps - w.warmup)


# ---- (a) a plain hand-written DDP loop -----------------------------------------------------------
def raw(w, out):
    """What a careful user writes by hand: the same global batch order as ddplab, so the final
    parameters can be compared bit for bit."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, opt = raw_model(w)
    t0 = 0.0
    for step, batch in enumerate(raw_loader(w, rank, world)):
        mark_first_step(step, rank)
        step_started(step, w)
        if step == w.warmup:
            t0 = time.perf_counter()
        raw_step(w, model, opt, batch, step, rank)
        if step + 1 == w.steps:
            break
    elapsed = time.perf_counter() - t0
    if rank == 0:
        write_result(out, elapsed / (w.steps - w.warmup), model.module)
    dist.destroy_process_group()


def raw_model(w):
    model = torch.nn.parallel.DistributedDataParallel(w.build_model())
    return model, w.make_optimizer(model.parameters())


def raw_loader(w, rank: int, world: int) -> DataLoader:
    """This rank's batches, endlessly: ddplab's global order (seed 0) written out by hand."""
    n, per_rank = len(w.dataset), w.global_batch // world
    steps_per_epoch = n // w.global_batch

    def batches():
        for epoch in range(10**6):
            g = torch.Generator()
            # seed 0: 0 * 1_000_003 + epoch, as ddplab's epoch_order
            g.manual_seed(epoch)
            order = torch.randperm(n, generator=g)
            for s in range(steps_per_epoch):
                start = s * w.global_batch + rank * per_rank
                yield order[start : start + per_rank].tolist()

    return DataLoader(w.dataset, batch_sampler=batches(), collate_fn=w.collate)


def raw_step(w, model, opt, batch, step: int, rank: int) -> None:
    """One step of the raw loop (0-based `step`); rank 0 reads its loss every LOG_EVERY steps."""
    loss = w.loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if (step + 1) % LOG_EVERY == 0 and rank == 0:
        loss.item()


# ---- (a') a GPT script as they are usually written -----------------------------------------------
def handwritten(w, out):
    """nanoGPT's train.py, reduced to what touches speed: the token file memory-mapped, one random
    slice per micro-batch and rank, DDP's gradient sync only on a step's last micro-batch
    (`require_backward_grad_sync`), the loss read on the host every LOG_EVERY steps."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, opt = raw_model(w)
    get_batch = script_batches(w, rank, world)
    batch, t0 = get_batch(), 0.0
    for step in range(w.steps):
        mark_first_step(step, rank)
        step_started(step, w)
        if step == w.warmup:
            t0 = time.perf_counter()
        batch = script_step(w, model, opt, get_batch, batch, step, rank)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        write_result(out, elapsed / (w.steps - w.warmup), model.module)
    dist.destroy_process_group()


def script_batches(w, rank: int, world: int, accumulate: int = 1):
    """nanoGPT's get_batch: a fresh memory map of the token file, random window starts, the
    windows stacked (this rank's own random stream, seeded 1337 + rank)."""
    import numpy as np

    from workloads import BLOCK, token_file

    per_micro = w.global_batch // (world * accumulate)
    generator = torch.Generator().manual_seed(1337 + rank)

    def get_batch():
        with data_range():
            data = np.memmap(token_file(), dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - BLOCK, (per_micro,), generator=generator)
            x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix])
        return x, y

    return get_batch


def script_step(w, model, opt, get_batch, batch, step: int, rank: int, accumulate: int = 1):
    """One step of the script (0-based `step`); returns the batch read during it, for the next."""
    for micro in range(accumulate):
        model.require_backward_grad_sync = micro == accumulate - 1
        loss = w.loss(model, batch) / accumulate
        # the next batch is read right after the forward, as nanoGPT does
        batch = get_batch()
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if (step + 1) % LOG_EVERY == 0 and rank == 0:
        loss.item()
    return batch


# ---- (b) ddplab's Experiment ----------------------------------------------------------------------
@dataclass
class BenchCfg:
    workload: str = "mlp"
    out: str = ""


@dataclass
class StepCfg(ddplab.Config):
    bench: BenchCfg = field(default_factory=BenchCfg)


class DdplabStep(ddplab.Experiment):
    config_class = StepCfg

    def build(self):
        self.w = WORKLOADS[self.cfg.bench.workload]()
        self.collate_fn = self.w.collate
        self.net = self.w.build_model()
        self.opt = self.w.make_optimizer(self.net.parameters())
        self.t0 = 0.0

    @property
    def started_at(self) -> int:
        """The step this process started at (after a resume), for the time-to-first-step marker."""
        if not hasattr(self, "_started_at"):
            self._started_at = self.step
        return self._started_at

    def train_dataset(self):
        return self.w.dataset

    def training_step(self, batch):
        mark_first_step(self.step - self.started_at, self.rt.rank)
        step_started(self.step, self.w)
        if self.step == self.w.warmup:
            self.t0 = time.perf_counter()
        return self.w.loss(self.net, batch)

    def on_fit_end(self):
        if self.rt.is_main:
            write_result(
                self.cfg.bench.out, (time.perf_counter() - self.t0) / (self.w.steps - self.w.warmup), self.models["net"]
            )


# ---- (c) Lightning Fabric -------------------------------------------------------------------------
def fabric(w, out):
    from lightning.fabric import Fabric

    f = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp")
    f.launch()
    model = w.build_model()
    model, opt = f.setup(model, w.make_optimizer(model.parameters()))
    loader = f.setup_dataloaders(
        DataLoader(
            w.dataset, batch_size=w.global_batch // f.world_size, shuffle=True, drop_last=True, collate_fn=w.collate
        )
    )
    step_s = timed_loop(w, loader, model, opt, f.backward, f.global_rank == 0)
    if f.global_rank == 0:
        write_result(out, step_s, model.module)


# ---- (d) Lightning Trainer ------------------------------------------------------------------------
def trainer(w, out):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.build_model()

        def training_step(self, batch, batch_idx):
            loss = w.loss(self.net, batch)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return w.make_optimizer(self.net.parameters())

    class Clock(L.Callback):
        def on_train_batch_start(self, tr, module, batch, batch_idx):
            step_started(tr.global_step, w)
            if tr.global_step == w.warmup:
                self.t0 = time.perf_counter()

        def on_train_end(self, tr, module):
            self.step_s = (time.perf_counter() - self.t0) / (w.steps - w.warmup)

    clock, module = Clock(), Module()
    tr = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy="ddp",
        max_steps=w.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=LOG_EVERY,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    world = int(os.environ["WORLD_SIZE"])
    tr.fit(
        module,
        DataLoader(w.dataset, batch_size=w.global_batch // world, shuffle=True, drop_last=True, collate_fn=w.collate),
    )
    if tr.global_rank == 0:
        write_result(out, clock.step_s, module.net)


# ---- (e) Hugging Face Accelerate ------------------------------------------------------------------
def accelerate(w, out):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = w.build_model()
    opt = w.make_optimizer(model.parameters())
    loader = DataLoader(
        w.dataset, batch_size=w.global_batch // acc.num_processes, shuffle=True, drop_last=True, collate_fn=w.collate
    )
    model, opt, loader = acc.prepare(model, opt, loader)
    step_s = timed_loop(w, loader, model, opt, acc.backward, acc.is_main_process)
    if acc.is_main_process:
        write_result(out, step_s, acc.unwrap_model(model))
    acc.end_training()


if __name__ == "__main__":
    contender, workload, out = sys.argv[1:4]
    contenders = {
        "raw": raw,
        "handwritten": handwritten,
        "fabric": fabric,
        "trainer": trainer,
        "accelerate": accelerate,
    }
    contenders[contender](WORKLOADS[workload](), out)
    sys.stdout.flush()
    # skip the gloo teardown crash at interpreter exit (see docs/decisions.md)
    os._exit(0)
