"""Stop cleanly when the scheduler says so: SIGTERM (torchrun, Kubernetes) or SIGUSR1 (SLURM's
warning signal) -> every rank agrees at a step boundary, saves a checkpoint, and exits.

Agreement needs a collective, since the signal reaches ranks at slightly different steps. It runs
asynchronously on a small gloo group of its own: launched after step s, read after step s+1, so
its latency hides behind a training step and no rank waits for it.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionWatch:
    def __init__(self, signal_names: str, distributed: bool):
        self.requested = False
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        for name in filter(None, (s.strip() for s in signal_names.split(","))):
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._group = dist.new_group(backend="gloo") if distributed and self._previous else None
        self._pending: tuple[object, torch.Tensor] | None = None

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """Call once per step on every rank. True on every rank at the same step, one step after
        any rank received a signal (immediately in a world of one)."""
        if not self._previous:
            return False
        if self._group is None:
            return self.requested
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([1.0 if self.requested else 0.0])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return stop

    def close(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
