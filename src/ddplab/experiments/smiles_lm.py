"""A byte-level language model of molecules, trained from webdataset shards on disk.

The bundled BBBP SMILES strings are written once into tar shards (`ddplab.write_shards`), as a
corpus too big for memory would be; training then reads them by position (`ddplab.ShardedDataset`),
so it has ddplab's global order: the same batches on 1, 2 or 4 ranks and a resume mid-epoch that
jumps to its step. `data.read=stream` reads the same shards as a webdataset pipeline instead (an
IterableDataset, in order), to show the other path. The eval set is shards of its own, evaluated
exactly: loss per byte and perplexity over every held-out molecule once.

    ddplab run smiles_lm -n 2
    ddplab run smiles_lm -n 2 data.read=stream
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import nn

import ddplab
from ddplab.config import TrainerConfig, setting
from ddplab.config_rules import Range

from . import smiles


@dataclass
class DataConfig:
    shards: str = setting("", "the folder of the shards (train/ and eval/); empty: <run.dir>/shards/smiles_lm")
    read: Literal["shards", "stream"] = setting(
        "shards", "shards: by position, ddplab's global order | stream: a webdataset pipeline, in order"
    )
    samples_per_shard: int = setting(256, "when the shards are written", rule=Range(1))
    eval_fraction: float = setting(0.1, "of the molecules, kept for evaluation", rule=Range(0, 1, below=True))
    max_len: int = setting(160, "bytes per SMILES (longer ones are cut)", rule=Range(2))


@dataclass
class ModelConfig:
    embedding_dim: int = setting(64, "width of each byte's embedding", rule=Range(1))
    hidden: int = setting(128, "the GRU's state size", rule=Range(1))


@dataclass
class SmilesLMConfig(ddplab.Config):
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_epochs=3, global_batch_size=64))
    lr: float = setting(3e-3, "AdamW's learning rate", rule=Range(0, open=True))


class ByteLM(nn.Module):
    """Embedding, a GRU and a linear head: each position's logits for the next byte."""

    def __init__(self, embedding_dim: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(smiles.VOCAB_SIZE, embedding_dim, padding_idx=smiles.PAD_ID)
        self.rnn = nn.GRU(embedding_dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, smiles.VOCAB_SIZE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


class SmilesLM(ddplab.Experiment):
    config_class = SmilesLMConfig
    name = "smiles_lm"

    def build(self):
        self.net = ByteLM(self.cfg.model.embedding_dim, self.cfg.model.hidden)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=self.cfg.lr)

    def train_dataset(self):
        return self._read(self._write_shards("train"))

    def eval_dataset(self):
        return self._read(self._write_shards("eval"))

    collate_fn = staticmethod(partial(nn.utils.rnn.pad_sequence, batch_first=True, padding_value=smiles.PAD_ID))

    def training_step(self, batch):
        nll, count = self._next_byte_nll(batch)
        return nll.sum() / count.sum()

    def count_tokens(self, batch):
        # the bytes predicted: what tokens/s counts
        return (batch[:, 1:] != smiles.PAD_ID).sum()

    def evaluation_step(self, batch):
        nll, count = self._next_byte_nll(batch)
        # per molecule
        return {"nll": nll, "bytes": count}

    def evaluation_metrics(self, out):
        loss = (out["nll"].double().sum() / out["bytes"].sum()).item()
        return {"loss": loss, "perplexity": math.exp(loss), "molecules": len(out["nll"])}

    def _next_byte_nll(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each molecule's summed negative log-likelihood of its bytes after the first, and their number."""
        logits = self.net(ids[:, :-1])
        target = ids[:, 1:]
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=smiles.PAD_ID, reduction="none")
        return nll.sum(1), (target != smiles.PAD_ID).sum(1)

    def _write_shards(self, split: str) -> str:
        """The split's shards, written by rank 0 on first use; every rank waits for them (a broadcast)."""
        folder = os.path.join(self.cfg.data.shards or os.path.join(self.cfg.run.dir, "shards", "smiles_lm"), split)
        index = os.path.join(folder, "index.json")
        if self.rt.is_main and not os.path.isfile(index):
            molecules = smiles.read_csv(smiles.BUNDLED_CSV).smiles
            cut = int(len(molecules) * (1 - self.cfg.data.eval_fraction))
            part = molecules[:cut] if split == "train" else molecules[cut:]
            ddplab.write_shards(({"txt": s} for s in part), folder, self.cfg.data.samples_per_shard)
        return ddplab.collectives.broadcast_object(index)

    def _read(self, index: str):
        to_ids = partial(_to_ids, max_len=self.cfg.data.max_len)
        if self.cfg.data.read == "shards":
            return ddplab.ShardedDataset(index, transform=to_ids)
        import webdataset as wds

        urls = [os.path.join(os.path.dirname(index), s["url"]) for s in ddplab.ShardedDataset(index).shards]
        return wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None).decode().map(to_ids)


def _to_ids(sample: dict, max_len: int) -> torch.Tensor:
    return torch.tensor(smiles.encode(sample["txt"], max_len), dtype=torch.long)
