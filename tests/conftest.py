import contextlib
import faulthandler
import functools
import json
import os
import time

# Tests mean the CPU, as in CI, unless `make test-gpu` runs the gpu-marked ones (DDPLAB_TEST_GPU=1):
# hidden before torch loads, the GPUs of a GPU machine are invisible to this process and every one it
# starts, so CPU tests keep their meaning and no worker initialises CUDA it will not use.
if not os.environ.get("DDPLAB_TEST_GPU"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Two tests run at a time on CI's 2 cores, so an OpenMP thread often waits for a peer thread that is
# not running. By default a waiting thread first spins, holding a core the other test needs: a
# one-process run of the translation example took 4.2 s of CPU alone and 41 s beside two busy
# loops. Waiting threads sleep instead, in this process and in every process it starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ddplab's command line quiets torch's C++ log before torch loads (launch/cli.py), and the suite runs
# ddplab's commands in this process too (helpers.ddplab_here): torch loads here as it would there.
# The processes the suite starts get the environment as it was.
_CPP_LOG = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers import DEADLINE, SLOWDOWN, STARTED, kill_group  # noqa: E402

if _CPP_LOG is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]


def reports(text: str, tag: str = "REPORT") -> list[dict]:
    """The JSON lines a probe target printed, sorted by rank."""
    rows = [json.loads(line.split(tag + " ", 1)[1]) for line in text.splitlines() if tag + " " in line]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.fixture
def parse_reports():
    return reports


@functools.cache
def _terminal(config) -> int:
    """The terminal's stderr (a copy of its descriptor): pytest captures fd 2 while tests run, and a
    dump written there would be lost with the process."""
    capture = config.pluginmanager.getplugin("capturemanager")
    # None with pytest -p no:capture, where fd 2 is the terminal already
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        return os.dup(2)


# The slow marker is true: a test that may run longer than a minute (its timeout is above 60 s) is
# marked slow, so `make test-fast` (-m "not slow") leaves out exactly those.
SLOW_S = 60


def _limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0] if marker else item.config.getini("timeout") or "inf")


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items if _limit(item) > SLOW_S and not item.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) may run over {SLOW_S} s without the slow marker, e.g. {unmarked[0]}: "
            "mark them @pytest.mark.slow, or give them a timeout of at most 60 s"
        )
    # on a busy machine every test's timeout scales (helpers.SLOWDOWN); the slow marker follows the
    # timeout a test asks for, above
    if SLOWDOWN > 1:
        for item in items:
            if (limit := _limit(item)) != float("inf"):
                item.add_marker(pytest.mark.timeout(limit * SLOWDOWN), append=False)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request):
    """Every wait for a process ends before the test's own timeout, and a test that failed or timed
    out part-way leaves nothing running for the next one."""
    marker = request.node.get_closest_marker("timeout")
    limit = marker.args[0] if marker else request.config.getini("timeout")
    DEADLINE[0] = time.monotonic() + float(limit or "inf")
    # pytest-timeout's signal reaches a test only when it runs Python again: one stuck inside a C++
    # wait (a gloo collective that never completes) would hold the suite forever. A minute past the
    # test's timeout, every thread's stack is printed and the suite ends failed, naming the hang.
    if limit:
        faulthandler.dump_traceback_later(float(limit) + 60, exit=True, file=_terminal(request.config))
    yield
    faulthandler.cancel_dump_traceback_later()
    DEADLINE[0] = float("inf")
    while STARTED:
        kill_group(STARTED.pop())


@pytest.fixture(autouse=True)
def no_run_outlives_its_test():
    """A run in the test's own process (a fit(), ddplab_here) that ended, failed or not, leaves
    neither its runtime nor its run folder's lock behind: a notebook that trains twice, or the next
    test in this process, would find them."""
    yield
    import sys

    rundir, runtime = sys.modules.get("ddplab.train.rundir"), sys.modules.get("ddplab.distributed.runtime")
    held = list(rundir._HELD) if rundir else []
    current = runtime is not None and runtime._current is not None
    for path in held:
        rundir.release_run_dir(path)
    left = (["its runtime"] if current else []) + [f"the lock of {path}" for path in held]
    assert not left, f"a run in the test's process left {', '.join(left)} behind"


@pytest.fixture
def gloo_group(tmp_path):
    """A gloo process group of one in this process (a file store in the test's folder), for code
    that needs a group but no peer: DDP's constructor, collectives of one."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(params=["single", "gloo"])
def world(request, tmp_path_factory):
    """A world of one without a process group, and one with a gloo group: the second runs DDP and
    the loop's distributed path (the asynchronous heartbeat every few steps)."""
    if request.param == "gloo":
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield request.param
    if dist.is_initialized():
        dist.destroy_process_group()
