"""Fingerprints of three real runs: the final parameters and every logged metric, hashed.

A refactoring that is meant to change no behaviour must leave these unchanged, bit for bit:

    python scripts/fingerprint.py            # prints one line per run: name, params hash, metrics hash
    python scripts/fingerprint.py --check scripts/fingerprints.txt

The runs are `ddplab run bbbp -n 2 trainer.max_epochs=1`, the translation example for 12 steps and
alignment_stats for 20 steps, all on 2 gloo ranks. Wall-clock fields (time, samples/s, tokens/s,
the data-wait share, each rank's timings in the `ranks` records) are left out of the metrics hash;
everything else a run logs or exports is in it. tests/test_fingerprints.py runs the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

QUIET = ["trainer.progress=false", "log.tensorboard=false"]
RUNS = {
    "bbbp": ["bbbp", "-n", "2", "trainer.max_epochs=1"],
    "translation": [
        "translation",
        "-n",
        "2",
        "data.n_train=512",
        "data.n_valid=37",
        "model.d_model=32",
        "model.feedforward=64",
        "model.heads=2",
        "model.encoder_layers=1",
        "model.decoder_layers=1",
        "trainer.global_batch_size=64",
        "trainer.max_steps=12",
        "trainer.log_every=4",
        "trainer.eval_every=6",
        "trainer.eval_batch_size=8",
        "data.examples=2",
        "optim.decay=inverse_sqrt",
    ],
    "alignment_stats": [
        "alignment_stats",
        "-n",
        "2",
        "model.replicates=2",
        "trainer.max_steps=20",
        "analysis.measure_every=5",
        "analysis.fractions=[0.2,0.5,0.8]",
        "analysis.plots=false",
    ],
}
WALL_CLOCK = (
    "time",
    "train/time",
    "train/samples_per_s",
    "train/tokens_per_s",
    "train/data_wait",
    "started_at",
    # each rank's waiting and forward times (the slow-rank watch)
    "ranks",
)


def fingerprint(name: str, args: list[str], root: Path) -> str:
    cmd = [sys.executable, "-m", "ddplab", "run", *args, f"run.dir={root}", "run.name=fp", *QUIET]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stdout}\n{res.stderr}")
    run = root / args[0] / "fp"
    params = hashlib.sha256()
    for file in sorted((run / "final").glob("*.safetensors")):
        # the tensors, by name: not the file's header, whose metadata may grow (tied names)
        tensors = load_file(file)
        for key in sorted(tensors):
            params.update(key.encode() + tensors[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for file in sorted((run / "results").glob("*.npz")):
        params.update(file.read_bytes())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    clean = [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in rows]
    # a record of timings alone leaves its step only: when such records come is a matter of time too
    clean = [row for row in clean if set(row) != {"step"}]
    metrics = hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).hexdigest()
    return f"{name} params {params.hexdigest()[:16]} metrics {metrics[:16]} lines {len(clean)}"


def machine() -> str:
    """What the bits depend on besides the code: torch's version and the CPU kernels it picked."""
    return f"# torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", help="a file of earlier fingerprints that these must equal")
    parser.add_argument("runs", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    lines = []
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            lines.append(fingerprint(name, RUNS[name], Path(tmp)))
            print(lines[-1], flush=True)
    if args.check:
        recorded = Path(args.check).read_text().splitlines()
        expected = {line.split()[0]: line for line in recorded if line.strip() and not line.startswith("#")}
        wrong = [line for line in lines if expected.get(line.split()[0]) != line]
        for line in wrong:
            print(f"DIFFERS: {line}\n   was: {expected.get(line.split()[0])}", file=sys.stderr)
        return 1 if wrong else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
