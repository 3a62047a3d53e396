"""Out-of-memory backoff (trainer.oom_backoff): a step that runs out of memory on any rank is redone
by every rank with its micro-batches cut in two, then four..., the same global batch.

Why the step runs differently with it on: DDP sums gradients inside the backward of the last
micro-batch, and a rank that runs out of memory there leaves the others waiting in that collective
forever. So every micro-batch runs under `no_sync`; when all are through, the ranks agree in one
all_reduce whether any ran out, and only then sum the gradients (distributed/gradients.py, in buckets, as DDP
would).
The price is DDP's overlap of that sum with the backward. Since every rank redoes the step with the
same cut, no half-applied update exists: gradients are dropped before the redo. A checkpoint keeps
the largest piece that fit (entry "oom_backoff")."""

import math
import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..distributed import gradients
from ..distributed.wrapping import no_sync, sync_buffers
from ..errors import DdplabError
from .capability import Capability
from .returns import split_output
from .step import StepParts, StepRecords, apply_gradients, check_rank_buffers, training_forward


class OomBackoff(Capability):
    """How many pieces each micro-batch is cut into, and the step that cuts them. A checkpoint keeps
    the largest piece that fit, so a resumed run, on any world size, starts with pieces no larger."""

    state_key = "oom_backoff"

    @classmethod
    def from_settings(cls, settings, micro_batch: int, world_size: int, device, broadcast_buffers: bool):
        """trainer.oom_backoff's, or None when it is off."""
        return cls(micro_batch, world_size, device, broadcast_buffers) if settings.oom_backoff else None

    def __init__(self, micro_batch: int, world_size: int, device: torch.device, sync_buffers: bool):
        self.micro_batch = micro_batch
        self.world_size = world_size
        self.device = device
        self.sync_buffers = sync_buffers
        self.mean = gradients.mean_over_ranks(world_size)
        self.split = 1
        self.resume_note: str | None = None

    @property
    def piece(self) -> int:
        return math.ceil(self.micro_batch / self.split)

    def state_dict(self) -> dict:
        return {"largest_piece": self.piece}

    def load_state_dict(self, saved: dict | None) -> None:
        if saved:
            self.split = max(1, math.ceil(self.micro_batch / saved["largest_piece"]))
        if self.split > 1:
            self.resume_note = (
                f"each micro-batch of {self.micro_batch} is cut into {self.split} pieces of at most {self.piece} "
                "samples, the largest that fit before (trainer.oom_backoff)"
            )

    def any_rank_ran_out(self, ran_out: bool) -> bool:
        """Whether any rank ran out of memory in this step: one all_reduce, on every rank."""
        if self.world_size == 1:
            return ran_out
        flag = torch.tensor([float(ran_out)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def halve(self, step: int, experiment) -> None:
        """Cut the pieces in two, or end the run when one sample is already too many."""
        if self.piece == 1:
            raise DdplabError(
                f"step {step} ran out of memory with one sample per micro-batch (trainer.oom_backoff)",
                "the model itself does not fit: use trainer.precision=bf16, a smaller model or shorter samples",
            )
        before = self.piece
        self.split *= 2
        experiment.print(
            f"step {step}: out of memory with micro-batches of {before} samples; every rank redoes the step "
            f"with {self.piece} (trainer.oom_backoff): the same global batch"
        )

    def step(self, parts: StepParts, records: StepRecords, batches, accumulate: int) -> None:
        """One optimizer step that survives running out of memory (module docstring)."""
        waited = time.perf_counter()
        # kept until the step is through: a redo takes them again
        fetched = [next(batches) for _ in range(accumulate)]
        records.interval.waited(time.perf_counter() - waited)
        # a redo draws the same random numbers (dropout) as the attempt it replaces
        random_state = _random_state(self.device)
        while True:
            outputs = _accumulate(parts, fetched, accumulate, self.split, records.interval.forward)
            if not self.any_rank_ran_out(outputs is None):
                break
            _set_random_state(random_state, self.device)
            for optimizer in parts.optimizers:
                optimizer.zero_grad()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.halve(records.progress.step + 1, parts.experiment)
        if self.world_size > 1:
            # a parameter two networks hold is averaged once
            gradients.average([p for net in parts.networks for p in net.parameters()], self.mean)
        check_rank_buffers(parts)
        if self.sync_buffers and self.world_size > 1:
            # what DDP's forward would have done (its own copy is off: a collective in the forward)
            sync_buffers(parts.networks)
        for batch, loss, extra in outputs:
            tokens = parts.experiment.count_tokens(batch)
            if tokens is not None:
                records.interval.tokens += tokens
            records.interval.keep_loss(loss)
            for key, value in extra.items():
                records.metrics.add(key, value)
        apply_gradients(parts, records)


def _random_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_random_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _accumulate(parts: StepParts, fetched: list, accumulate: int, split: int, forward) -> list | None:
    """Forward and backward of every piece, gradients kept on this rank; None when memory ran out."""
    outputs = []
    try:
        with no_sync(parts.networks):
            for batch in fetched:
                for piece, share in split_batch(batch, split):
                    forward.start()
                    with parts.precision.autocast(), training_forward(parts.networks, parts.first_step):
                        loss, extra = split_output(parts.experiment.training_step(piece))
                    forward.stop()
                    # the mean over the global batch, as without pieces
                    if share < 1:
                        parts.precision.backward(loss * (share / accumulate))
                    else:
                        parts.precision.backward(loss / accumulate if accumulate > 1 else loss)
                    outputs.append((piece, loss.detach(), extra))
    except torch.OutOfMemoryError:
        return None
    return outputs


def split_batch(batch, pieces: int) -> list[tuple[object, float]]:
    """A collated batch cut along its first dimension into up to `pieces` parts, with each part's
    share of the samples. Every leaf must be a tensor of the same length."""
    if pieces == 1:
        return [(batch, 1.0)]
    leaves, spec = tree_flatten(batch)
    sizes = {leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.dim() else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise DdplabError(
            "trainer.oom_backoff cuts batches into smaller ones, and this batch is not a structure of tensors "
            f"that share their first dimension (leaves: {sorted(type(leaf).__name__ for leaf in leaves)[:4]})",
            "return batches of tensors (collate strings into ids), or set trainer.micro_batch_size instead",
        )
    total = sizes.pop()
    cut = [leaf.tensor_split(min(pieces, total)) for leaf in leaves]
    return [(tree_unflatten(list(parts), spec), parts[0].shape[0] / total) for parts in zip(*cut, strict=True)]
