"""Mixed precision for `trainer.precision`: the autocast context and, for fp16, the gradient scaler."""

import contextlib

import torch

from ..errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


NO_CONTEXT = contextlib.nullcontext()  # one reusable instance: the loop enters it on most micro-batches


class Precision:
    """Autocast context and gradient scaler for `trainer.precision` (fp32 | bf16 | fp16)."""

    def __init__(self, precision: str, device: torch.device):
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError("trainer.precision=fp16 needs a CUDA device", "use trainer.precision=bf16 on CPU")
        self.precision, self.device = precision, device
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self):
        fp32 = self.precision == "fp32"
        return NO_CONTEXT if fp32 else torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            self.scaler.step(opt) if self.scaler else opt.step()
        if self.scaler:
            self.scaler.update()

    def skip(self) -> None:
        """No optimizer step this time; the fp16 scaler still lowers its scale for the inf it saw."""
        if self.scaler:
            self.scaler.update()
