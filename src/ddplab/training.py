"""One optimizer step: micro-batches with gradient accumulation, mixed precision, clipping.

Kept apart from the loop so the rules live in one place: DDP's all_reduce runs only on the last
micro-batch (`no_sync` on the others); each micro-batch's loss is divided by the number of
micro-batches so the accumulated gradient is the mean over the global batch; schedulers step
once per optimizer step, never per micro-batch.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


NO_CONTEXT = contextlib.nullcontext()  # one reusable instance: the loop enters it on most micro-batches


class Precision:
    """Autocast context and gradient scaler for `trainer.precision` (fp32 | bf16 | fp16)."""

    def __init__(self, precision: str, device: torch.device):
        if precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"unknown trainer.precision '{precision}'", "use fp32, bf16 or fp16")
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError("trainer.precision=fp16 needs a CUDA device", "use trainer.precision=bf16 on CPU")
        self.precision, self.device = precision, device
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self):
        if self.precision == "fp32":
            return NO_CONTEXT
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            if self.scaler:
                self.scaler.step(opt)
            else:
                opt.step()
        if self.scaler:
            self.scaler.update()

    def skip(self) -> None:
        """No optimizer step this time; the fp16 scaler still lowers its scale for the inf it saw."""
        if self.scaler:
            self.scaler.update()


def clip_gradients(models: list[nn.Module], max_norm: float) -> torch.Tensor:
    """Clip the gradient norm over all networks together; returns the norm before clipping (on device)."""
    params = [p for m in models for p in m.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def split_output(out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`training_step` returns a loss, or a dict with 'loss' and other scalars to log."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, dict) and "loss" in out:
        return out["loss"], {k: v for k, v in out.items() if k != "loss"}
    raise TypeError("training_step must return the loss tensor or a dict with a 'loss' entry")


class NonFiniteGuard:
    """What to do when the loss or the gradients stop being finite numbers (`trainer.nonfinite`).

    error (default): every micro-batch's loss is kept (a reference, no device work per step),
    handed over at the end of its log interval and checked in one vectorised op at the next
    heartbeat; the first non-finite one is remembered as `step * world + rank`. Its flag travels
    in the heartbeat's all_reduce, and `check()` (then, and before each checkpoint, so no NaN
    weights are ever saved) stops the run with its step and rank. skip: after the gradients are all-reduced, one host sync per step tells whether they
    are finite; if not, the optimizer step is skipped on every rank alike and counted.
    """

    NONE = 2**62
    FOLD = 256  # losses kept before they are checked, so memory stays bounded when logging is rare

    def __init__(self, mode: str, device: torch.device, rank: int, world_size: int):
        if mode not in ("error", "skip"):
            raise ConfigError(f"unknown trainer.nonfinite '{mode}'", "use trainer.nonfinite=error or skip")
        self.mode, self.rank, self.world, self.device = mode, rank, world_size, device
        self._first = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self._losses: list[torch.Tensor] = []
        self._steps: list[int] = []

    def watch(self, losses: list[torch.Tensor], first_step: int, per_step: int) -> None:
        """Keep these micro-batch losses (detached; `per_step` of them per optimizer step, the
        first of step `first_step`, 1-based) for the next check."""
        if self.mode != "error":
            return
        self._losses += losses
        self._steps += [first_step + i // per_step for i in range(len(losses))]
        if len(self._losses) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        """Check the kept losses on the device: the first non-finite one's code, no host sync."""
        if not self._losses:
            return
        try:
            losses = torch.stack(self._losses).reshape(-1)
        except RuntimeError:  # shapes () and (1,) mixed: both are one-element losses
            losses = torch.stack([x.reshape(()) for x in self._losses])
        bad = ~torch.isfinite(losses)
        codes = torch.tensor(self._steps, dtype=torch.int64, device=self.device) * self.world + self.rank
        self._first = torch.minimum(self._first, torch.where(bad, codes, self.NONE).min())
        self._losses.clear()
        self._steps.clear()

    def flag(self) -> torch.Tensor | None:
        """1.0 on the device when this rank has seen a non-finite loss: packed into the metrics'
        all_reduce at each log line, so checking costs no collective of its own."""
        if self.mode != "error":
            return None
        self._fold()
        return (self._first != self.NONE).double()

    def check(self) -> None:
        """Stop with a clear message when any rank saw a non-finite loss (a collective: before
        each checkpoint, and after a log line whose flag says so)."""
        if self.mode != "error":
            return
        from . import collectives

        self._fold()
        first = int(collectives.min(self._first.clone()).item())
        if first != self.NONE:
            step, rank = divmod(first, self.world)
            raise ConfigError(
                f"the loss is not a finite number (NaN or inf) at step {step} on rank {rank}; the run stopped "
                "before saving it, earlier checkpoints are kept",
                "lower the learning rate, clip gradients (trainer.grad_clip=1.0) or check the data; "
                "trainer.nonfinite=skip skips such steps instead")

    def gradients_finite(self, models: list[nn.Module]) -> bool:
        """Whether every gradient is finite (the same answer on every rank after DDP's all_reduce)."""
        flags = [torch.isfinite(p.grad).all() for m in models for p in m.parameters() if p.grad is not None]
        return bool(torch.stack(flags).all()) if flags else True
