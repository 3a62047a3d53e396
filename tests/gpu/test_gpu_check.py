"""`make gpu-check` (scripts/gpu_check.py), prepared where no GPU is: without CUDA it says what it
would run and exits 0; its rehearsal on the CPU runs the determinism part for real (straight twice,
killed and resumed, twice with determinism off) and writes each result as a JSON line."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, STARTED, clean_env, finish

SCRIPT = str(REPO / "scripts" / "gpu_check.py")


def _check(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(CUDA_VISIBLE_DEVICES=""),
        cwd=str(REPO),
        start_new_session=True,
    )
    STARTED.append(proc)
    return finish(proc, timeout, "gpu_check")


@pytest.mark.timeout(60)
def test_without_cuda_it_says_what_it_would_run_and_exits_0(tmp_path):
    code, out, err = _check("--out", str(tmp_path))
    assert code == 0, out + err
    assert out.startswith("gpu-check: no CUDA device here, nothing measured")
    for part in ("environment", "determinism", "step", "oom", "snapshot", "lane"):
        assert f"\n  {part} " in out
    assert not any(tmp_path.iterdir())
    code, out, err = _check("--parts", "determinism,speed")
    assert code == 2 and err.strip() == (
        "gpu-check: error: unknown part 'speed'; choose from environment, determinism, step, oom, snapshot, lane"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rehearsal_runs_the_determinism_part_and_writes_each_result_as_it_comes(tmp_path):
    code, out, err = _check(
        "--cpu-rehearsal",
        "--out",
        str(tmp_path),
        "--parts",
        "environment,determinism",
        "--determinism",
        "bbbp:fp32",
        timeout=280,
    )
    assert code == 0, out + err
    rows = [json.loads(line) for line in (tmp_path / "gpu-check.jsonl").read_text().splitlines()]
    assert [row["part"] for row in rows] == ["environment", "determinism"]
    found = rows[1]
    assert found["what"] == "bbbp fp32" and found["status"] == "bitwise", found
    assert found["twice_max_diff"] == 0.0 and found["killed_resumed_max_diff"] == 0.0
    assert "off_twice_max_diff" in found
    # the table last, also in its file
    assert out.rstrip().endswith((tmp_path / "gpu-check.md").read_text().rstrip())
