"""The wide MLP of comm_bound.py trained by Lightning (Trainer, DDPStrategy(ddp_comm_hook=...)) or by
Accelerate (DistributedDataParallelKwargs(comm_hook=...)) with the same gradient compression, started
by torchrun on each node (scripts/two-nodes.sh --torchrun). Rank 0 writes the median step time after
the first 10 steps to OUT. Used by bench_comm_hooks.py.

    python -m torch.distributed.run ... benchmarks/comm_contenders.py lightning|accelerate HOOK STEPS OUT
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm_bound import WideCfg, _data

PER_RANK_BATCH = 32


def network() -> nn.Module:
    torch.manual_seed(0)
    m = WideCfg()
    layers = [nn.Linear(m.inputs, m.width), nn.ReLU()]
    for _ in range(m.depth - 1):
        layers += [nn.Linear(m.width, m.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(m.width, 10))


def run_lightning(hook: str, steps: int) -> list[float]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    times = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()
            self.last = None

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, *_):
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    if hook == "fp16":
        strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook.powerSGD_hook)
    else:
        strategy = DDPStrategy()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = DataLoader(_data(WideCfg().n_train, WideCfg().inputs, 1), batch_size=PER_RANK_BATCH, shuffle=True)
    trainer.fit(Module(), loader)
    return times


def run_accelerate(hook: str, steps: int) -> list[float]:
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    kinds = {
        "none": DDPCommunicationHookType.NO,
        "fp16": DDPCommunicationHookType.FP16,
        "powersgd": DDPCommunicationHookType.POWER_SGD,
    }
    options = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2} if hook == "powersgd" else {}
    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=kinds[hook], comm_state_option=options)]
    )
    net = network()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(_data(WideCfg().n_train, WideCfg().inputs, 1), batch_size=PER_RANK_BATCH, shuffle=True)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    times = []
    last = None
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        accelerator.backward(nn.functional.cross_entropy(net(x), y))
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times


def main() -> None:
    framework, hook, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    times = (run_lightning if framework == "lightning" else run_accelerate)(hook, steps)
    if os.environ.get("RANK") == "0":
        out.write_text(json.dumps({"step_ms": round(1000 * statistics.median(times[10:]), 1)}))


if __name__ == "__main__":
    main()
