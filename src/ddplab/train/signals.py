"""Stop cleanly when the scheduler says so: SIGTERM (torchrun, Kubernetes) or SIGUSR1 (SLURM's
warning signal). This module only notes the signal; the ranks agree on it in the loop's heartbeat
(intervals.py), so every rank saves and stops at the same step, about a second later."""

import signal

import torch

from ..distributed import collectives


class StopSignals:
    """Handlers for `checkpoint.preempt_signals` that only record that a signal came."""

    def __init__(self, signal_names: str):
        # the signal's name once one came; the handlers replaced
        self.received = None
        self._previous = {}
        for name in filter(None, (s.strip() for s in signal_names.split(","))):
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._on_signal)

    @property
    def requested(self):
        """Whether a stop signal came."""
        return self.received is not None

    def agreed(self, device: torch.device) -> str:
        """The signal every rank names for the stop: the highest-numbered one any rank received."""
        mine = float(signal.Signals[self.received].value if self.received else 0)
        return signal.Signals(int(collectives.max(torch.tensor(mine, device=device)).item())).name

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
