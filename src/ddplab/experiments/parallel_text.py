"""Parallel text for the translation example: a TSV reader, a character- or word-level vocabulary,
the dataset and its collate function.

Ids 0..3 are PAD, BOS, EOS and UNK in every vocabulary. A vocabulary is built from the training
pairs only and sorted, so every rank builds the same one from the same data without talking.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.utils.data import Dataset

from ..errors import DdplabError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def read_tsv(path: str) -> list[tuple[str, str]]:
    """(source, target) pairs from a two-column, tab-separated file; blank lines are skipped."""
    if not os.path.isfile(path):
        raise DdplabError(
            f"data file {path} does not exist",
            "pass data.path=FILE.tsv (source<TAB>target per line), or leave it empty for the generated corpus",
        )
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.rstrip("\n").rstrip("\r")
            if not line.strip():
                continue
            cols = line.split("\t")
            if len(cols) != 2 or not cols[0].strip() or not cols[1].strip():
                raise DdplabError(
                    f"{path} line {line_no}: expected 'source<TAB>target', found {len(cols)} column(s)",
                    "fix or remove that line",
                )
            pairs.append((cols[0].strip(), cols[1].strip()))
    if not pairs:
        raise DdplabError(f"{path} has no sentence pairs", "give a TSV with one 'source<TAB>target' pair per line")
    return pairs


class Vocab:
    """Tokens <-> ids at character or word level."""

    def __init__(self, tokens: list[str], level: str):
        if level not in ("char", "word"):
            raise DdplabError(f"unknown data.tokenize '{level}'", "use data.tokenize=char or data.tokenize=word")
        self.level = level
        self.itos = SPECIALS + tokens
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(cls, texts: list[str], level: str, min_count: int = 1) -> Vocab:
        counts = Counter(tok for text in texts for tok in split(text, level))
        return cls(sorted(t for t, c in counts.items() if c >= min_count and t not in SPECIALS), level)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, max_len: int) -> list[int]:
        """BOS, the tokens (cut to fit), EOS."""
        ids = [self.stoi.get(tok, UNK_ID) for tok in split(text, self.level)][: max_len - 2]
        return [BOS_ID, *ids, EOS_ID]

    def decode(self, ids: list[int]) -> str:
        """Tokens up to the first EOS, without specials, joined back into text."""
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i >= UNK_ID:
                out.append(self.itos[i] if i < len(self.itos) else SPECIALS[UNK_ID])
        return ("" if self.level == "char" else " ").join(out)


def split(text: str, level: str) -> list[str]:
    return list(text) if level == "char" else text.split()


class ParallelDataset(Dataset):
    def __init__(self, pairs: list[tuple[str, str]], src_vocab: Vocab, tgt_vocab: Vocab, max_src: int, max_tgt: int):
        self.pairs = pairs
        self.items = [
            (torch.tensor(src_vocab.encode(s, max_src)), torch.tensor(tgt_vocab.encode(t, max_tgt))) for s, t in pairs
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(samples) -> dict[str, torch.Tensor]:
    """Pad sources and targets to the longest of the batch."""
    pad = torch.nn.utils.rnn.pad_sequence
    return {
        "src": pad([s for s, _ in samples], batch_first=True, padding_value=PAD_ID),
        "tgt": pad([t for _, t in samples], batch_first=True, padding_value=PAD_ID),
    }
