"""trainer.profile's parts (train/profiling.py) in this process: the window a real torch.profiler
records when driven as the loop drives it, rank 0's report worked out from known event times, a
resume past the window, a folder that breaks, and the settings that start nothing. Profiling real
ranks is test_profiling.py's; these are the fast tests the mutation run of the module uses."""

import json
import os
import re
import shutil
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from ddplab.errors import ConfigError
from ddplab.train import profiling
from ddplab.train.profiling import StepProfiler, window_report

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _profiler_off_after_each_test():
    """A test that fails inside a window leaves torch's profiler on, and the next profiler to start
    (or the interpreter's exit) would then crash the test process instead of reporting the failure."""
    yield
    if torch.autograd._profiler_enabled():
        torch.autograd._disable_profiler()


def _train(profiler, steps: int, first: int = 0) -> None:
    """The loop's calls: after_step(step reached) before the first step, then after each step."""
    weights = torch.randn(16, 16)
    for step in range(first + 1, steps + 1):
        # the profiler records the window's steps only (the step before it warms up, unrecorded)
        recording = profiler.start < step <= profiler.end and not profiler.done
        assert torch.autograd._profiler_enabled() is recording
        # each step's work, named by its step number
        with torch.profiler.record_function(f"work of step {step}"):
            (weights @ weights).sum()
        profiler.after_step(step)
        if step == profiler.end:
            # stopped at the window's last step, not later
            assert profiler._profiler is None and profiler.done


def _steps_in(trace) -> list[str]:
    """The trace's steps: torch's ProfilerStep#N and the work the test named, as step numbers."""
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    steps = sorted(int(name.split("#")[1]) for name in names if name.startswith("ProfilerStep#"))
    work = sorted(int(name.split()[-1]) for name in names if name.startswith("work of step "))
    assert steps == work, (steps, work)
    return [f"ProfilerStep#{n}" for n in steps]


def _begun(settings, run_dir: str, total: int, step: int, say) -> StepProfiler | None:
    """The profiler as the trainer holds it: built from the settings, then told the step training starts at."""
    profiler = StepProfiler.from_settings(settings, run_dir, 0, CPU, total, say)
    if profiler is not None:
        profiler.before_training(step)
    return profiler


@pytest.mark.parametrize(("window", "warmup"), [((3, 5), 1), ((1, 3), 1), ((0, 2), 0)])
def test_the_trace_holds_exactly_the_windows_steps_by_their_run_numbers(tmp_path, window, warmup):
    said = []
    settings = SimpleNamespace(profile=f"{window[0]}:{window[1]}", profile_dir="")
    profiler = _begun(settings, str(tmp_path), 8, 0, said.append)
    assert profiler.warmup == warmup and not profiler.done
    _train(profiler, 8)
    folder = tmp_path / "profile"
    assert _steps_in(folder / "trace_rank0.json") == [f"ProfilerStep#{n}" for n in range(window[0] + 1, window[1] + 1)]
    table = (folder / "operators_rank0.txt").read_text()
    assert "aten::mm" in table
    # the operators by their own CPU time, most first
    rows = [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[3:] if line and not line.startswith("-")]
    shares = [float(row[1].rstrip("%")) for row in rows if len(row) > 2 and row[1].endswith("%")]
    assert len(shares) > 3 and shares == sorted(shares, reverse=True)
    (report,) = said
    assert report.startswith(f"profile of steps {window[0] + 1}-{window[1]}: one trace per rank in {folder} (open in")
    assert profiler.done and profiler._profiler is None


def test_only_rank_0_reports_and_every_rank_writes_its_own_files(tmp_path):
    said = []
    profiler = StepProfiler((2, 4), str(tmp_path), 1, CPU, said.append)
    profiler.after_step(0)
    _train(profiler, 6)
    assert said == []
    assert sorted(os.listdir(tmp_path)) == ["operators_rank1.txt", "trace_rank1.json"]


def test_a_run_resumed_at_or_past_the_windows_start_is_not_profiled_and_says_which_window_to_use(tmp_path):
    said = []
    settings = SimpleNamespace(profile="4:10", profile_dir=str(tmp_path / "p"))
    assert _begun(settings, str(tmp_path), 40, 13, said.append).done
    assert said == [
        "trainer.profile=4:10 is not profiled: the run resumed at step 13, past its start (profile later steps, "
        "e.g. trainer.profile=14:20)"
    ]
    assert not (tmp_path / "p").exists()
    # resumed at the warm-up step: it would miss the warm-up
    late = StepProfiler((10, 15), "", 0, CPU, print)
    assert late.skipped_by_resume(10) is not None and late.done
    # resumed just before it: the whole window is still ahead
    profiler = StepProfiler((10, 15), str(tmp_path), 0, CPU, print)
    assert profiler.skipped_by_resume(9) is None and not profiler.done
    assert StepProfiler((0, 5), "", 0, CPU, print).skipped_by_resume(0) is None


def test_a_resumed_run_before_the_window_profiles_it(tmp_path):
    said = []
    # into a folder that is already there
    settings = SimpleNamespace(profile="6:8", profile_dir=str(tmp_path))
    profiler = _begun(settings, "", 10, 4, said.append)
    _train(profiler, 10, first=4)
    assert _steps_in(tmp_path / "trace_rank0.json") == ["ProfilerStep#7", "ProfilerStep#8"]


def test_without_a_window_nothing_starts(tmp_path):
    assert _begun(SimpleNamespace(profile="", profile_dir=""), str(tmp_path), 10, 0, print) is None
    assert os.listdir(tmp_path) == []


def test_a_window_past_the_run_or_a_folder_that_cannot_be_made_is_one_line_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.profile=5:12 ends after the run's last step \(10\)"):
        _begun(SimpleNamespace(profile="5:12", profile_dir=""), str(tmp_path), 10, 0, print)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError) as refused:
        _begun(SimpleNamespace(profile="1:2", profile_dir=str(tmp_path / "file" / "p")), "", 10, 0, print)
    assert refused.value.cause == f"the profile folder {tmp_path / 'file' / 'p'} cannot be written (Not a directory)"
    assert refused.value.fix.startswith("set trainer.profile_dir to a folder this user can write")


def test_a_folder_that_breaks_in_the_window_costs_the_profile_not_the_training(tmp_path):
    said = []
    folder = tmp_path / "p"
    profiler = _begun(SimpleNamespace(profile="2:4", profile_dir=str(folder)), "", 10, 0, said.append)
    _train(profiler, 3)
    shutil.rmtree(folder)
    _train(profiler, 10, first=3)
    (line,) = said
    assert line.startswith("step 4: profiling stopped (") and line.endswith("); training goes on without it")
    assert profiler.done and profiler._profiler is None
    # the profiler was stopped: another one can start
    second = StepProfiler((0, 1), str(tmp_path), 0, CPU, said.append)
    second.after_step(0)
    _train(second, 2)
    assert (tmp_path / "trace_rank0.json").exists()


@dataclass
class Event:
    """One row of torch.profiler's key_averages(): the times torch records, in microseconds."""

    key: str
    cpu_time_total: float = 0.0
    self_cpu_time_total: float = 0.0
    self_device_time_total: float = 0.0
    count: int = 1


def test_the_report_divides_the_window_into_data_communication_and_computation():
    events = [
        Event("ProfilerStep#4", cpu_time_total=6000, self_cpu_time_total=100),
        Event("ProfilerStep#5", cpu_time_total=4500, self_cpu_time_total=50),
        Event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1000, 900, count=2),
        Event("gloo:all_reduce", 2000, 1500, count=4),
        Event("aten::mm", 3000, 2345, count=8),
        Event("aten::add", 500, 250, count=16),
    ]
    report = window_report(events, (3, 5), "RUN/profile", cuda=False).splitlines()
    # the window: 10.5 ms of steps, 1 ms of it in the data loader, 2 ms in gloo
    assert report == [
        "profile of steps 4-5: one trace per rank in RUN/profile (open in ui.perfetto.dev)",
        "  10.5 ms on rank 0: waiting for data 10 %, communication 19 % (DDP overlaps it with the backward), "
        "computation and the rest 71 %",
        "  self time   share   calls  operator",
        "     2.35 ms  22.3 %       8  aten::mm",
        "     1.50 ms  14.3 %       4  gloo:all_reduce",
        "     0.90 ms   8.6 %       2  enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
        "     0.25 ms   2.4 %      16  aten::add",
    ]


def test_a_window_of_a_second_reports_its_shares_and_times_to_their_last_digit():
    events = [
        Event("ProfilerStep#11", cpu_time_total=600_000),
        Event("ProfilerStep#12", cpu_time_total=450_000),
        Event("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 630_000, 9_000, count=2),
        Event("gloo:all_reduce", 205_000, 150_000, count=6),
        Event("aten::mm", 640_000, 630_000, count=8),
        Event("aten::add", 3_000, 2_500, count=16),
    ]
    report = window_report(events, (10, 12), "f", cuda=False).splitlines()
    # 1.05 s of steps: 60 % waiting for data, 19.5 % in gloo, the rest 20.5 %
    assert report[1] == (
        "  1050.0 ms on rank 0: waiting for data 60 %, communication 20 % (DDP overlaps it with the backward), "
        "computation and the rest 20 %"
    )
    assert report[3:] == [
        "   630.00 ms  60.0 %       8  aten::mm",
        "   150.00 ms  14.3 %       6  gloo:all_reduce",
        "     9.00 ms   0.9 %       2  enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
        "     2.50 ms   0.2 %      16  aten::add",
    ]


def test_the_report_lists_the_most_expensive_operators_only_and_never_a_negative_share():
    events = [Event("ProfilerStep#1", cpu_time_total=1000)]
    events += [Event(f"op{i}", self_cpu_time_total=10 * i, count=1) for i in range(12)]
    # data and communication overlap (threads): their sum may pass the wall time
    events += [Event("enumerate(DataLoader)#x", cpu_time_total=700), Event("gloo:broadcast", cpu_time_total=600)]
    report = window_report(events, (0, 1), "f", cuda=False).splitlines()
    assert report[1].endswith("waiting for data 70 %, communication 60 % (DDP overlaps it with the backward), "
                              "computation and the rest 0 %")  # fmt: skip
    assert [line.split()[-1] for line in report[3:]] == [f"op{i}" for i in range(11, 3, -1)]
    assert len(report) == 3 + profiling.TOP_OPERATORS


def test_on_a_gpu_the_report_counts_device_time():
    events = [
        Event("ProfilerStep#1", cpu_time_total=8000),
        Event("ncclDevKernel_AllReduce_Sum_f32", self_device_time_total=2000, count=3),
        Event("nccl:all_reduce", self_device_time_total=0, self_cpu_time_total=5000),
        Event("sm90_gemm", self_device_time_total=3000, self_cpu_time_total=10, count=6),
        Event("enumerate(DataLoader)#y", cpu_time_total=800),
    ]
    report = window_report(events, (0, 1), "f", cuda=True).splitlines()
    assert report[1] == (
        "  8.0 ms on rank 0: waiting for data 10 %, communication 25 % (DDP overlaps it with the backward), "
        "the GPU computes 38 %"
    )
    assert report[3:5] == [
        "     3.00 ms  37.5 %       6  sm90_gemm",
        "     2.00 ms  25.0 %       3  ncclDevKernel_AllReduce_Sum_f32",
    ]


def test_an_empty_window_reports_without_dividing_by_zero():
    report = window_report([], (0, 1), "f", cuda=False).splitlines()
    assert report[1] == (
        "  0.0 ms on rank 0: waiting for data 0 %, communication 0 % (DDP overlaps it with the backward), "
        "computation and the rest 100 %"
    )


def test_an_operator_with_a_long_name_is_cut_to_70_characters():
    name = "aten::" + "x" * 64 + "_cut_here"
    report = window_report([Event("ProfilerStep#1", cpu_time_total=100), Event(name, 50, 50)], (0, 1), "f", False)
    assert report.splitlines()[3].endswith("  " + name[:70]) and len(name[:70]) == 70
