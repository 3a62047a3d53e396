"""The training workloads every contender runs: the same model, data, global batch,
optimizer and steps, built from a seed so every process and every framework gets the same ones.

mlp:  a small MLP on random features (overhead-dominated: each step is about a millisecond).
lstm: the BBBP byte-level bidirectional LSTM on the real BBBP training split (compute-dominated).
gpt:  a small decoder-only transformer with tied input and output embeddings, on windows of a token
      file this module writes (the workload users bring most; no download).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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


# the token file every GPT contender reads: 2M tokens of a 512-token vocabulary from a seeded Markov chain
TOKENS = os.path.join(tempfile.gettempdir(), "ddplab-bench-gpt-tokens.u16")
VOCAB, BLOCK = 512, 64


def token_file() -> str:
    """Written once per machine (atomically: every process of every contender may ask at once)."""
    if not os.path.exists(TOKENS):
        rng = np.random.default_rng(0)
        # each token's successor is one of 8 it prefers: something to learn
        follow = rng.integers(0, VOCAB, size=(VOCAB, 8))
        tokens = np.empty(2_000_000, dtype=np.uint16)
        tokens[0] = 0
        picks = rng.integers(0, 8, size=len(tokens))
        for i in range(1, len(tokens)):
            tokens[i] = follow[tokens[i - 1], picks[i]]
        partial = f"{TOKENS}.{os.getpid()}"
        tokens.tofile(partial)
        os.replace(partial, TOKENS)
    return TOKENS


class Windows(torch.utils.data.Dataset):
    """The obvious Dataset over a token file: window i is tokens [i*BLOCK, (i+1)*BLOCK] (inputs and
    next-token targets), read from the memory-mapped file."""

    def __init__(self, path: str, block: int = BLOCK):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i: int):
        chunk = torch.from_numpy(self.tokens[i * self.block : (i + 1) * self.block + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT's shape, small: token and position embeddings, blocks, a head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, block: int = BLOCK, width: int = 128, depth: int = 4, heads: int = 4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        # nanoGPT's initialisation: small weights, so the tied head starts near uniform
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model, batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


def gpt() -> Workload:
    def build():
        torch.manual_seed(0)
        return GPT()

    return Workload(
        "gpt",
        build,
        Windows(token_file()),
        default_collate,
        gpt_loss,
        lambda p: torch.optim.AdamW(p, lr=3e-4),
        global_batch=32,
        steps=120,
        warmup=20,
    )


WORKLOADS = {"mlp": mlp, "lstm": lstm, "gpt": gpt}
