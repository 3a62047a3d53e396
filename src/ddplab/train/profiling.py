"""`trainer.profile=START:END`: torch.profiler over optimizer steps START+1 to END on every rank.

Each rank writes a Chrome/Perfetto trace (RUN/profile/trace_rank<r>.json) and its operator table;
rank 0 prints the most expensive operators and how the window divides into waiting for data,
communication and computation. On a GPU the profiler records CUDA kernels too and the caching
allocator's history is kept over the window (memory_rank<r>.pickle, for pytorch.org/memory_viz).
The step before the window warms the profiler up (torch's `warmup`), so its first step is not skewed.

Profiling must never cost the training: a profiler that fails to start or to write says so in one
line and the run goes on. Off, it is not among the trainer's capabilities and nothing is called."""

import contextlib
import os
import tempfile
import warnings

import torch

from .. import environment
from ..config_rules import check_window, parse_window
from ..errors import ConfigError
from .capability import Capability

# the operators rank 0 lists
TOP_OPERATORS = 8
# what counts as waiting for data and as communication, by the names torch records
DATA_EVENTS = ("enumerate(DataLoader)",)
COMM_EVENTS = ("gloo:", "nccl:", "nccl", "ncclDevKernel", "ncclKernel")


class StepProfiler(Capability):
    """Built before training, told the step it starts at (`before_training`), then `after_step(step)`
    with each step reached."""

    @classmethod
    def from_settings(cls, settings, run_dir: str, rank: int, device, total: int | None, say):
        """The run's profiler, or None without trainer.profile; a window past the run's `total` steps
        is refused now. `say` prints a line (rank 0 only)."""
        window = parse_window(settings.profile)
        if window is None:
            return None
        check_window(settings.profile, total)
        return cls(window, settings.profile_dir or os.path.join(run_dir, "profile"), rank, device, say)

    def __init__(self, window: tuple[int, int], folder: str, rank: int, device: torch.device, say):
        self.start, self.end = window
        self.folder = folder
        self.rank = rank
        self.cuda = device.type == "cuda"
        # print a line (rank 0 only)
        self.say = say
        self.warmup = 1 if self.start >= 1 else 0
        self._profiler = None
        self.done = False

    def before_training(self, step: int) -> None:
        """Started now when the window begins at `step`; a resumed run past its start is not profiled (it says so)."""
        if note := self.skipped_by_resume(step):
            self.say(note)
            return
        check_writable(self.folder)
        self.after_step(step)

    def after_step(self, step: int) -> None:
        if self.done:
            return
        try:
            if self._profiler is None and step == self.start - self.warmup:
                self._begin()
            elif self._profiler is not None:
                self._profiler.step()
                if step == self.end:
                    self._finish()
        except Exception as e:
            self._give_up(step, e)

    def skipped_by_resume(self, step: int) -> str | None:
        """A run resumed inside or after the window: it is not profiled (a partial window would mislead)."""
        if step > self.start - self.warmup:
            self.done = True
            later = f"{step + 1}:{step + 1 + self.end - self.start}"
            return (
                f"trainer.profile={self.start}:{self.end} is not profiled: the run resumed at step {step}, "
                f"past its start (profile later steps, e.g. trainer.profile={later})"
            )
        return None

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        # kineto prints a line per rank at each start and stop: the report says what matters
        os.environ.setdefault(environment.KINETO_LOG_LEVEL, "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # the trace's ProfilerStep#N are the run's step numbers: its schedule skips the steps before
        first = self.start - self.warmup + 1
        with warnings.catch_warnings():
            # a window from step 0 has no step before it to warm up on
            warnings.simplefilter("ignore", UserWarning)
            steps = schedule(skip_first=first, wait=0, warmup=self.warmup, active=self.end - self.start, repeat=1)
        self._profiler = profile(
            activities=activities, schedule=steps, on_trace_ready=self._save, profile_memory=self.cuda
        )
        self._profiler.step_num = first
        self._profiler.current_action = steps(first)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profiler.start()

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        self.done = True
        profiler.stop()
        if self.cuda:
            torch.cuda.memory._dump_snapshot(os.path.join(self.folder, f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def _save(self, profiler) -> None:
        """torch calls this when the window's last step is recorded."""
        profiler.export_chrome_trace(os.path.join(self.folder, f"trace_rank{self.rank}.json"))
        averages = profiler.key_averages()
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        with open(os.path.join(self.folder, f"operators_rank{self.rank}.txt"), "w") as f:
            f.write(averages.table(sort_by=sort_by, row_limit=50))
        if self.rank == 0:
            self.say(window_report(averages, (self.start, self.end), self.folder, self.cuda))

    def _give_up(self, step: int, e: Exception) -> None:
        self.done = True
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            with contextlib.suppress(Exception):
                profiler.stop()
        self.say(f"step {step}: profiling stopped ({type(e).__name__}: {e}); training goes on without it")


def check_writable(folder: str) -> None:
    """The trace folder can be made and written: found before training, not at the window's end."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(
            f"the profile folder {folder} cannot be written ({e.strerror or e})",
            "set trainer.profile_dir to a folder this user can write, or leave it empty for RUN/profile",
        ) from None


def window_report(averages, window: tuple[int, int], folder: str, cuda: bool) -> str:
    """Rank 0's lines: where the window's time went, and the most expensive operators."""
    steps = [e for e in averages if e.key.startswith("ProfilerStep")]
    wall = sum(e.cpu_time_total for e in steps) or 1.0
    data = sum(e.cpu_time_total for e in averages if e.key.startswith(DATA_EVENTS))
    if cuda:
        comm = sum(e.self_device_time_total for e in averages if e.key.startswith(COMM_EVENTS))
        busy = sum(e.self_device_time_total for e in averages) - comm
        compute = f"the GPU computes {100 * busy / wall:.0f} %"
    else:
        comm = sum(e.cpu_time_total for e in averages if e.key.startswith(COMM_EVENTS))
        compute = f"computation and the rest {100 * max(0.0, 1 - (data + comm) / wall):.0f} %"
    self_time = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = sorted((e for e in averages if not e.key.startswith("ProfilerStep")), key=lambda e: -getattr(e, self_time))[
        :TOP_OPERATORS
    ]
    start, end = window
    lines = [
        f"profile of steps {start + 1}-{end}: one trace per rank in {folder} (open in ui.perfetto.dev)",
        f"  {wall / 1000:.1f} ms on rank 0: waiting for data {100 * data / wall:.0f} %, communication "
        f"{100 * comm / wall:.0f} % (DDP overlaps it with the backward), {compute}",
        "  self time   share   calls  operator",
    ]
    for e in ops:
        spent = getattr(e, self_time)
        lines.append(f"  {spent / 1000:7.2f} ms {100 * spent / wall:5.1f} % {e.count:7d}  {e.key[:70]}")
    return "\n".join(lines)
