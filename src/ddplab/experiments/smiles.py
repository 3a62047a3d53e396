"""SMILES data for the BBBP example: reading the CSV, a byte-level tokenizer, stratified splits.

Bytes rather than a chemistry vocabulary: every SMILES string encodes without a fitted vocabulary,
id 0 is left for padding, and ids are `byte + 1` (257 in all).
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DdplabError

PAD_ID = 0
VOCAB_SIZE = 257
BUNDLED_CSV = os.path.join(os.path.dirname(__file__), "data", "bbbp", "BBBP.csv")
REQUIRED_COLUMNS = ("smiles", "p_np")


def encode(smiles: str, max_len: int) -> list[int]:
    return [b + 1 for b in smiles.encode("utf-8")[:max_len]]


def decode(ids: list[int]) -> str:
    return bytes(i - 1 for i in ids if i != PAD_ID).decode("utf-8", errors="replace")


@dataclass
class Molecules:
    smiles: list[str]
    labels: list[int]
    skipped: list[int]  # CSV line numbers of rows without a SMILES string


def read_csv(path: str) -> Molecules:
    """Read a BBBP-style CSV (columns smiles and p_np). Rows with an empty SMILES are skipped and
    reported; anything else malformed is an error naming the line."""
    if not os.path.isfile(path):
        raise DdplabError(
            f"data file {path} does not exist", "pass data.path=FILE.csv, or leave it empty for the bundled BBBP data"
        )
    smiles = []
    labels = []
    skipped = []
    reader = _table(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise DdplabError(
            f"{path} has no column(s) {missing} (found {reader.fieldnames})",
            "give a CSV with a 'smiles' and a 'p_np' column",
        )
    for line, row in enumerate(reader, start=2):
        text = (row.get("smiles") or "").strip()
        if not text:
            skipped.append(line)
            continue
        label = (row.get("p_np") or "").strip()
        if label not in ("0", "1"):
            raise DdplabError(f"{path} line {line}: p_np is '{label}', expected 0 or 1", "fix or remove that row")
        smiles.append(text)
        labels.append(int(label))
    if len(set(labels)) < 2:
        raise DdplabError(f"{path} has {len(labels)} usable rows and not both classes", "use a CSV with 0 and 1 labels")
    return Molecules(smiles, labels, skipped)


def read_unlabelled(path: str) -> Molecules:
    """The smiles column of a CSV, every row kept, for prediction: an empty SMILES is an error naming
    its line (skipping it would shift every prediction after it by one row)."""
    if not os.path.isfile(path):
        raise DdplabError(f"input file {path} does not exist", "pass --input FILE.csv with a smiles column")
    reader = _table(path)
    if "smiles" not in (reader.fieldnames or []):
        raise DdplabError(f"{path} has no 'smiles' column (found {reader.fieldnames})", "name the column smiles")
    texts = [(line, (row.get("smiles") or "").strip()) for line, row in enumerate(reader, start=2)]
    empty = [line for line, text in texts if not text]
    if empty:
        raise DdplabError(
            f"{path} line {empty[0]} has an empty SMILES ({len(empty)} such rows)",
            "fill or remove those rows: each input row gets one prediction",
        )
    return Molecules([t for _, t in texts], [0] * len(texts), [])


def _table(path: str) -> csv.DictReader:
    """The rows of a UTF-8 CSV file (a byte-order mark, as spreadsheet programs write, is skipped)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DdplabError(
            f"{path} is not UTF-8 text (byte {e.start} cannot be read: {e.reason})",
            "save the CSV as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN.csv > OUT.csv)",
        ) from None
    return csv.DictReader(io.StringIO(text, newline=""))


def stratified_splits(labels: list[int], heldout: float, dev: float, seed: int) -> tuple[np.ndarray, ...]:
    """train / dev / heldout indices: `heldout` of everything, then `dev` of the rest, stratified."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    y = np.asarray(labels)
    visible, held = train_test_split(idx, test_size=heldout, stratify=y, shuffle=True, random_state=seed)
    train, dev_idx = train_test_split(visible, test_size=dev, stratify=y[visible], shuffle=True, random_state=seed)
    return train, dev_idx, held


class SmilesDataset(Dataset):
    def __init__(self, mols: Molecules, indices, max_len: int):
        # indices None: every molecule, in order
        indices = range(len(mols.smiles)) if indices is None else indices
        self.items = [(torch.tensor(encode(mols.smiles[i], max_len)), float(mols.labels[i])) for i in indices]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(samples) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch; lengths stay on the CPU for packing."""
    tokens = torch.nn.utils.rnn.pad_sequence([s[0] for s in samples], batch_first=True, padding_value=PAD_ID)
    return {
        "tokens": tokens,
        "lengths": torch.tensor([len(s[0]) for s in samples]),
        "label": torch.tensor([s[1] for s in samples]),
    }
