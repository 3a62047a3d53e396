"""The fingerprints of three real runs (scripts/fingerprint.py): a change meant to keep behaviour
keeps every parameter and every logged number, bit for bit. Bits depend on torch's CPU kernels as
well as on the code (an Intel and an AMD processor that both report AVX512 differ), so the check
runs where scripts/fingerprints.txt holds a section recorded on this kind of machine."""

import sys
from pathlib import Path

import pytest

from helpers import ddplab_here

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "scripts" / "fingerprints.txt"
sys.path.insert(0, str(REPO / "scripts"))
import fingerprint  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_real_runs_keep_their_recorded_fingerprints(tmp_path):
    here, recorded = fingerprint.machine(), fingerprint.sections(RECORDED)
    if here not in recorded:
        pytest.skip(f"no fingerprints were recorded on this machine ({here[2:]}); recorded: {', '.join(recorded)}")
    # the runs `python scripts/fingerprint.py --check` makes, each launcher in this process (ddplab_here)
    runner = lambda argv: ddplab_here(*argv)  # noqa: E731
    lines = [fingerprint.fingerprint(name, args, tmp_path, runner) for name, args in fingerprint.RUNS.items()]
    assert lines == recorded[here] and len(lines) == 3
