"""Training metrics accumulated on the device and synchronised once per log interval.

`add()` only does tensor arithmetic on the device: no `.item()`, no host sync, no collective.
`compute()` packs every metric's weighted sum and weight into one tensor, does one all_reduce,
and only then copies to the host. Means are true weighted means over all ranks:
Σ value·weight / Σ weight.
"""

from __future__ import annotations

import torch

from . import collectives


class MetricTracker:
    """Weighted running means of named scalars, reduced across ranks on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        value = torch.as_tensor(value, device=self.device).detach().double()
        if value.dim():
            value = value.mean()
        if isinstance(weight, torch.Tensor):  # a Python number stays a scalar: no host-to-device copy per step
            weight = weight.detach().to(self.device, torch.float64)
        if name not in self._sums:
            self._sums[name] = torch.zeros((), dtype=torch.float64, device=self.device)
            self._weights[name] = torch.zeros((), dtype=torch.float64, device=self.device)
        self._sums[name] += value * weight
        self._weights[name] += weight

    def compute(self, reset: bool = True) -> dict[str, float]:
        """All metrics' means over every rank, in one collective. Every rank must call it."""
        names = sorted(self._sums)
        if not names:
            return {}
        packed = torch.stack([self._sums[n] for n in names] + [self._weights[n] for n in names])
        total = collectives.sum(packed).tolist()
        k = len(names)
        out = {n: total[i] / total[k + i] if total[k + i] else float("nan") for i, n in enumerate(names)}
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        self._sums.clear()
        self._weights.clear()
