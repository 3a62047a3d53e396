"""Aggregation across ranks that means the same thing at any world size.

Every function works in a world of one and returns a new tensor; all ranks must call the same functions in
the same order with the same dtypes. `gather_variable` returns a list indexed by rank; `gather_nested` gives
every leaf a new leading dimension of size `world_size`."""

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "broadcast_object",
    "gather_concat",
    "gather_nested",
    "gather_object",
    "gather_variable",
    "max",
    "mean",
    "min",
    "same_on_every_rank",
    "sum",
    "weighted_mean",
    "world_size",
]

_builtin_sum = sum
_builtin_max = max


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    out = t.detach().clone()
    if world_size() > 1:
        dist.all_reduce(out, op=op)
    return out


def sum(t: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def mean(t: torch.Tensor) -> torch.Tensor:
    """Element-wise mean over ranks (each rank counts once, whatever its batch size)."""
    return _all_reduce(t.float() if not t.is_floating_point() else t, dist.ReduceOp.SUM) / world_size()


def min(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.MIN)


def max(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.MAX)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ values·weights / Σ weights over every element on every rank, in one collective: the true mean
    over samples when ranks hold different numbers of them, unlike a mean of per-rank means."""
    values, weights = values.detach().double(), weights.detach().double().expand_as(values)
    total = sum(torch.stack([(values * weights).sum(), weights.sum()]))
    return (total[0] / total[1]).to(torch.get_default_dtype())


def gather_variable(t: torch.Tensor) -> list[torch.Tensor]:
    """Gather a tensor whose shape may differ per rank (same number of dims and dtype).

    Two collectives: the shapes, then the data padded to the largest shape and trimmed back."""
    if world_size() == 1:
        return [t.detach().clone()]
    shape = torch.tensor(t.shape, dtype=torch.long, device=t.device)
    shapes = [torch.empty_like(shape) for _ in range(world_size())]
    dist.all_gather(shapes, shape)
    sizes = [tuple(s.tolist()) for s in shapes]
    biggest = tuple(_builtin_max(dims) for dims in zip(*sizes, strict=True)) if t.dim() else ()
    padded = torch.zeros(biggest, dtype=t.dtype, device=t.device)
    padded[tuple(slice(0, n) for n in t.shape)] = t.detach()
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded.contiguous())
    return [o[tuple(slice(0, n) for n in size)] for o, size in zip(out, sizes, strict=True)]


def gather_concat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0, in rank order (sizes may differ)."""
    return torch.cat(gather_variable(t), dim=0)


def gather_nested(tree: Any) -> Any:
    """Gather a nested structure (dicts, lists, tuples of tensors) from every rank: each leaf gets a leading
    dimension of size world_size (`out_leaf[r]` is rank r's). Leaves of one dtype travel in one collective,
    however many; every rank must pass the same structure and shapes."""
    leaves, spec = tree_flatten(tree)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise TypeError(f"gather_nested takes tensors in dicts/lists/tuples, got {tree!r:.80}")
    world = world_size()
    gathered = [None] * len(leaves)
    for dtype in dict.fromkeys(leaf.dtype for leaf in leaves):
        idx = [i for i, leaf in enumerate(leaves) if leaf.dtype == dtype]
        flat = torch.cat([leaves[i].detach().reshape(-1) for i in idx])
        parts = [torch.empty_like(flat) for _ in range(world)] if world > 1 else [flat.clone()]
        if world > 1:
            dist.all_gather(parts, flat)
        stacked = torch.stack(parts)
        offset = 0
        for i in idx:
            n = leaves[i].numel()
            gathered[i] = stacked[:, offset : offset + n].reshape(world, *leaves[i].shape)
            offset += n
    return tree_unflatten(gathered, spec)


def same_on_every_rank(numbers: list[int], group=None) -> bool:
    """Whether every rank passed these very whole numbers (below 2**53): one small all_reduce of
    host numbers, the largest of each and of its negation. `group`: a CPU (gloo) group, so a GPU
    job does not wait for its device (runtime's control_group)."""
    if world_size() == 1:
        return True
    both = torch.tensor([*numbers, *(-x for x in numbers)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest = both.tolist()
    count = len(numbers)
    return all(largest[i] == -largest[count + i] for i in range(count))


def gather_object(obj: Any) -> list:
    """Every rank's Python object, in rank order."""
    out = [obj] * world_size()
    if len(out) > 1:
        dist.all_gather_object(out, obj)
    return out


def gather_object_to_main(obj: Any) -> list | None:
    """Every rank's Python object, in rank order, on rank 0 only (None elsewhere): for state only
    rank 0 writes, which would cost every rank the memory of all ranks' objects with gather_object."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s Python object on every rank (e.g. a run name only rank 0 chose)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
