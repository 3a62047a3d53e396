"""Stop cleanly when the scheduler says so: SIGTERM (torchrun, Kubernetes) or SIGUSR1 (SLURM's
warning signal). This module only notes the signal; the ranks agree on it in the loop's heartbeat
(intervals.py), so every rank saves and stops at the same step, about a second later.

One SIGTERM is not a stop to save at: the one torch's agent sends the workers of a job whose worker
failed. That worker left a note first (launch/stops.py), and the handler then ends this worker where
it is: at its next step it could only find the peer gone, after up to the agent's 30 s."""

import os
import signal
import sys

import torch

from .. import environment
from ..distributed import collectives
from ..errors import PeerFailed


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
        # not while this worker is failing itself (an exception being handled, anywhere down the
        # stack): its own report (a diagnosis of the collective it lost) goes on to its end
        if signum == signal.SIGTERM and sys.exc_info()[0] is None and _peer_failed():
            raise PeerFailed("another worker of this job failed; torch's agent ends the others")
        self.received = signal.Signals(signum).name

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def _peer_failed() -> bool:
    """Whether a worker of this node failed in this attempt (launch/stops.py: note_failure)."""
    return os.path.exists(os.environ.get(environment.PEER_FAILED) or "")
