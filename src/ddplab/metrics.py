"""Training metrics accumulated on the device and synchronised once per log interval.

`add()` does no arithmetic on the device: it keeps the (detached) value, so a step pays little
more than a list append; a handful of tiny tensor ops per metric per step cost a few percent of
a millisecond-long step. The values are summed in one vectorised op per metric when the interval
ends (or every `FOLD` values, so memory stays bounded when logging is rare). `pack()` puts every
metric's weighted sum and weight into one tensor, so one all_reduce (the training loop's periodic
one, see heartbeat.py) gives true weighted means over all ranks: Σ value·weight / Σ weight.
"""

from __future__ import annotations

import torch

from . import collectives

FOLD = 256  # values kept per metric before they are summed into a running total


class _Series:
    """One metric's values since the last reset: references, summed only when needed."""

    __slots__ = ("values", "weights", "total", "weight")

    def __init__(self):
        self.values: list = []  # 0-d tensors or Python numbers
        self.weights: list = []  # Python numbers or 0-d tensors
        self.total: torch.Tensor | float = 0.0  # Σ value·weight of the values already folded
        self.weight: torch.Tensor | float = 0.0

    def fold(self, device: torch.device) -> None:
        if not self.values:
            return
        values = _vector(self.values, device)
        if all(isinstance(w, (int, float)) for w in self.weights):
            weight = float(sum(self.weights))
            total = values.sum() if all(w == 1 for w in self.weights) else values @ _vector(self.weights, device)
        else:
            weights = _vector(self.weights, device)
            total, weight = values @ weights, weights.sum()
        self.total, self.weight = self.total + total, self.weight + weight
        self.values.clear()
        self.weights.clear()


class MetricTracker:
    """Weighted running means of named scalars, reduced across ranks on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self._series: dict[str, _Series] = {}

    def add(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        if isinstance(value, torch.Tensor):
            # An autograd output (the loss) is never changed in place: a reference is enough. Any
            # other tensor may be a buffer the caller updates later, so keep a copy of it.
            value = value.detach() if value.grad_fn is not None else value.detach().clone()
            if value.dim():
                value = value.double().mean()
            if value.device != self.device:
                value = value.to(self.device)
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().to(self.device)
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = _Series()
        series.values.append(value)
        series.weights.append(weight)
        if len(series.values) >= FOLD:
            series.fold(self.device)

    def pack(self) -> tuple[list[str], torch.Tensor]:
        """(names, [Σ value·weight per name..., Σ weight per name...]) of this rank, as one float64
        tensor on the device, and start afresh. Summing it over ranks gives the true means."""
        names = sorted(self._series)
        for name in names:
            self._series[name].fold(self.device)
        parts = [self._series[n].total for n in names] + [self._series[n].weight for n in names]
        packed = torch.stack([torch.as_tensor(p, dtype=torch.float64, device=self.device) for p in parts]) if names \
            else torch.zeros(0, dtype=torch.float64, device=self.device)
        self.reset()
        return names, packed

    def compute(self) -> dict[str, float]:
        """All metrics' means over every rank, in one collective, and start afresh. Every rank
        must call it."""
        names, packed = self.pack()
        return means(names, collectives.sum(packed).tolist() if names else [])

    def reset(self) -> None:
        self._series.clear()


def means(names: list[str], totals: list[float]) -> dict[str, float]:
    """{name: Σ value·weight / Σ weight} from a packed vector summed over ranks (see `pack`)."""
    k = len(names)
    return {n: totals[i] / totals[k + i] if totals[k + i] else float("nan") for i, n in enumerate(names)}


def _vector(items: list, device: torch.device) -> torch.Tensor:
    """A float64 vector of 0-d tensors and/or Python numbers, in one op when they are all alike."""
    if all(isinstance(x, torch.Tensor) for x in items):
        return torch.stack(items).double()
    if not any(isinstance(x, torch.Tensor) for x in items):
        return torch.tensor(items, dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in items])
