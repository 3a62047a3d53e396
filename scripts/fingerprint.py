"""Fingerprints of three real runs: the final parameters and every logged metric, hashed.

A refactoring that is meant to change no behaviour must leave these unchanged, bit for bit:

    python scripts/fingerprint.py            # prints one line per run: name, params hash, metrics hash
    python scripts/fingerprint.py --check scripts/fingerprints.txt
    python scripts/fingerprint.py --record scripts/fingerprints.txt   # this machine's section, written anew

The bits depend on the CPU's kernels as well as on the code: two machines that both report AVX512
(an Intel Xeon and an AMD EPYC) give other bits for the same runs, since BLAS picks its kernels by
the processor. So the file holds one section per machine, headed by torch's version, the CPU
capability torch uses and the processor's model name; the check reads this machine's section.

The runs are `ddplab run bbbp -n 2 trainer.max_epochs=1`, the translation example for 12 steps and
alignment_stats for 20 steps, all on 2 gloo ranks. Wall-clock fields (time, samples/s, tokens/s,
the data-wait share, each rank's timings in the `ranks` records) are left out of the metrics hash;
everything else a run logs or exports is in it. tests/test_fingerprints.py runs the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
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


def ddplab(argv: list[str]) -> subprocess.CompletedProcess:
    """`ddplab ARGV` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "ddplab", *argv], capture_output=True, text=True, timeout=600)


def fingerprint(name: str, args: list[str], root: Path, runner=ddplab) -> str:
    """The run's line; RUNNER runs a ddplab command line (the test runs its launcher in its own process)."""
    res = runner(["run", *args, f"run.dir={root}", "run.name=fp", *QUIET])
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
    """What the bits depend on besides the code: torch's version, the CPU capability it uses and the
    processor (its BLAS kernels)."""
    return f"# torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, {processor()}"


def processor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown processor"


def sections(path: Path) -> dict[str, list[str]]:
    """The recorded fingerprints by machine line."""
    found: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("#"):
            lines = found.setdefault(line, [])
        elif line.strip():
            lines.append(line)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", help="a file of earlier fingerprints that these must equal")
    parser.add_argument("--record", help="a file to write these into, as this machine's section")
    parser.add_argument("runs", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    here = machine()
    if args.check and here not in sections(Path(args.check)):
        print(f"{args.check} holds no fingerprints of this machine ({here[2:]}): record them with --record")
        return 2
    lines = []
    print(here, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            lines.append(fingerprint(name, RUNS[name], Path(tmp)))
            print(lines[-1], flush=True)
    if args.record:
        recorded = {**sections(Path(args.record)), here: lines}
        text = "".join(header + "\n" + "".join(line + "\n" for line in body) for header, body in recorded.items())
        Path(args.record).write_text(text)
    if args.check:
        expected = {line.split()[0]: line for line in sections(Path(args.check))[here]}
        wrong = [line for line in lines if expected.get(line.split()[0]) != line]
        for line in wrong:
            print(f"DIFFERS: {line}\n   was: {expected.get(line.split()[0])}", file=sys.stderr)
        return 1 if wrong else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
