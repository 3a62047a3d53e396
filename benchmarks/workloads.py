"""The two training workloads every contender runs: the same model, data, global batch,
optimizer and steps, built from a seed so every process and every framework gets the same ones.

mlp:  a small MLP on random features (overhead-dominated: each step is about a millisecond).
lstm: the BBBP byte-level bidirectional LSTM on the real BBBP training split (compute-dominated).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate


@dataclass
class Workload:
    name: str
    build_model: Callable[[], nn.Module]
    dataset: Dataset
    collate: Callable
    loss: Callable[[nn.Module, object], torch.Tensor]
    make_optimizer: Callable[[object], torch.optim.Optimizer]
    global_batch: int
    steps: int
    warmup: int  # steps before the timed window starts


def mlp() -> Workload:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16384, 64, generator=g)
    y = (x[:, :10].argmax(1) + (x[:, 10] > 0).long()) % 10

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))

    def loss(model, batch):
        xb, yb = batch
        return nn.functional.cross_entropy(model(xb), yb)

    return Workload(
        "mlp",
        build,
        TensorDataset(x, y),
        default_collate,
        loss,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        global_batch=64,
        steps=1500,
        warmup=100,
    )


def lstm() -> Workload:
    from ddplab.experiments import smiles
    from ddplab.experiments.bbbp import SmilesClassifier

    mols = smiles.read_csv(smiles.BUNDLED_CSV)
    train, _, _ = smiles.stratified_splits(mols.labels, 0.1, 0.2, 0)
    data = smiles.SmilesDataset(mols, train, 512)

    def build():
        torch.manual_seed(0)
        return SmilesClassifier(64, 64, 2, 0.0)

    def loss(model, batch):
        logits = model(batch["tokens"], batch["lengths"])
        return nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])

    return Workload(
        "lstm",
        build,
        data,
        smiles.collate,
        loss,
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        global_batch=64,
        steps=24,
        warmup=4,
    )


WORKLOADS = {"mlp": mlp, "lstm": lstm}
