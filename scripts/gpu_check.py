"""`make gpu-check`: what ddplab must show on a CUDA GPU, in one command that fits a short lease of
GPU time (9 minutes by default, start-up not included), each result written the moment it is known,
so a run cut off still reports what it reached.

    python scripts/gpu_check.py [--budget 540] [--out DIR] [--parts determinism,step] [--cpu-rehearsal]

The parts, in order, each with its own time limit (a part past it is stopped and said so):

    environment   the device, torch and CUDA versions
    determinism   bbbp in fp32 and translation in bf16, trainer.deterministic=true: the same command
                  twice, and a run SIGKILLed mid-epoch and resumed, against the straight run, bit for
                  bit; the largest difference between two runs with it off
    step          ddplab's step over the raw loop's, the gpt workload first, then the small and the
                  wide, eager and compiled (benchmarks/bench_gpu.py, one round each, the gpt eager two;
                  Fabric and Accelerate only in `make bench-gpu`, a lease fits too few of them)
    oom           a real CUDA out-of-memory backed off (tests/gpu/test_gpu_oom.py)
    snapshot      a profile on the GPU with its memory snapshot written (tests/gpu/test_gpu_profiling.py)
    lane          the CUDA cases of CPU test modules (checkpoints, the log interval, batches), then the
                  gpu lane (tests/gpu/test_gpu.py, tests/gpu/test_gpu_scaling.py)

Results: OUT/gpu-check.jsonl (a JSON line per result, written as it comes) and OUT/gpu-check.md (the
table, also the last lines printed). OUT is $OUT when set, else gpu-check/. Without CUDA it says
what it would run and exits 0; --cpu-rehearsal runs every part on the CPU with tiny settings, a
check of this script that measures nothing."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# part -> its own time limit in seconds (the budget's end cuts any of them shorter)
# sized on two H100 leases (torch 2.11): two determinism pairs took 71-83 s; the GPT's eager and
# compiled rounds 150 s for four contender runs (a compiled one about 50 s); oom 27-33 s, snapshot
# 19-22 s; the lane about 15 s a test, so the budget's end, not its limit, cuts the lane: what it
# reached is still counted
LIMITS = {"environment": 20, "determinism": 100, "step": 180, "oom": 45, "snapshot": 30, "lane": 210}
# steps of each determinism run, checkpoint interval, and the step before which one run is killed:
# 13 is inside an epoch of either experiment (bbbp: 5 or 6 steps an epoch; translation: 78)
STEPS, EVERY, DIE_AT = 16, 5, 13
TARGETS = {
    "bbbp": "scripts/gpu_check_experiments.py:CheckedBBBP",
    "translation": "scripts/gpu_check_experiments.py:CheckedTranslation",
}
# the rehearsal's runs take one thread each: five share two cores, and a CPU sum's partial sums follow
# the number of threads that actually ran, so two busy runs could round apart without any GPU in play
REHEARSAL = ["dist.cpu_threads=1"]
# the rehearsal's sizes: seconds on two CPU cores
TINY = {
    "bbbp": [
        "model.embedding_dim=8",
        "model.hidden=8",
        "model.num_layers=1",
        "data.max_len=48",
        "trainer.global_batch_size=64",
    ],
    "translation": [
        "data.n_train=512",
        "data.n_valid=16",
        "model.d_model=16",
        "model.heads=2",
        "model.encoder_layers=1",
        "model.decoder_layers=1",
        "model.feedforward=32",
        "trainer.global_batch_size=32",
        "trainer.eval_batch_size=16",
    ],
}
# most telling first: the workload users bring most, then the step-bound small one, then the wide.
# (workload, precision, compiled, rounds): the GPT in eager mode twice, the second round with ddplab
# first, since single rounds on two H100 leases put ddplab at 0.98x and 1.08x the raw loop
STEP_CONFIGS = [
    ("gpt", "bf16", 0, 2),
    ("gpt", "bf16", 1, 1),
    ("small", "fp32", 0, 1),
    ("wide", "bf16", 0, 1),
    ("small", "bf16", 0, 1),
    ("wide", "fp32", 0, 1),
    ("small", "bf16", 1, 1),
    ("wide", "bf16", 1, 1),
    ("small", "fp32", 1, 1),
    ("wide", "fp32", 1, 1),
]
STEP_CONTENDERS = "raw,ddplab"


class Check:
    """The results so far, appended to OUT/gpu-check.jsonl as each comes, and the budget left."""

    def __init__(self, out: Path, budget: float, rehearsal: bool, determinism: list[tuple[str, str]]):
        self.out = out
        # (experiment, precision) pairs the determinism part runs
        self.determinism = determinism
        self.end = time.monotonic() + budget
        self.rehearsal = rehearsal
        self.rows: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = out / "gpu-check.jsonl"
        self.jsonl.write_text("")

    def left(self) -> float:
        return self.end - time.monotonic()

    def record(self, part: str, what: str, status: str, **figures) -> None:
        row = {"part": part, "what": what, "status": status, **figures}
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = "  ".join(f"{k} {v}" for k, v in figures.items())
        print(f"gpu-check: {part} {what}: {status}  {shown}".rstrip(), flush=True)

    def env(self, **extra: str) -> dict:
        env = {
            **os.environ,
            **extra,
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        if self.rehearsal:
            env["CUDA_VISIBLE_DEVICES"] = ""
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        return env


def call(cmd: list[str], env: dict, limit: float, log: Path) -> tuple[int | None, str]:
    """Run `cmd` in its own process group for at most `limit` seconds: (exit code or None when cut, output)."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log.read_text(errors="replace")


# ---- the parts --------------------------------------------------------------------------------


def environment(check: Check, limit: float) -> None:
    import torch

    cuda = torch.cuda.is_available()
    check.record(
        "environment",
        "machine",
        "ok",
        device=torch.cuda.get_device_name(0) if cuda else "cpu (rehearsal)",
        torch=torch.__version__,
        cuda=torch.version.cuda or "-",
        python=platform.python_version(),
    )


def determinism(check: Check, limit: float) -> None:
    """Per experiment and precision: two straight runs, a killed one, two with determinism off."""
    ends = time.monotonic() + limit
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in check.determinism:
            what = f"{name} {precision}"
            if ends - time.monotonic() < 25:
                check.record("determinism", what, "not run (time)")
                continue
            found = _determinism_of(check, name, precision, Path(tmp) / f"{name}-{precision}", ends)
            check.record("determinism", what, **found)


def _determinism_of(check: Check, name: str, precision: str, root: Path, ends: float) -> dict:
    def train(run: str, deterministic: str, die: bool = False) -> dict | str:
        cmd = [sys.executable, "-m", "ddplab", "run", TARGETS[name], f"run.dir={root}", f"run.name={run}"]
        cmd += [
            f"trainer.precision={precision}",
            f"trainer.deterministic={deterministic}",
            f"trainer.max_steps={STEPS}",
        ]
        cmd += [f"trainer.checkpoint_every={EVERY}", "checkpoint.keep_last=0", "trainer.progress=false"]
        cmd += ["log.tensorboard=false", *(TINY[name] + REHEARSAL if check.rehearsal else [])]
        if die:
            cmd += ["--max-restarts", "1"]
        env = check.env(GPU_CHECK_DIE_AT=str(DIE_AT) if die else "0")
        code, out = call(cmd, env, ends - time.monotonic(), root.parent / f"{name}-{precision}-{run}.log")
        state = root / name / run / "checkpoints" / f"step-{STEPS:08d}" / "state.pt"
        if code != 0 or not state.exists():
            return f"failed (exit {code}): {out.strip().splitlines()[-1:] or ''}"
        import torch

        return torch.load(state, map_location="cpu", weights_only=True)["models"]

    # side by side: small runs share one GPU, and determinism does not depend on what else runs
    plan = {"a": ("true", False), "b": ("true", False), "killed": ("true", True)}
    plan |= {"off_a": ("false", False), "off_b": ("false", False)}
    with concurrent.futures.ThreadPoolExecutor(len(plan)) as pool:
        started = {run: pool.submit(train, run, *how) for run, how in plan.items()}
        runs = {run: future.result() for run, future in started.items()}
    broken = {run: found for run, found in runs.items() if isinstance(found, str)}
    if broken:
        return {"status": "failed", "runs": broken}
    twice, resumed, off = (
        _diff(runs["a"], runs["b"]),
        _diff(runs["a"], runs["killed"]),
        _diff(runs["off_a"], runs["off_b"]),
    )
    ok = twice == 0 and resumed == 0
    return {
        "status": "bitwise" if ok else "DIFFERS",
        "twice_max_diff": twice,
        "killed_resumed_max_diff": resumed,
        "off_twice_max_diff": off,
    }


def _diff(a: dict, b: dict) -> float:
    """The largest absolute difference of any parameter or buffer of any network."""
    return max(
        (
            (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float((x != y).any())
            for net in a
            for x, y in ((a[net][k], b[net][k]) for k in a[net])
            if x.numel()
        ),
        default=0.0,
    )


def step(check: Check, limit: float) -> None:
    """bench_gpu.py, one configuration at a time, so every finished one is kept."""
    ends = time.monotonic() + limit
    for workload, precision, compiled, rounds in STEP_CONFIGS:
        what = f"{workload} {precision} {'compiled' if compiled else 'eager'}"
        if ends - time.monotonic() < 15:
            check.record("step", what, "not run (time)")
            continue
        result = check.out / f"step-{workload}-{precision}-{compiled}.json"
        cmd = [sys.executable, "benchmarks/bench_gpu.py", "--rounds", str(rounds), "--workloads", workload]
        cmd += ["--contenders", STEP_CONTENDERS]
        cmd += ["--precisions", precision, "--compile", str(compiled), "--translation-steps", "0", "--out", str(result)]
        if check.rehearsal:
            cmd += ["--device", "cpu"]
        code, out = call(cmd, check.env(), ends - time.monotonic(), check.out / f"step-{workload}-{precision}.log")
        if code != 0 or not result.exists():
            last = out.strip().splitlines()[-1:] or [""]
            check.record("step", what, "cut (time)" if code is None else f"failed (exit {code}): {last[0]}")
            continue
        rows = next(iter(json.loads(result.read_text()).values()))
        ratios = {f"{c}_x_raw": round(r["ratio_to_raw"], 3) for c, r in rows.items() if r.get("ratio_to_raw")}
        # each round's step time too: one round alone does not settle a ratio
        each = {f"{c}_ms": [round(v, 3) for v in r["step_ms_each"]] for c, r in rows.items() if "step_ms_each" in r}
        check.record("step", what, "measured", **ratios, **each)


def tests(part: str, files: list[str]):
    """A part that runs test files of the gpu lane and counts what passed, failed and was skipped."""

    def run(check: Check, limit: float) -> None:
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=", *files]
        code, out = call(cmd, check.env(DDPLAB_TEST_GPU="1"), limit, check.out / f"{part}.log")
        counts = {
            word.lower(): len(re.findall(rf"::\S+ {word}", out)) for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")
        }
        failed = re.findall(r"::(\S+) (?:FAILED|ERROR)", out)
        status = "cut (time)" if code is None else ("passed" if code == 0 else f"failed (exit {code})")
        if code == 0 and counts["skipped"] and not counts["passed"]:
            status = "skipped (no CUDA)"
        check.record(
            part,
            " ".join(dict.fromkeys(Path(f.split("::")[0]).name for f in files)),
            status,
            **counts,
            **({"failing": failed} if failed else {}),
        )

    return run


PARTS = {
    "environment": environment,
    "determinism": determinism,
    "step": step,
    "oom": tests("oom", ["tests/gpu/test_gpu_oom.py"]),
    "snapshot": tests("snapshot", ["tests/gpu/test_gpu_profiling.py"]),
    # the CUDA cases of CPU test modules first: seconds each
    "lane": tests(
        "lane",
        [
            "tests/checkpoint/test_checkpoints.py::test_a_resume_loads_each_tensor_back_where_it_was_saved",
            "tests/checkpoint/test_restores.py::test_every_random_stream_comes_back_from_a_checkpoint_loaded_onto_the_run_device",
            "tests/train/test_log_interval.py::test_a_log_interval_costs_one_host_sync_and_a_step_none",
            "tests/train/test_data_sources.py::test_batches_reach_the_device_one_copy_ahead_in_order_and_none_is_lost",
            "tests/gpu/test_gpu.py",
            "tests/gpu/test_gpu_scaling.py",
        ],
    ),
}


def table(rows: list[dict]) -> str:
    lines = ["| part | what | result | figures |", "|---|---|---|---|"]
    for row in rows:
        figures = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("part", "what", "status"))
        lines.append(f"| {row['part']} | {row['what']} | {row['status']} | {figures} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=540.0, help="seconds for every part together")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    p.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    p.add_argument("--cpu-rehearsal", action="store_true", help="every part on the CPU, tiny: a check of this script")
    p.add_argument("--determinism", default="bbbp:fp32,translation:bf16")
    args = p.parse_args()
    parts = args.parts.split(",")
    if unknown := [part for part in parts if part not in PARTS]:
        print(f"gpu-check: error: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available() and not args.cpu_rehearsal:
        print(
            "gpu-check: no CUDA device here, nothing measured. On a machine with one GPU it runs, in at most "
            f"{args.budget:.0f} s:"
        )
        for part in parts:
            print(f"  {part:<12} limit {LIMITS[part]} s: {_meaning(part)}")
        print("(python scripts/gpu_check.py --cpu-rehearsal runs them on the CPU with tiny settings)")
        return 0
    pairs = [tuple(pair.split(":", 1)) for pair in args.determinism.split(",")]
    if bad := [":".join(pair) for pair in pairs if pair[0] not in TARGETS or pair[-1] not in ("fp32", "bf16")]:
        print(
            f"gpu-check: error: --determinism {bad[0]!r} is not EXPERIMENT:PRECISION of bbbp|translation and fp32|bf16",
            file=sys.stderr,
        )
        return 2
    check = Check(Path(args.out), args.budget, args.cpu_rehearsal, pairs)
    for part in parts:
        limit = min(LIMITS[part] * (3 if args.cpu_rehearsal else 1), check.left())
        if limit < 5:
            check.record(part, "-", "not run (budget spent)")
            continue
        started = time.monotonic()
        try:
            PARTS[part](check, limit)
        except Exception as e:
            check.record(part, "-", f"error ({type(e).__name__}: {e})")
        print(f"gpu-check: {part} took {time.monotonic() - started:.0f} s", flush=True)
    text = table(check.rows)
    (check.out / "gpu-check.md").write_text(text + "\n")
    print(text)
    return 0 if all(not r["status"].startswith(("failed", "DIFFERS", "error")) for r in check.rows) else 1


def _meaning(part: str) -> str:
    doc = __doc__.split("each with its own time limit")[1]
    found = re.search(rf"\n    {part}\s+(.*?)(?=\n    \w|\n\n)", doc, re.S)
    return " ".join(found.group(1).split()) if found else ""


if __name__ == "__main__":
    sys.exit(main())
