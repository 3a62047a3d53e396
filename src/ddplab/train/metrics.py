"""Training metrics accumulated on the device, summed over ranks by the loop's heartbeat.

`add()` keeps the detached value (a list append); `take()` hands an interval's values to the
heartbeat (intervals.py), which sums every interval and metric at once (`pack_intervals`) as
weighted sums and weights, so summing over ranks gives true means: Σ value·weight / Σ weight."""

import collections

import torch

from ..distributed import collectives

# values kept per metric before they are summed into a running total
FOLD = 256


class _Series:
    """One metric's values since the last reset: references, summed only when needed."""

    __slots__ = ("total", "values", "weight", "weights")

    def __init__(self):
        # 0-d tensors or Python numbers
        self.values: list = []
        # Python numbers or 0-d tensors
        self.weights: list = []
        # Σ value·weight of the values already folded
        self.total: torch.Tensor | float = 0.0
        self.weight: torch.Tensor | float = 0.0

    @property
    def folded(self):
        """A fold always leaves a tensor total."""
        return isinstance(self.total, torch.Tensor)

    def fold(self, device: torch.device) -> None:
        if not self.values:
            return
        values = _vector(self.values, device)
        if all(isinstance(w, (int, float)) for w in self.weights):
            weight = float(sum(self.weights))
            total = values.sum() if all(w == 1 for w in self.weights) else values @ _vector(self.weights, device)
        else:
            weights = _vector(self.weights, device)
            total = values @ weights
            weight = weights.sum()
        self.total = self.total + total
        self.weight = self.weight + weight
        self.values = []
        self.weights = []


class MetricTracker:
    """Weighted running means of named scalars, reduced across ranks on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        # a name's series, made when first added
        self._series: dict[str, _Series] = collections.defaultdict(_Series)

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
        series = self._series[name]
        series.values.append(value)
        series.weights.append(weight)
        self._keep_bounded(series)

    def add_all(self, name: str, values: list[torch.Tensor]) -> None:
        """One-element tensors on the device that nobody changes later (the detached losses of
        the loop), weight 1 each: kept by reference, many at once."""
        series = self._series[name]
        series.values += [v.reshape(()) if v.dim() else v for v in values]
        series.weights += [1.0] * len(values)
        self._keep_bounded(series)

    def _keep_bounded(self, series: _Series) -> None:
        if len(series.values) >= FOLD:
            # however rarely an interval ends, memory stays bounded
            series.fold(self.device)

    def take(self) -> dict[str, _Series]:
        """The values added since the last take, unsummed (see `pack_intervals`); start afresh."""
        taken = self._series
        self._series = collections.defaultdict(_Series)
        return taken

    def compute(self) -> dict[str, float]:
        """All metrics' means over every rank, in one collective, and start afresh. Every rank must call it."""
        (names,), packed = pack_intervals([self.take()], self.device)
        return means(names, collectives.sum(packed).tolist() if names else [])


def pack_intervals(intervals: list[dict[str, _Series]], device: torch.device) -> tuple[list[list[str]], torch.Tensor]:
    """Each interval's sorted metric names, and one float64 tensor on the device holding, interval after
    interval, [Σ value·weight per name..., Σ weight per name...] of this rank. One index_add_ sums every
    value into its slot; the index is built from a (slot, count) row per metric, never from a Python list
    per value (turning hundreds of numbers into a tensor costs more than the sums)."""
    names = [sorted(series) for series in intervals]
    values = []
    weights = []
    slots = []
    counts = []
    folded = []
    size = 0
    for series, keys in zip(intervals, names, strict=True):
        for i, key in enumerate(keys):
            one = series[key]
            total_at = size + i
            weight_at = size + len(keys) + i
            if one.values:
                values += one.values
                weights += one.weights
                slots.append((total_at, weight_at))
                counts.append(len(one.values))
            if one.folded:
                folded.append((total_at, weight_at, one))
        size += 2 * len(keys)
    packed = torch.zeros(size, dtype=torch.float64, device=device)
    if values:
        at = on_device(slots, torch.int64, device)
        n = on_device(counts, torch.int64, device)
        # output_size: no device sync
        index = at.repeat_interleave(n, dim=0, output_size=len(values))
        value_vector = _vector(values, device)
        if all(type(w) in (int, float) and w == 1 for w in weights):
            # the usual case: plain means
            packed.index_add_(0, index[:, 0], value_vector)
            packed.index_add_(0, at[:, 1], n.double())
        else:
            weight_vector = _vector(weights, device)
            packed.index_add_(0, index[:, 0], value_vector * weight_vector)
            packed.index_add_(0, index[:, 1], weight_vector)
    for total_at, weight_at, one in folded:
        packed[total_at] += one.total
        packed[weight_at] += one.weight
    return names, packed


def means(names: list[str], totals: list[float]) -> dict[str, float]:
    """{name: Σ value·weight / Σ weight} from a packed vector summed over ranks (see `pack_intervals`)."""
    k = len(names)
    return {n: totals[i] / totals[k + i] if totals[k + i] else float("nan") for i, n in enumerate(names)}


def _vector(items: list, device: torch.device) -> torch.Tensor:
    """A float64 vector of 0-d tensors and/or Python numbers: one stack and one copy, however mixed."""
    is_tensor = [isinstance(x, torch.Tensor) for x in items]
    if all(is_tensor):
        return torch.stack(items).double()
    out = on_device([0.0 if t else x for x, t in zip(items, is_tensor, strict=True)], torch.float64, device)
    if any(is_tensor):
        # a mix (the losses, the loop's own numbers): the tensors to their places
        at = on_device([i for i, t in enumerate(is_tensor) if t], torch.int64, device)
        out.index_copy_(0, at, torch.stack([x for x, t in zip(items, is_tensor, strict=True) if t]).double())
    return out


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers to the device without a host sync: on CUDA from pinned memory (pageable memory waits)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
