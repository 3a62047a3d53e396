import json
import time

import pytest

from helpers import DEADLINE, STARTED, kill_group


def reports(text: str, tag: str = "REPORT") -> list[dict]:
    """The JSON lines a probe target printed, sorted by rank."""
    rows = [json.loads(line.split(tag + " ", 1)[1]) for line in text.splitlines() if tag + " " in line]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.fixture
def parse_reports():
    return reports


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(request):
    """Every wait for a process ends before the test's own timeout, and a test that failed or timed
    out part-way leaves nothing running for the next one."""
    marker = request.node.get_closest_marker("timeout")
    limit = marker.args[0] if marker else request.config.getini("timeout")
    DEADLINE[0] = time.monotonic() + float(limit or "inf")
    yield
    DEADLINE[0] = float("inf")
    while STARTED:
        kill_group(STARTED.pop())
