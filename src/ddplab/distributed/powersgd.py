"""PowerSGD (`dist.comm_hook=powersgd`): torch's hook, with its state kept per parameter so that a
checkpoint restores it exactly.

torch's PowerSGDState keys what it keeps by DDP's gradient bucket: each rank's compression error
(added back into that rank's next gradient) and the warm-started factors P and Q (the same on every
rank). Bucket numbers mean nothing to another run: a resumed run may lay its buckets out otherwise
(another dist.bucket_cap_mb, or DDP's own re-layout after the first step, which comm_hooks.py turns
off for PowerSGD). The hook here cuts the state into its parameters whenever the layout changes and
a checkpoint saves it cut, so each parameter's part goes back into whatever bucket holds it now."""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from .. import seeding
from ..config import DistConfig
from . import collectives


class Compressor:
    """One network's PowerSGD: torch's state, the bucket layout it was keyed by, and the state of
    parameters waiting to go back into their buckets (after a restore or a change of layout)."""

    def __init__(self, parameters: list[torch.Tensor], cfg: DistConfig, one_bucket_at_a_time: bool):
        self.state = torch_powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_iter,
        )
        self.parameters = parameters
        self.index = {id(p): i for i, p in enumerate(parameters)}
        # bucket index -> indices of its parameters, in the bucket's order
        self.layout: dict[int, list[int]] = {}
        # parameter index -> its part of the error, P and Q
        self.waiting: dict[str, dict[int, torch.Tensor]] = {"error": {}, "p": {}, "q": {}}
        self.one_bucket_at_a_time = one_bucket_at_a_time

    def hook(self, bucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook: torch's PowerSGD on this bucket, its state put in place first."""
        members = [self.index[id(p)] for p in bucket.parameters()]
        # a bucket that now holds other parameters: all state goes back to waiting, by parameter
        if self.layout.get(bucket.index(), members) != members:
            self._cut()
        self.layout[bucket.index()] = members
        self._put_back(bucket.index(), members)
        if not self.one_bucket_at_a_time:
            return torch_powersgd.powerSGD_hook(self.state, bucket)
        done = torch.futures.Future()
        done.set_result(compress_in_order(self.state, bucket))
        return done

    def state_dict(self) -> dict[str, Any]:
        self._cut()
        state = self.state
        return {
            "matrix_approximation_rank": state.matrix_approximation_rank,
            "iter": state.iter,
            "rng": seeding.numpy_state(state.rng.get_state()),
            "numel_before": state.total_numel_before_compression,
            "numel_after": state.total_numel_after_compression,
            "next_stats_report": state.next_stats_report,
            **{kind: {i: t.cpu() for i, t in parts.items()} for kind, parts in self.waiting.items()},
        }

    def load_state_dict(self, saved: dict[str, Any], keep_errors: bool) -> None:
        state = self.state
        state.iter = saved["iter"]
        state.rng.set_state(seeding.numpy_generator_state(saved["rng"]))
        state.total_numel_before_compression = saved["numel_before"]
        state.total_numel_after_compression = saved["numel_after"]
        state.next_stats_report = saved["next_stats_report"]
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        device = self.parameters[0].device
        self.waiting = {"error": {}, "p": {}, "q": {}}
        if keep_errors:
            self.waiting["error"] = {i: t.to(device) for i, t in saved["error"].items()}
        # factors of another rank do not fit: PowerSGD draws new ones at the next step
        if saved["matrix_approximation_rank"] == state.matrix_approximation_rank:
            self.waiting["p"] = {i: t.to(device) for i, t in saved["p"].items()}
            self.waiting["q"] = {i: t.to(device) for i, t in saved["q"].items()}

    def _cut(self) -> None:
        """Move the state torch keeps by bucket into `waiting`, by parameter."""
        state = self.state
        for bucket, members in self.layout.items():
            if bucket in state.error_dict:
                sizes = [self.parameters[i].numel() for i in members]
                parts = state.error_dict.pop(bucket).split(sizes)
                self.waiting["error"].update(zip(members, parts, strict=True))
            if bucket in state.p_memory_dict:
                order, p_sizes, q_sizes = self._factor_layout(members)
                p_parts = state.p_memory_dict.pop(bucket).split(p_sizes)
                q_parts = state.q_memory_dict.pop(bucket).split(q_sizes)
                self.waiting["p"].update(zip(order, p_parts, strict=True))
                self.waiting["q"].update(zip(order, q_parts, strict=True))
        self.layout.clear()

    def _put_back(self, bucket: int, members: list[int]) -> None:
        """Give the bucket its parameters' waiting state, when every one of them has some."""
        waiting = self.waiting
        # the usual step: nothing waits, and the bucket's state is where torch left it
        if not any(waiting.values()):
            return
        if members and all(i in waiting["error"] for i in members):
            self.state.error_dict[bucket] = torch.cat([waiting["error"].pop(i) for i in members])
        order, _, _ = self._factor_layout(members)
        # once compression has begun every bucket has factors, none for a bucket without matrices
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        if compressing and all(i in waiting["p"] and i in waiting["q"] for i in order):
            self.state.p_memory_dict[bucket] = _joined([waiting["p"].pop(i) for i in order], self.parameters[0])
            self.state.q_memory_dict[bucket] = _joined([waiting["q"].pop(i) for i in order], self.parameters[0])

    def _factor_layout(self, members: list[int]) -> tuple[list[int], list[int], list[int]]:
        """The parameters whose gradients torch's hook compresses, in the order it lays out their
        factors in P and Q, with the length of each one's P and of its Q."""
        shapes = [_matrix_shape(self.parameters[i]) for i in members]
        _, compressed, _, _ = _compressed(self.state, shapes)
        ranks = [min(*shapes[k], self.state.matrix_approximation_rank) for k in compressed]
        return (
            [members[k] for k in compressed],
            [shapes[k][0] * rank for k, rank in zip(compressed, ranks, strict=True)],
            [shapes[k][1] * rank for k, rank in zip(compressed, ranks, strict=True)],
        )


def compress_in_order(state: torch_powersgd.PowerSGDState, bucket) -> torch.Tensor:
    """torch's PowerSGD on one bucket, start to end in the calling thread; returns the bucket's buffer,
    averaged. The same state, kept the same way, as torch's hook (which NCCL runs), so checkpoints
    have one format.

    Why not torch's hook on gloo: it chains the bucket's all_reduces in callbacks that gloo runs on
    its own threads, so with two buckets in flight two ranks could start them in different orders and
    wait for each other forever (a hang in the backward, seen on 2 ranks); here every all_reduce starts
    in the order DDP hands the buckets over. And it computes Q = M^T P with a transposed batched
    product, which a CPU reads down the columns of M: 3.5 ms for a 1024 x 1024 gradient on one core,
    against 0.3 ms for (P^T M)^T, the same sums read along the rows. The uncompressed tensors and P
    are summed in one all_reduce, one round trip fewer a bucket."""
    group = state.process_group or dist.group.WORLD
    world = group.size()
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        dist.all_reduce(buffer.div_(world), group=group)
        return buffer
    index = bucket.index()
    if index in state.error_dict:
        buffer.add_(state.error_dict[index])
    sent = buffer.clone()
    plain, matrices = _split(state, bucket)
    ps, qs = _factors(state, index, matrices, buffer)
    for matrix, q, p in zip(matrices, qs, ps, strict=True):
        torch.bmm(matrix, q, out=p)
    # the uncompressed tensors and P, summed together
    summed = torch.cat([*(t.reshape(-1) for t in plain), state.p_memory_dict[index]])
    dist.all_reduce(summed, group=group)
    offset = 0
    for tensor in plain:
        tensor.copy_(summed[offset : offset + tensor.numel()].view_as(tensor)).div_(world)
        offset += tensor.numel()
    state.p_memory_dict[index].copy_(summed[offset:])
    for matrix, p, q in zip(matrices, ps, qs, strict=True):
        torch_powersgd._orthogonalize(p, state.orthogonalization_epsilon)
        q.copy_(torch.bmm(p.transpose(1, 2), matrix).transpose(1, 2))
    dist.all_reduce(state.q_memory_dict[index], group=group)
    state.q_memory_dict[index].div_(world)
    for matrix, p, q in zip(matrices, ps, qs, strict=True):
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    state.error_dict[index] = sent - buffer
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return buffer


def _split(state: torch_powersgd.PowerSGDState, bucket) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The bucket's gradients sent whole, and those compressed as 1 x rows x columns views in torch's
    order; counts what compression saves, as torch does."""
    gradients = bucket.gradients()
    shapes = [_matrix_shape(gradient) for gradient in gradients]
    plain, compressed, before, after = _compressed(state, shapes)
    state.total_numel_before_compression += before
    state.total_numel_after_compression += after
    torch_powersgd._report_compression_stats(bucket, state)
    return [gradients[k] for k in plain], [gradients[k].view(1, *shapes[k]) for k in compressed]


def _compressed(
    state: torch_powersgd.PowerSGDState, shapes: list[tuple[int, int]]
) -> tuple[list[int], list[int], int, int]:
    """Which of a bucket's matrices (by their shapes, in the bucket's order) torch's hook sends whole
    and which it compresses, the latter grouped by shape as it lays out their factors in P and Q; and
    the elements it counts before and after compression. One rule for the live gradients (_split) and
    for the parameters a checkpoint cuts the factors by (Compressor._factor_layout)."""
    plain, by_shape, before, after = [], {}, 0, 0
    for k, (n, m) in enumerate(shapes):
        compress, whole, reduced = torch_powersgd._should_compress(
            n, m, min(n, m, state.matrix_approximation_rank), state.min_compression_rate
        )
        before += whole
        after += reduced if compress else whole
        if compress:
            by_shape.setdefault((n, m), []).append(k)
        else:
            plain.append(k)
    return plain, [k for group in by_shape.values() for k in group], before, after


def _factors(state: torch_powersgd.PowerSGDState, index: int, matrices: list[torch.Tensor], like: torch.Tensor):
    """Each matrix's views into the bucket's P and Q (of `like`'s dtype and device), Q orthogonalized:
    drawn at random the first time, from torch's generator as torch's hook draws it, and warm-started
    after."""
    ranks = [min(m.shape[1], m.shape[2], state.matrix_approximation_rank) for m in matrices]
    fresh = index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = like.new_empty(sum(m.shape[1] * r for m, r in zip(matrices, ranks, strict=True)))
        state.q_memory_dict[index] = like.new_empty(sum(m.shape[2] * r for m, r in zip(matrices, ranks, strict=True)))
    ps = _views(state.p_memory_dict[index], [(m.shape[1], r) for m, r in zip(matrices, ranks, strict=True)])
    qs = _views(state.q_memory_dict[index], [(m.shape[2], r) for m, r in zip(matrices, ranks, strict=True)])
    if fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, dtype=q.dtype))
    for q in qs:
        torch_powersgd._orthogonalize(q, state.orthogonalization_epsilon)
    return ps, qs


def _views(memory: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    views, offset = [], 0
    for rows, rank in shapes:
        views.append(memory[offset : offset + rows * rank].view(1, rows, rank))
        offset += rows * rank
    return views


def _matrix_shape(parameter: torch.Tensor) -> tuple[int, int]:
    """The gradient as torch's hook compresses it: rows by the first dimension (a scalar: 1 x 1)."""
    rows = parameter.shape[0] if parameter.dim() else 1
    return rows, parameter.numel() // rows


def _joined(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


class PowerSGDStates:
    """Every network's PowerSGD state, saved from every rank (each rank's compression error is its
    own) and restored on each. On another world size the step count, the factors and the generator
    continue (they are the same on every rank) and the per-rank errors start from zero."""

    def __init__(self, compressors: dict[str, Compressor], rank: int, world_size: int):
        self.compressors = compressors
        self.rank = rank
        self.world_size = world_size
        self.resume_note: str | None = None

    def state_dict(self) -> list | None:
        if not self.compressors:
            return None
        # rank 0 writes the checkpoint: only it receives every rank's errors
        return collectives.gather_object_to_main({name: c.state_dict() for name, c in self.compressors.items()})

    def load_state_dict(self, saved: list | None) -> None:
        if not self.compressors:
            return
        if not saved:
            self.resume_note = (
                "the checkpoint holds no PowerSGD state (it was trained without dist.comm_hook=powersgd): "
                "compression starts afresh, after dist.powersgd_start_iter steps of plain all_reduce"
            )
            return
        same_ranks = len(saved) == self.world_size
        mine = saved[self.rank] if same_ranks else saved[0]
        for name, compressor in self.compressors.items():
            if name in mine:
                compressor.load_state_dict(mine[name], keep_errors=same_ranks)
            else:
                self.resume_note = f"the checkpoint holds no PowerSGD state of network '{name}': it starts afresh"
        if not same_ranks:
            self.resume_note = (
                f"PowerSGD's state was saved by {len(saved)} ranks and this run has {self.world_size}: its step "
                "count and factors continue, each rank's compression error starts from zero"
            )
