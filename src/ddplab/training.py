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
            return contextlib.nullcontext()
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
