"""A communication-bound workload for DDP's levers (bench_comm_hooks.py): a wide MLP on synthetic
features. Little compute per sample and many parameters, so a step is mostly the gradient all_reduce
over a slow link. Each rank writes the bytes of weights, gradients and optimizer state it holds, for
the sharding figures (bench_comm_hooks.py, bench_fsdp.py)."""

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import TensorDataset

import ddplab
from ddplab.distributed import sharding


@dataclass
class WideCfg:
    width: int = 1024  # units per hidden layer
    depth: int = 3  # hidden layers of width x width
    inputs: int = 256
    n_train: int = 16384
    n_eval: int = 2048
    optimizer: str = "sgd"  # sgd | adam


@dataclass
class Cfg(ddplab.Config):
    model: WideCfg = field(default_factory=WideCfg)


def _data(n: int, inputs: int, seed: int) -> TensorDataset:
    """Features and the classes a fixed random teacher network gives them (the same for every seed)."""
    teacher = torch.randn(inputs, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, inputs, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ teacher).argmax(1))


class WideMLP(ddplab.Experiment):
    config_class = Cfg

    def build(self):
        m = self.cfg.model
        layers = [nn.Linear(m.inputs, m.width), nn.ReLU()]
        for _ in range(m.depth - 1):
            layers += [nn.Linear(m.width, m.width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(m.width, 10))
        if m.optimizer == "adam":
            self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        else:
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)
        # the gradients this rank holds when an optimizer steps (whichever: ddplab may shard it)
        self.grad_bytes = 0
        register_optimizer_step_pre_hook(self._count_gradients)

    def _count_gradients(self, *_):
        held = sum(sharding.local_bytes(p.grad) for p in self.net.parameters() if p.grad is not None)
        self.grad_bytes = max(self.grad_bytes, held)

    def train_dataset(self):
        return _data(self.cfg.model.n_train, self.cfg.model.inputs, 1)

    def eval_dataset(self):
        return _data(self.cfg.model.n_eval, self.cfg.model.inputs, 2)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def evaluation_step(self, batch):
        x, y = batch
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, y, reduction="none"), "correct": logits.argmax(1) == y}

    def evaluation_metrics(self, out):
        return {"loss": out["loss"].mean().item(), "accuracy": out["correct"].float().mean().item()}

    def on_fit_end(self):
        held = {
            "optimizer": type(self.opt).__name__,
            "state_bytes": sharding.state_bytes(self.opt),
            "param_bytes": sum(sharding.local_bytes(p) for p in self.net.parameters()),
            "grad_bytes": self.grad_bytes,
        }
        with open(os.path.join(self.run_dir, "results", f"optimizer-rank{self.rt.rank}.json"), "w") as f:
            json.dump(held, f)
