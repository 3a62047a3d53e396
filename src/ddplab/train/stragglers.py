"""Which rank the others wait for, and why: each rank's own time per step, compared at every beat.

In DDP every rank's step lasts as long as the slowest rank's (the gradient all_reduce waits for it), so
step times cannot tell who is slow. What differs is the time a rank spends on its own before it can
join: waiting for its next batch (`next()` on its data) and computing its forward (`training_step`).
The backward is left out on purpose: it contains the wait for the slowest rank's gradients, so every
fast rank's backward grows by what the slow one costs. Each rank's three figures (step, data wait,
forward, in seconds per step) ride in the heartbeat's packed all_reduce (intervals.py), one slot per
rank: no collective of their own.

A rank is slow in a beat when its data wait plus forward exceed the median rank's (the lower median:
with two ranks, the faster one) by more than
`SLOW_SHARE` of the step (and by `SLOW_FLOOR_S` at least, so that microsecond steps do not name noise);
it is named when it is slow in `PERSIST_BEATS` beats in a row (about as many seconds), once, and again
only after it has caught up for as long."""

import socket
import statistics
import time

import torch

from ..distributed import collectives

# the share of a step by which a rank's own time must exceed the median rank's
SLOW_SHARE = 0.2
SLOW_FLOOR_S = 0.002
# beats in a row (about one a second) before a rank is named, or said to have caught up
PERSIST_BEATS = 5
# seconds between two per-rank records in metrics.jsonl
RECORD_EVERY_S = 10.0

# what each rank puts in its slots, in this order (seconds per step)
FIELDS = ("step_s", "data_s", "forward_s")


class ForwardClock:
    """Time in `training_step` on this rank. On a GPU the host runs ahead of the device, so CUDA
    events time the device's work; they are read once done, never waited for."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        # a perf_counter() reading, or a CUDA event
        self._started = None
        # (start, end) events not yet known to be done
        self._pending: list[tuple] = []

    def start(self) -> None:
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        """(A start without a stop, a forward that raised, is dropped by the next start.)"""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._started, end))
        else:
            self.seconds += time.perf_counter() - self._started

    def take(self) -> float:
        """The seconds measured since the last take (on a GPU: of the forwards the device has finished)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.pop(0)
            self.seconds += start.elapsed_time(end) / 1000
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class StragglerWatch:
    """Every rank keeps one, fed the same per-rank figures at each beat; rank 0 says what it finds."""

    def __init__(self, world_size: int, say, record, hosts: list[str] | None = None):
        self.world = world_size
        # print a line (rank 0 only), write a per-rank record to the metrics log
        self.say = say
        self.record = record
        # every rank's host, gathered once, for the line that names one
        self.hosts = hosts or collectives.gather_object(socket.gethostname())
        # the rank named now, and the beats in a row that a rank has been slow (or, named, not)
        self.named: int | None = None
        self._streak: tuple[int | None, int] = (None, 0)
        # per-rank sums since the last record: seconds (weighted by steps), and the steps
        self._sums = [[0.0] * len(FIELDS) for _ in range(world_size)]
        self._steps = 0
        self._recorded_at = time.monotonic()

    def observe(self, step: int, figures: list[list[float]], steps: int) -> None:
        """One beat's figures (`figures[rank]` in FIELDS' order, per step) over its `steps` steps."""
        for sums, rank_figures in zip(self._sums, figures, strict=True):
            for i, value in enumerate(rank_figures):
                sums[i] += value * steps
        self._steps += steps
        self._judge(step, figures)
        if time.monotonic() - self._recorded_at >= RECORD_EVERY_S:
            self.flush(step)

    def flush(self, step: int) -> None:
        """Write the per-rank means since the last record (every `RECORD_EVERY_S` and at the end)."""
        if not self._steps:
            return
        means = {field: [round(sums[i] / self._steps, 6) for sums in self._sums] for i, field in enumerate(FIELDS)}
        self.record(step, {**means, "steps": self._steps})
        self._sums = [[0.0] * len(FIELDS) for _ in range(self.world)]
        self._steps = 0
        self._recorded_at = time.monotonic()

    def _judge(self, step: int, figures: list[list[float]]) -> None:
        slowest, lag, step_s = slowest_rank(figures)
        slow = slowest if lag > max(SLOW_SHARE * step_s, SLOW_FLOOR_S) else None
        if self.named is None:
            # the same rank, beat after beat
            count = self._streak[1] + 1 if slow is not None and slow == self._streak[0] else 1
            self._streak = (slow, count if slow is not None else 0)
            if slow is not None and count >= PERSIST_BEATS:
                self.named = slow
                self._streak = (None, 0)
                self.say(describe(slow, self.hosts[slow], figures, step))
        elif slow != self.named:
            count = self._streak[1] + 1
            self._streak = (None, count)
            if count >= PERSIST_BEATS:
                self.say(f"step {step}: rank {self.named} ({self.hosts[self.named]}) has caught up with the others")
                self.named = None
                self._streak = (None, 0)
        else:
            self._streak = (None, 0)


def slowest_rank(figures: list[list[float]]) -> tuple[int, float, float]:
    """(rank, seconds per step by which its own time exceeds the median rank's, the step's seconds)."""
    own = [data + forward for _, data, forward in figures]
    median = statistics.median_low(own)
    slowest = max(range(len(own)), key=own.__getitem__)
    return slowest, own[slowest] - median, max(step for step, _, _ in figures)


def describe(rank: int, host: str, figures: list[list[float]], step: int) -> str:
    """The line that names a slow rank: what it does longer than the others, and where to look."""
    data = [f[1] for f in figures]
    forward = [f[2] for f in figures]
    extra_data = data[rank] - statistics.median_low(data)
    extra_forward = forward[rank] - statistics.median_low(forward)
    step_s = max(f[0] for f in figures)
    if extra_data >= extra_forward:
        what = (
            f"it waits for data {1000 * data[rank]:.0f} ms per step, the median rank "
            f"{1000 * statistics.median_low(data):.0f} ms: look at its data loading (trainer.num_workers, "
            "its disk, its CPU)"
        )
    else:
        what = (
            f"it computes its forward in {1000 * forward[rank]:.0f} ms per step, the median rank "
            f"{1000 * statistics.median_low(forward):.0f} ms: look at its device (a slower or throttled GPU or "
            "CPU, other jobs on it) or at uneven work (longer samples on this rank)"
        )
    return (
        f"step {step}: rank {rank} ({host}) is slow and every rank waits for it (steps of "
        f"{1000 * step_s:.0f} ms): {what}"
    )


def per_rank_means(rows: list[dict]) -> dict[str, list[float]] | None:
    """Each rank's figures over a whole run, from the 'ranks' records of its metrics.jsonl (None: none)."""
    records = [row["ranks"] for row in rows if isinstance(row.get("ranks"), dict)]
    steps = sum(record["steps"] for record in records)
    if not steps:
        return None
    world = len(records[-1][FIELDS[0]])
    # (a job that changed its size, elastic, is averaged over its last size)
    records = [record for record in records if len(record[FIELDS[0]]) == world]
    steps = sum(record["steps"] for record in records)
    return {
        field: [sum(record[field][rank] * record["steps"] for record in records) / steps for rank in range(world)]
        for field in FIELDS
    }


def per_rank_line(means: dict[str, list[float]]) -> str:
    """The summary's line: each rank's data wait and forward in ms per step (for many ranks, the
    median and the slowest)."""
    data, forward = means["data_s"], means["forward_s"]
    if len(data) <= 8:
        shown = ", ".join(
            f"{rank}: {1000 * d:.1f}/{1000 * f:.1f}" for rank, (d, f) in enumerate(zip(data, forward, strict=True))
        )
    else:
        slowest = max(range(len(data)), key=lambda rank: data[rank] + forward[rank])
        shown = (
            f"median {1000 * statistics.median_low(data):.1f}/{1000 * statistics.median_low(forward):.1f}, "
            f"slowest rank {slowest}: {1000 * data[slowest]:.1f}/{1000 * forward[slowest]:.1f}"
        )
    return f"  ms per step waiting for data/in the forward, by rank: {shown}"
