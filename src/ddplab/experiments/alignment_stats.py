"""alignment_stats: how aligned are neurons with their inputs' variance, and does it matter?

Several replicate networks (`model.replicates`) train together, each with its own optimizer.
Every `analysis.measure_every` steps each rank measures every neuron's alignment on its own batch;
the measurements of all layers and replicates travel in one all_gather and are kept as per-rank
replicates (never averaged). After training, on the test set and exactly over all ranks: targeted
dropout, eigenfeatures, eigenfeature dropout. Arrays and PNG plots go to the run's results/.

    ddplab run alignment_stats -n 2
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import ddplab
from ddplab import collectives
from ddplab.config import TrainerConfig, setting
from ddplab.config_rules import Range
from ddplab.train.data import eval_shard

from . import analysis
from .alignment import AlignmentCNN, AlignmentMLP, alignment, covariance
from .images import load_images


@dataclass
class DataConfig:
    path: str = setting("", "empty: scikit-learn's 8x8 digits; else MNIST as .npz or a folder of IDX files")
    split_seed: int = setting(0, "the train/test split", rule=Range(0))


@dataclass
class ModelConfig:
    kind: Literal["mlp", "cnn"] = setting("mlp", "the replicates' network")
    hidden: list[int] = setting(help="hidden layer widths", default_factory=lambda: [100, 100, 50])
    replicates: int = setting(5, "independently initialised networks trained side by side on each rank", rule=Range(1))
    lr: float = setting(1e-3, "learning rate of each replicate's optimizer", rule=Range(0, open=True))


@dataclass
class AnalysisConfig:
    measure_every: int = setting(10, "optimizer steps between alignment measurements", rule=Range(1))
    fractions: list[float] = setting(
        help="neurons dropped", default_factory=lambda: [round(0.1 * i, 1) for i in range(1, 10)]
    )
    plots: bool = setting(True, "write PNG plots to the run's results/")


@dataclass
class AlignmentStatsConfig(ddplab.Config):
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(global_batch_size=128, max_epochs=10, log_every=10)
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)


class Replicates(nn.Module):
    """The replicate networks as one module, so DDP synchronises all of them in one pass."""

    def __init__(self, nets: list[nn.Module]):
        super().__init__()
        self.nets = nn.ModuleList(nets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (replicates, batch, classes)
        return torch.stack([net(x) for net in self.nets])


class AlignmentStats(ddplab.Experiment):
    config_class = AlignmentStatsConfig
    name = "alignment_stats"

    def build(self):
        d = self.cfg.data
        m = self.cfg.model
        self.train_set, self.test_set, side, classes = load_images(d.path, d.split_seed)
        make = {
            "mlp": lambda: AlignmentMLP(side * side, classes, tuple(m.hidden)),
            "cnn": lambda: AlignmentCNN(side, classes),
        }
        self.nets = Replicates([make[m.kind]() for _ in range(m.replicates)])
        self.opts = [torch.optim.Adam(net.parameters(), lr=m.lr) for net in self.nets.nets]
        self.initial = [[w.detach().clone() for w in net.alignment_weights()] for net in self.nets.nets]
        self.history = {"steps": [], "alignment": [], "delta_norm": [], "eval": []}

    def train_dataset(self):
        return self.train_set

    def eval_dataset(self):
        return self.test_set

    @property
    def replicate_nets(self) -> list[nn.Module]:
        return list(self.models["nets"].nets)

    def training_step(self, batch):
        x, y = batch
        if self.step % self.cfg.analysis.measure_every == 0 and self.history["steps"][-1:] != [self.step]:
            self._measure(x)
        logits = self.nets(x)
        losses = torch.stack([F.cross_entropy(out, y) for out in logits])
        accuracy = (logits.argmax(2) == y).float().mean()
        return {"loss": losses.sum(), "loss_per_net": losses.detach().mean(), "acc": accuracy}

    @torch.no_grad()
    def _measure(self, x: torch.Tensor) -> None:
        """Alignment of every neuron on this rank's batch: [(replicates, neurons) per layer],
        gathered as [(world, replicates, neurons) per layer] in one collective."""
        per_layer: list[list[torch.Tensor]] = []
        for net in self.replicate_nets:
            _, inputs = net(x, capture=True)
            for layer, (w, inp) in enumerate(zip(net.alignment_weights(), inputs, strict=False)):
                if len(per_layer) <= layer:
                    per_layer.append([])
                per_layer[layer].append(alignment(w, covariance(inp)).float())
        gathered = collectives.gather_nested([torch.stack(v) for v in per_layer])
        self.history["alignment"].append([g.cpu().numpy() for g in gathered])
        self.history["delta_norm"].append(self._delta_norms())
        self.history["steps"].append(self.step)

    def _delta_norms(self) -> list[np.ndarray]:
        """Per layer (replicates, neurons): the norm of each neuron's weight change since the
        start. Identical on every rank (DDP keeps the weights equal), so nothing is gathered."""
        norms = []
        for layer in range(len(self.initial[0])):
            rows = [
                (net.alignment_weights()[layer] - self.initial[r][layer].to(self.device)).norm(dim=1)
                for r, net in enumerate(self.replicate_nets)
            ]
            norms.append(torch.stack(rows).cpu().numpy())
        return norms

    def evaluation_step(self, batch):
        x, y = batch
        # (replicates, batch, classes)
        logits = self.nets(x)
        loss = torch.stack([F.cross_entropy(out, y, reduction="none") for out in logits], dim=1)
        # (batch, replicates)
        return {"loss": loss, "acc": (logits.argmax(2) == y).float().T}

    def on_evaluation_end(self, metrics):
        self.history["eval"].append((self.step, metrics["loss"], metrics["acc"]))

    def on_fit_end(self):
        nets = self.replicate_nets
        for net in nets:
            net.eval()
        shard = eval_shard(len(self.test_set), self.rt.rank, self.rt.world_size)
        batches = [
            tuple(t.to(self.device) for t in self.test_set[shard.start + i : min(shard.stop, shard.start + i + 1000)])
            for i in range(0, len(shard), 1000)
        ]
        fractions = list(self.cfg.analysis.fractions)
        moments = analysis.layer_moments(nets, batches)
        dropout, scopes = analysis.targeted_dropout(nets, batches, moments, fractions, self.cfg.seed)
        eigen = analysis.eigenfeatures(moments)
        eig_drop, eig_layers = analysis.eigen_dropout(nets, batches, moments, eigen, fractions)
        if self.rt.is_main:
            from .alignment_plots import save_plots, save_results

            results = save_results(
                os.path.join(self.run_dir, "results"),
                self.history,
                dropout,
                scopes,
                eigen,
                eig_drop,
                eig_layers,
                fractions,
                self._final_deltas(),
                self.rt.world_size,
            )
            if self.cfg.analysis.plots:
                save_plots(os.path.join(self.run_dir, "results"), results)
        best = dropout[:, 0, 0, :, 1].mean().item()
        self.print(
            f"alignment_stats: {len(nets)} replicates; test accuracy with 10% of neurons removed "
            f"(highest-aligned, all layers): {best:.3f}; results in {self.run_dir}/results"
        )

    def _final_deltas(self) -> list[np.ndarray]:
        return [
            torch.stack(
                [
                    (net.alignment_weights()[layer].detach().cpu() - self.initial[r][layer])
                    for r, net in enumerate(self.replicate_nets)
                ]
            ).numpy()
            for layer in range(len(self.initial[0]))
        ]

    def evaluation_metrics(self, out):
        return {"loss": out["loss"].double().mean().item(), "acc": out["acc"].double().mean().item()}
