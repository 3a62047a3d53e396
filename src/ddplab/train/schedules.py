"""A learning-rate schedule that knows the run's length: a linear warm-up, then cosine or linear decay.

A plain `LambdaLR`, stepped once per optimizer step and checkpointed like any scheduler. Build it in
`build()` from `self.total_steps`, the run's optimizer steps, the same on resume (docs/experiments.md)."""

import math

from torch.optim.lr_scheduler import LambdaLR

from ..errors import ConfigError


def warmup_schedule(optimizer, warmup_steps: int, total_steps: int, decay: str = "cosine", min_factor: float = 0.0):
    """Optimizer step k (from 1) trains at lr x k/warmup_steps while k <= warmup_steps (the first
    step is not wasted at 0), then at lr x a factor going from 1 down to `min_factor` over the
    remaining steps, along half a cosine (decay="cosine") or a straight line (decay="linear")."""
    if not 0 <= warmup_steps < total_steps or decay not in ("cosine", "linear"):
        raise ConfigError(
            f"warmup_schedule cannot warm up {warmup_steps} of {total_steps} steps and decay {decay!r}",
            "use 0 <= warmup_steps < total_steps (self.total_steps), decay cosine or linear",
        )

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        p = min(1.0, (s - warmup_steps) / (total_steps - warmup_steps))
        return min_factor + (1 - min_factor) * ((1 + math.cos(math.pi * p)) / 2 if decay == "cosine" else 1 - p)

    return LambdaLR(optimizer, factor)
