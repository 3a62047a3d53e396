"""A communication-bound workload for DDP's levers (bench_comm_hooks.py): a wide MLP on synthetic
features. Little compute per sample and many parameters, so a step is mostly the gradient all_reduce
over a slow link. Each rank writes the bytes of optimizer state it holds, for the sharding figures."""

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn
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
        held = {"optimizer": type(self.opt).__name__, "state_bytes": sharding.state_bytes(self.opt)}
        with open(os.path.join(self.run_dir, "results", f"optimizer-rank{self.rt.rank}.json"), "w") as f:
            json.dump(held, f)
