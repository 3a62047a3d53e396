"""The fingerprints of three real runs (scripts/fingerprint.py): a change meant to keep behaviour
keeps every parameter and every logged number, bit for bit. Bits depend on torch's CPU kernels as
well as on the code, so the check runs where the machine matches the one that recorded them."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "scripts" / "fingerprints.txt"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_real_runs_keep_their_recorded_fingerprints():
    here = f"# torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}"
    recorded = RECORDED.read_text().splitlines()[0]
    if recorded != here:
        pytest.skip(f"fingerprints were recorded with {recorded[2:]}; this machine has {here[2:]}")
    script = [sys.executable, "scripts/fingerprint.py", "--check", str(RECORDED)]
    res = subprocess.run(script, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(res.stdout.splitlines()) == 4
