"""One optimizer step: micro-batches with gradient accumulation, mixed precision, clipping.

The rules live here and nowhere else: DDP's all_reduce runs only on the last micro-batch (`no_sync` on the
others); each micro-batch's loss is divided by their number, so the accumulated gradient is the mean over
the global batch; gradients are unscaled before they are clipped or checked; schedulers step once per step."""

import time
from typing import Iterator

import torch

from ..distributed.wrapping import no_sync
from ..errors import ConfigError
from .precision import NO_CONTEXT


def optimizer_step(t, batches: Iterator) -> None:
    """Take `accumulate` micro-batches from `batches` and make one optimizer step of them, for the
    training loop `t` (loop.py's Trainer)."""
    settings, accumulate, models = t.settings, t.plan.accumulate, t.wrapped
    skip_nonfinite = settings.nonfinite == "skip"
    for micro in range(accumulate):
        waited = time.perf_counter()
        batch = next(batches)  # on the device already (sources.py)
        t.intervals.data_wait_s += time.perf_counter() - waited
        if (tokens := t.exp.count_tokens(batch)) is not None:
            t.intervals.tokens += tokens  # an int, or a tensor summed on its device
        with no_sync(models) if micro < accumulate - 1 else NO_CONTEXT:
            with t.precision.autocast():
                loss, extra = split_output(t.exp.training_step(batch))
            t.precision.backward(loss / accumulate if accumulate > 1 else loss)  # a mean over the global batch
        t.intervals.keep_loss(loss.detach())
        for key, value in extra.items():
            t.metrics.add(key, value)
    for opt in t.optimizers if t.precision.scaler else ():  # fp16: true gradients before clipping or checking
        t.precision.scaler.unscale_(opt)
    if settings.grad_clip:
        params = [p for m in models for p in m.parameters() if p.grad is not None]  # all networks together
        t.metrics.add("grad_norm", torch.nn.utils.clip_grad_norm_(params, settings.grad_clip))  # the norm before
    if skip_nonfinite and not t.nonfinite.gradients_finite(models):
        t.precision.skip()
        t.metrics.add("skipped", 1.0)
        t.exp.print(f"step {t.progress.step + 1}: gradients are not finite, optimizer step skipped "
                    "(trainer.nonfinite=skip)")
    else:
        t.precision.step(t.optimizers)
        if skip_nonfinite:
            t.metrics.add("skipped", 0.0)
    for opt in t.optimizers:
        opt.zero_grad()  # set_to_none, torch's default
    for sched in t.schedulers:
        sched.step()
    if t.ema is not None:
        t.ema.update()
    t.progress.advance(t.plan.global_batch)


def split_output(out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`training_step` returns a loss, or a dict with 'loss' and other scalars to log."""
    loss, extra = (out.get("loss"), {k: v for k, v in out.items() if k != "loss"}) if isinstance(out, dict) else (out, {})
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ConfigError(f"training_step returned {out!r:.80}, not a one-element loss tensor (or a dict with 'loss')",
                          "return the mean loss of the micro-batch, e.g. F.cross_entropy(logits, y)")
    return loss, extra


