"""scripts/suite_cpu.py: each test's CPU, its own and its waited-for processes', recorded by the
plugin in a real pytest run and reported dearest first."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, clean_env

TESTS = """
import subprocess, sys

SPIN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"

def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)

def test_spins_here():
    import time
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
"""


@pytest.mark.slow
def test_each_tests_cpu_is_recorded_with_its_processes_and_reported_dearest_first(tmp_path):
    (tmp_path / "test_spin.py").write_text(TESTS)
    record = tmp_path / "cpu.jsonl"
    env = clean_env(PYTHONPATH=str(REPO / "scripts"), SUITE_CPU_RECORD=str(record))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p", "no:cacheprovider", "-o", "addopts="]
    res = subprocess.run([*command, "test_spin.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {row["id"]: row for row in map(json.loads, record.read_text().splitlines())}
    child, here = rows["test_spin.py::test_spins_in_a_child"], rows["test_spin.py::test_spins_here"]
    assert child["waited"] >= 0.6 and here["own"] >= 0.3 and here["waited"] == 0
    shown = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "suite_cpu.py"), str(record)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("2 tests:") and "test_spin.py" in lines[3]
    tests = [line.split()[-1] for line in lines[lines.index("   cpu    wall  test") + 1 :]]
    assert tests == ["test_spin.py::test_spins_in_a_child", "test_spin.py::test_spins_here"]
