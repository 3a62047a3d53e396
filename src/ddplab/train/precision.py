"""Mixed precision for `trainer.precision`: the autocast context and, for fp16, the gradient scaler."""

import contextlib

import torch

from ..errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# one reusable instance: the loop enters it on most micro-batches
NO_CONTEXT = contextlib.nullcontext()


class Precision:
    """Autocast context and gradient scaler for `trainer.precision` (fp32 | bf16 | fp16)."""

    def __init__(self, precision: str, device: torch.device):
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError("trainer.precision=fp16 needs a CUDA device", "use trainer.precision=bf16 on CPU")
        self.precision = precision
        self.device = device
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def autocast(self):
        fp32 = self.precision == "fp32"
        return NO_CONTEXT if fp32 else torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not self.scaler:
            for opt in optimizers:
                opt.step()
            return
        for opt in optimizers:
            self.scaler.step(opt)
        self.scaler.update()

    def skip(self) -> None:
        """No optimizer step this time; the fp16 scaler still lowers its scale for the inf it saw."""
        if self.scaler:
            self.scaler.update()

    def state_dict(self) -> dict | None:
        """The fp16 scaler's state (its scale and growth tracker); None without a scaler."""
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, saved: dict | None) -> None:
        """A checkpoint of a run without a scaler leaves this one's as it starts."""
        if self.scaler and saved:
            self.scaler.load_state_dict(saved)
