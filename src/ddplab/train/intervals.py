"""What happens once per log interval, and the loop's periodic collectives (the beat).

A loss is handed over once (`keep_loss`) and, at the end of its interval (or every `FOLD` losses), joins
the logged mean and the non-finite check. About once a second one asynchronous all_reduce carries what
every rank must agree on: the ended intervals' weighted sums (metrics.py), any stop signal, any non-finite
loss, and each rank's step, data-wait and forward times (to set the period alike and to find a slow
rank: stragglers.py). Launched after step s and read after step s+1,
its latency hides behind a step; lines are written up to a second late with their own values and times.
Before it, a small blocking all_reduce of host numbers checks that the ranks logged the same metric
names (the sums are added slot by slot). Why so few and so seldom (measured): docs/decisions.md."""

import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import collectives, hangs, runtime
from ..errors import ConfigError
from .logs import RunLog, format_metrics, is_number, shown
from .metrics import FOLD, MetricTracker, means, on_device, pack_intervals
from .nonfinite import NonFiniteGuard
from .signals import StopSignals
from .stragglers import FIELDS, ForwardClock, StragglerWatch

hangs.name_site(__file__, "the training loop's periodic all_reduce (metrics, stop and NaN flags; train/intervals.py)")

# the names ddplab itself logs in every interval, on every rank (left out of an error's list)
INTERNAL = {"loss", "data_wait", "_tokens"}

# bounds how late a log line or a stop can be on very short steps
MAX_STEPS_BETWEEN_BEATS = 1000


@dataclass
class LogOutput:
    """Where finished log lines go, and what each says besides the metrics."""

    log: RunLog
    # the tqdm bar (its postfix shows the last line)
    bar: object
    # print each line too (when no bar shows them)
    echo: bool
    # the learning rate and the fractional epoch, read when an interval ends
    lr_and_epoch: Callable[[], tuple[float, float]]


# The head of every beat's packed all_reduce: a stop signal on any rank, a non-finite loss on any
# rank; then one slot per rank for each of stragglers.FIELDS (its step, data wait and forward
# seconds per step; the others' slots are 0), then the metric sums.
HEADER = ("stop", "nonfinite")


class LogIntervals:
    """Create at the start of training, on every rank; call `after_step` and `beat` after each
    optimizer step, and `flush` wherever every rank must have written every line (evaluation,
    checkpoint, end)."""

    def __init__(
        self,
        metrics: MetricTracker,
        nonfinite: NonFiniteGuard,
        signals: StopSignals,
        output: LogOutput,
        settings,
        plan,
        step: int,
        rank: int = 0,
        stragglers: StragglerWatch | None = None,
        period_s: float = 1.0,
    ):
        self.metrics = metrics
        self.nonfinite = nonfinite
        self.signals = signals
        self.output = output
        self.device = metrics.device
        self.rank = rank
        # every rank's own times, compared (None: one rank)
        self.stragglers = stragglers
        self.distributed = stragglers is not None
        self.log_every = settings.log_every
        self.skip_nonfinite = settings.nonfinite == "skip"
        self.global_batch = plan.global_batch
        self.accumulate = plan.accumulate
        self.world = plan.world_size
        self.period_s = period_s
        # each micro-batch's detached loss since the last hand-over
        self.losses: list[torch.Tensor] = []
        self._losses_from_step = step + 1
        # where the current log interval started
        self._tick = (time.perf_counter(), step)
        # (step, metric series, host values) awaiting a beat
        self._ended: list[tuple[int, dict, dict]] = []
        # (work, packed tensor, [(step, names, host values)], timed)
        self._in_flight = None
        # steps between beats: from the first beats' step times on
        self.every = 1
        # the ranks agreed to stop for a signal: once agreed, at a beat or in a flush (an evaluation's,
        # a save's), it stays agreed until the loop acts on it at the next step's end
        self.stop_agreed = False
        # where the step time of the next beat starts
        self._window = (time.perf_counter(), step)
        # this log interval's seconds in next(batches), count_tokens() sum
        self.data_wait_s = 0.0
        self.tokens = 0
        # this beat window's seconds in next(batches) and in training_step (stragglers.py)
        self.beat_data_s = 0.0
        self.forward = ForwardClock(self.device)

    def waited(self, seconds: float) -> None:
        """Seconds a micro-batch waited in next(batches)."""
        self.data_wait_s += seconds
        self.beat_data_s += seconds

    def keep_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's detached loss. With trainer.nonfinite=skip a NaN must not poison the
        logged mean, so it is weighted 0 at once (that mode syncs every step anyway)."""
        if self.skip_nonfinite:
            self.metrics.add("loss", torch.nan_to_num(loss, 0.0, 0.0, 0.0), torch.isfinite(loss).double())
        else:
            self.losses.append(loss)

    def after_step(self, step: int) -> None:
        """Close the interval when `step` ends one; otherwise keep memory bounded."""
        if step % self.log_every == 0:
            self.end(step)
        elif len(self.losses) >= FOLD:
            self.hand_over(step)

    def hand_over(self, step: int) -> None:
        """The losses kept so far join the logged 'loss' and the non-finite check, once."""
        losses = self.losses
        first = self._losses_from_step
        self.losses = []
        self._losses_from_step = step + 1
        if losses:
            self.metrics.add_all("loss", losses)
            self.nonfinite.watch(losses, first, self.accumulate)

    def end(self, step: int) -> None:
        """Close the log interval that ends at `step`: its metrics wait for the next beat."""
        self.hand_over(step)
        now, (then, since) = time.perf_counter(), self._tick
        if step == since:
            return
        lr, epoch = self.output.lr_and_epoch()
        elapsed = max(now - then, 1e-9)
        known = {
            "lr": lr,
            "samples_per_s": (step - since) * self.global_batch / elapsed,
            "epoch": epoch,
            "time": round(time.time(), 3),
            "elapsed": elapsed,
        }
        if step - since != self.log_every:
            # a line over fewer steps (the first after a resume, the last of a run) says so
            known["steps"] = step - since
        if self.device.type == "cuda":
            # the caching allocator's own count: no device sync
            known["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        # a share of the time, averaged over ranks
        self.metrics.add("data_wait", self.data_wait_s / elapsed)
        # the mean over ranks of this: their sum
        self.metrics.add("_tokens", self.tokens * self.world)
        self.data_wait_s = 0.0
        self.tokens = 0
        self._tick = (now, step)
        self._ended.append((step, self.metrics.take(), known))

    def beat(self, step: int) -> bool:
        """After every optimizer step, on every rank: on most steps nothing but a counter check.
        True when the ranks agreed to stop."""
        if not self.distributed:
            # nobody to agree with: a signal at once, lines as paced as the beat
            if self._ended and step % self.every == 0:
                self._launch(step)
                self._complete()
            return self.signals.requested
        stop = self._complete()
        if step % self.every == 0:
            self._launch(step)
        return stop

    def flush(self, step: int) -> None:
        """Every rank, at the same step: write every finished log line now."""
        self.hand_over(step)
        self._complete()
        # the steps since the last beat too: each rank's figures cover every step
        if self._ended or step > self._window[1]:
            self._launch(step)
            self._complete()
        if self.stragglers is not None:
            self.stragglers.flush(step)
        # evaluation and saving are not step time
        self.restart_clock(step)

    def restart_clock(self, step: int) -> None:
        """Step time is measured from here: what happened since the last beat was not training."""
        self._window = (time.perf_counter(), step)

    def _launch(self, step: int) -> None:
        now, (then, since) = time.perf_counter(), self._window
        self._window = (now, step)
        step_s = (now - then) / (step - since) if step > since else 0.0
        nonfinite = self.nonfinite.flag()
        if nonfinite is None:
            nonfinite = torch.zeros((), dtype=torch.float64, device=self.device)
        names, sums = pack_intervals([series for _, series, _ in self._ended], self.device)
        if self.distributed:
            _agree_on_names(names, step)
        # laid out as HEADER, each rank's slots, the sums
        slots = [0.0] * (len(FIELDS) * self.world)
        steps = step - since
        own = [step_s, self.beat_data_s / max(steps, 1), self.forward.take() / max(steps, 1)]
        slots[self.rank * len(FIELDS) : (self.rank + 1) * len(FIELDS)] = own
        self.beat_data_s = 0.0
        head = on_device([float(self.signals.requested)], torch.float64, self.device)
        packed = torch.cat([head, nonfinite.reshape(1), on_device(slots, torch.float64, self.device), sums])
        work = dist.all_reduce(packed, async_op=True) if self.distributed else None
        self._in_flight = (
            work,
            packed,
            [(s, keys, known) for (s, _, known), keys in zip(self._ended, names, strict=True)],
            (step, steps),
        )
        self._ended = []

    def _complete(self) -> bool:
        """Read the beat in flight, if any: write its lines, stop on a non-finite loss; True when
        a rank received a stop signal."""
        if self._in_flight is None:
            return self.stop_agreed
        work, packed, intervals, (step, steps) = self._in_flight
        self._in_flight = None
        if work is not None:
            work.wait()
        values = packed.tolist()
        head = dict(zip(HEADER, values, strict=False))
        at = len(HEADER) + len(FIELDS) * self.world
        if steps > 0:
            width = len(FIELDS)
            figures = [values[len(HEADER) + r * width : len(HEADER) + (r + 1) * width] for r in range(self.world)]
            step_s = statistics.fmean(f[0] for f in figures)
            self.every = max(1, min(MAX_STEPS_BETWEEN_BEATS, int(self.period_s / max(step_s, 1e-6))))
            if self.stragglers is not None:
                self.stragglers.observe(step, figures, steps)
        lines = []
        for line_step, names, known in intervals:
            metrics = {**means(names, values[at:]), **known}
            tokens = metrics.pop("_tokens", 0)
            elapsed = metrics.pop("elapsed")
            # none when the experiment counts none (count_tokens); over the time samples_per_s is over
            if tokens:
                metrics["tokens_per_s"] = tokens / elapsed
            # with the throughput, after the experiment's metrics
            metrics["data_wait"] = metrics.pop("data_wait")
            lines.append((line_step, metrics, metrics.pop("time")))
            at += 2 * len(names)
        self._write(lines)
        if head["nonfinite"] > 0:
            self.nonfinite.check()
        self.stop_agreed |= head["stop"] > 0
        return self.stop_agreed

    def _write(self, lines: list[tuple[int, dict, float]]) -> None:
        if not lines:
            return
        self.output.log.log_lines(lines, prefix="train/")
        last = lines[-1][1]
        self.output.bar.set_postfix(
            {key: shown(key, value) for key, value in last.items() if is_number(value)}, refresh=False
        )
        if self.output.echo:
            self.output.log.text("\n".join(_text_line(step, metrics) for step, metrics, _ in lines))


def _text_line(step: int, metrics: dict) -> str:
    """A log line for the console and log.txt; one over fewer steps than log_every says how many."""
    shown = {key: value for key, value in metrics.items() if key != "steps"}
    over = f" (mean of {metrics['steps']} steps)" if "steps" in metrics else ""
    return f"train step {step}{over}  " + format_metrics(shown)


def _agree_on_names(names: list[list[str]], step: int) -> None:
    """The ranks sum their metrics slot by slot, so they must log the same names: a metric named
    differently on one rank would be merged into another's, one logged on one rank only would
    misalign every slot after it. Checked at every beat by a small collective of host numbers."""
    text = "\x1e".join("\x1f".join(keys) for keys in names).encode()
    layout = [len(text), zlib.crc32(text), zlib.adler32(text)]
    if collectives.same_on_every_rank(layout, runtime.current().control_group):
        return
    logged = collectives.gather_object(sorted({key for keys in names for key in keys} - INTERNAL))
    differ = [f"rank {rank} {keys}" for rank, keys in enumerate(logged) if keys != logged[0]]
    raise ConfigError(
        f"the ranks logged different metrics in the log interval(s) up to step {step}: rank 0 {logged[0]}, "
        + ", ".join(differ),
        "log the same metric names on every rank and at the same steps (log a value a rank lacks with weight 0)",
    )
