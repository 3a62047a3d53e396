"""A multi-layer bidirectional LSTM over variable-length sequences, equal to running
`nn.LSTM(bidirectional=True)` on packed sequences, but fast on CPU.

Packing exists so padding never reaches a state. On CPU, PyTorch's backward through a packed
LSTM is several times slower than through a padded one (measured here: 8.3 s against 1.2 s for a
128 x 146 batch, 3 layers, hidden 128), because every time-step slice of the packed data gets
its own full-size gradient buffer. This module keeps the packed semantics with padded tensors:
the forward direction reads each sequence left to right (padding comes after the real tokens and
cannot affect them); the backward direction reads each sequence reversed *within its own length*,
so its padding also comes last. Final states are taken at each sequence's true end.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedBiLSTM(nn.Module):
    def __init__(self, input_size: int, hidden: int, num_layers: int, dropout: float):
        super().__init__()
        sizes = [input_size] + [2 * hidden] * (num_layers - 1)
        self.forward_layers = nn.ModuleList(nn.LSTM(s, hidden, batch_first=True) for s in sizes)
        self.backward_layers = nn.ModuleList(nn.LSTM(s, hidden, batch_first=True) for s in sizes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (batch, time, features), padded after each sequence's end; lengths: (batch,).
        Returns every position's output (batch, time, 2*hidden) and the final states
        (batch, 2*hidden): the forward direction's at the last real token, the backward's at the first."""
        flip = _reverse_within_length(lengths, x.shape[1]).unsqueeze(-1)
        for i, (fwd, bwd) in enumerate(zip(self.forward_layers, self.backward_layers, strict=True)):
            if i:
                x = self.dropout(x)
            ahead, _ = fwd(x)
            back, _ = bwd(x.gather(1, flip.expand(-1, -1, x.shape[2])))
            back = back.gather(1, flip.expand(-1, -1, back.shape[2]))
            x = torch.cat([ahead, back], dim=2)
        rows = torch.arange(x.shape[0], device=x.device)
        final = torch.cat([ahead[rows, lengths - 1], back[:, 0]], dim=1)
        return x, final


def _reverse_within_length(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """Index (batch, time) that reverses positions 0..len-1 of each row and leaves padding in place."""
    t = torch.arange(steps, device=lengths.device).unsqueeze(0)
    n = lengths.unsqueeze(1)
    return torch.where(t < n, n - 1 - t, t)
