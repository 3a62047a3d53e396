"""Where the suite's CPU goes, test by test: `make test-cpu` (or `pytest -p suite_cpu` with scripts/
on PYTHONPATH) records each test's own CPU and that of the processes it started and waited for
(`getrusage`: a launcher counts its workers, the test counts the launcher), then
`python scripts/suite_cpu.py FILE` prints the dearest modules and tests.

The suite is bound by CPU on CI's two cores (docs/testing.md): wall-clock figures move with the
machine's load, CPU seconds far less, and almost all of them are processes started."""

import argparse
import collections
import json
import os
import resource
import sys
import time

import pytest

RECORD = os.environ.get("SUITE_CPU_RECORD", "suite-cpu.jsonl")


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime + _kept_server_cpu()


def _kept_server_cpu() -> float:
    """The CPU so far of the fork server this process keeps between launches (launch/fork_server.py)
    and of the workers it forked and waited for: counted as it is spent, not all at the test that
    happens to stop the server. Once stopped, the same seconds are in RUSAGE_CHILDREN instead."""
    forks = sys.modules.get("ddplab.launch.fork_server")
    server = forks.helpers()[0] if forks is not None else None
    try:
        with open(f"/proc/{server}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    # utime, stime, cutime, cstime: the 14th to 17th fields, the 3rd being the first after the name
    return sum(int(ticks) for ticks in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, (own, waited) = time.monotonic(), _cpu()
    yield
    end_own, end_waited = _cpu()
    row = {"id": item.nodeid, "wall": time.monotonic() - start, "own": end_own - own, "waited": end_waited - waited}
    # one write of one line: the pytest-xdist workers append to the same file
    with open(RECORD, "a") as f:
        f.write(json.dumps(row) + "\n")


def report(rows: list[dict], top: int) -> str:
    """The totals, the dearest modules and the dearest tests, CPU seconds first."""
    for row in rows:
        row["cpu"] = row["own"] + row["waited"]
    lines = [
        f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.0f} s of CPU, {sum(r['wall'] for r in rows):.0f} s of "
        "wall time added over the pytest workers",
        "",
        "   cpu    wall  tests  module",
    ]
    modules = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        module = modules[row["id"].split("::")[0]]
        module[0] += row["cpu"]
        module[1] += row["wall"]
        module[2] += 1
    for name, (cpu, wall, count) in sorted(modules.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"{cpu:6.0f}  {wall:6.0f}  {count:5d}  {name}")
    lines += ["", "   cpu    wall  test"]
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        lines.append(f"{row['cpu']:6.1f}  {row['wall']:6.1f}  {row['id']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description="print where a recorded suite's CPU went")
    parser.add_argument("record", nargs="?", default=RECORD)
    parser.add_argument("--top", type=int, default=30, help="modules and tests shown (default 30)")
    args = parser.parse_args()
    with open(args.record) as f:
        rows = [json.loads(line) for line in f]
    print(report(rows, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
