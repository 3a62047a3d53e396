"""BBBP: predict blood-brain barrier penetration from a molecule's SMILES string.

A byte-level bidirectional LSTM classifier. Dev ROC AUC is measured every epoch with exact
distributed evaluation; the best epoch is kept as a checkpoint; at the end the best model's
heldout ROC AUC is printed, logged, and recorded with the hyperparameters in TensorBoard.

    ddplab run bbbp -n 2
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

import ddplab
from ddplab.config import CheckpointConfig, TrainerConfig, setting
from ddplab.config_rules import Range

from . import smiles
from .lstm import PackedBiLSTM


@dataclass
class DataConfig:
    path: str = setting("", "a CSV with smiles and p_np columns; empty: the bundled BBBP data")
    heldout_fraction: float = setting(
        0.1, "of the molecules, kept apart for the final score", rule=Range(0, 1, below=True)
    )
    dev_fraction: float = setting(0.2, "of what remains after the heldout split", rule=Range(0, 1, below=True))
    split_seed: int = setting(0, "the stratified heldout/dev/train split", rule=Range(0))
    max_len: int = setting(512, "bytes per SMILES (longer ones are cut)", rule=Range(1))


@dataclass
class ModelConfig:
    embedding_dim: int = setting(128, "width of each byte's embedding", rule=Range(1))
    hidden: int = setting(128, "LSTM state size per direction, and the head's width", rule=Range(1))
    num_layers: int = setting(3, "stacked bidirectional LSTM layers", rule=Range(1))
    dropout: float = setting(0.2, "between LSTM layers and in the head", rule=Range(0, 1, below=True))


@dataclass
class OptimConfig:
    lr: float = setting(1e-3, "AdamW learning rate", rule=Range(0, open=True))
    weight_decay: float = setting(1e-4, "AdamW weight decay", rule=Range(0))


@dataclass
class BBBPConfig(ddplab.Config):
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(global_batch_size=256, max_epochs=20, log_every=5)
    )
    checkpoint: CheckpointConfig = field(
        default_factory=lambda: CheckpointConfig(
            every_epoch=True, keep_last=1, keep_best=1, monitor="roc_auc", mode="max"
        )
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


class SmilesClassifier(nn.Module):
    """Embedding -> bidirectional LSTM (packed-sequence semantics) -> MLP -> one logit.

    The head reads both directions' final states: the forward one at the last real token and the
    backward one at the first, concatenated (not one direction twice)."""

    def __init__(self, embedding_dim: int = 128, hidden: int = 128, num_layers: int = 3, dropout: float = 0.2):
        super().__init__()
        self.embedding = nn.Embedding(smiles.VOCAB_SIZE, embedding_dim, padding_idx=smiles.PAD_ID)
        self.lstm = PackedBiLSTM(embedding_dim, hidden, num_layers, dropout)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        _, final = self.lstm(self.embedding(tokens), lengths)
        return self.head(final).squeeze(1)


class BBBP(ddplab.Experiment):
    config_class = BBBPConfig
    name = "bbbp"
    collate_fn = staticmethod(smiles.collate)

    def build(self):
        m = self.cfg.model
        o = self.cfg.optim
        self.net = SmilesClassifier(m.embedding_dim, m.hidden, m.num_layers, m.dropout)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=o.lr, weight_decay=o.weight_decay)
        self._load_data()

    def _load_data(self):
        d = self.cfg.data
        path = d.path or smiles.BUNDLED_CSV
        mols = smiles.read_csv(path)
        if mols.skipped and self.rt.is_main:
            print(
                f"bbbp: skipped {len(mols.skipped)} row(s) of {path} with an empty SMILES (lines "
                f"{', '.join(map(str, mols.skipped[:10]))}{' ...' if len(mols.skipped) > 10 else ''})",
                flush=True,
            )
        train, dev, heldout = smiles.stratified_splits(mols.labels, d.heldout_fraction, d.dev_fraction, d.split_seed)
        self.splits = {
            name: smiles.SmilesDataset(mols, idx, d.max_len)
            for name, idx in (("train", train), ("dev", dev), ("heldout", heldout))
        }

    def train_dataset(self):
        return self.splits["train"]

    def eval_dataset(self):
        return self.splits["dev"]

    def training_step(self, batch):
        logits = self.net(batch["tokens"], batch["lengths"])
        return nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])

    def evaluation_step(self, batch):
        logits = self.net(batch["tokens"], batch["lengths"]).float()
        return {
            "loss": nn.functional.binary_cross_entropy_with_logits(logits, batch["label"], reduction="none"),
            "prob": torch.sigmoid(logits),
            "target": batch["label"],
        }

    def evaluation_metrics(self, out):
        from sklearn.metrics import roc_auc_score

        target = out["target"].cpu().numpy()
        prob = out["prob"].double().cpu().numpy()
        return {
            "loss": out["loss"].double().mean().item(),
            "accuracy": float(((prob > 0.5) == target).mean()),
            "roc_auc": float(roc_auc_score(target, prob)),
        }

    def predict_dataset(self, source):
        """`ddplab predict RUN --input molecules.csv`: a CSV with a smiles column (p_np is not needed)."""
        if not source.endswith(".csv"):
            # train, or the eval set: `--input eval`
            return super().predict_dataset(source)
        return smiles.SmilesDataset(smiles.read_unlabelled(source), None, self.cfg.data.max_len)

    def predict_step(self, batch):
        prob = torch.sigmoid(self.net(batch["tokens"], batch["lengths"]).float())
        return {"p_np": (prob > 0.5).long(), "probability": prob}

    def on_fit_end(self):
        """Score the best epoch's model on the heldout set; it is also the one exported to final/."""
        best = self.load_best_checkpoint()
        heldout = self.compute_evaluation(self.splits["heldout"])
        self.run_log.log(self.step, heldout, prefix="heldout/")
        m = self.cfg.model
        o = self.cfg.optim
        hparams = {
            "embedding_dim": m.embedding_dim,
            "hidden": m.hidden,
            "num_layers": m.num_layers,
            "dropout": m.dropout,
            "lr": o.lr,
            "weight_decay": o.weight_decay,
            "global_batch_size": self.plan.global_batch,
            "world_size": self.rt.world_size,
        }
        self.run_log.hparams(hparams, {"roc_auc": heldout["roc_auc"]})
        source = f"best dev epoch ({os.path.basename(best)})" if best else "last step"
        self.print(f"bbbp: heldout ROC AUC {heldout['roc_auc']:.4f} ({source}); run dir {self.run_dir}")
