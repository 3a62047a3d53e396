"""The CUDA half of ddplab: `make test-gpu` on a machine with a GPU runs these (DDPLAB_TEST_GPU=1
makes the GPUs visible to the tests, see conftest.py); without CUDA every test here is skipped.

With trainer.deterministic=true the same command twice gives the same weights bit for bit, and a
run stopped (or killed) and resumed ends bit for bit where the straight run ends, in fp32, bf16
and fp16; the experiment's torchmetrics metrics, evaluation outputs and the exported model work
across devices; no run falls back to the CPU silently.
"""

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

import ddplab
from ddplab.checkpoint.store import list_checkpoints, load_state
from ddplab.distributed.wrapping import unwrap
from helpers import clean_env, finish, start, summary_of
from helpers import ddplab as ddplab_cli
from train.test_loop_reference import Regression, config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: `make test-gpu` on a GPU machine"),
]
EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "model.dropout=0.1",
    "trainer.deterministic=true",
    "model.torchmetric=true",
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture
def on_gpu():
    """This process as a one-rank job on the GPU (the in-process runs of test_loop_reference)."""
    with ddplab.init() as rt:
        assert rt.device.type == "cuda" and rt.backend == "nccl"
        yield rt


def run(tmp_path, *overrides: str) -> Regression:
    exp = Regression(config(tmp_path, "trainer.deterministic=true", "hidden=64", "dropout=0.2", *overrides))
    exp.fit()
    return exp


def weights(exp) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in unwrap(exp.net).state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# the lane runs this file in order until its time is up: the checks a GPU has proven least come first
def test_a_stream_and_shards_train_on_the_gpu_and_a_killed_stream_run_resumes_bit_for_bit(tmp_path):
    streamed = [
        "tests/fixtures/experiments.py:Streamed",
        f"run.dir={tmp_path}",
        *COMMON[:2],
        "trainer.deterministic=true",
        "trainer.global_batch_size=64",
        "trainer.max_epochs=2",
    ]
    for name, extra in (
        ("straight", []),
        ("killed", ["trainer.checkpoint_every=3", "fault.die_at_step=5", "--max-restarts", "1"]),
    ):
        res = ddplab_cli("run", *streamed, f"run.name={name}", "data.kind=stateful", *extra, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads((tmp_path / "streamed" / name / "run.json").read_text())["device"] == "cuda"
    # the kill happened
    assert (tmp_path / "streamed" / "killed" / "died-once").exists()
    a, b = (
        torch.load(tmp_path / "streamed" / n / "results" / "end-rank0.pt")["params"] for n in ("straight", "killed")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    x, y = torch.randn(256, 6), torch.randint(0, 2, (256,))
    index = ddplab.write_shards(({"x.pth": x[i], "cls": int(y[i])} for i in range(256)), str(tmp_path / "shards"), 64)
    res = ddplab_cli(
        "run",
        *streamed,
        "run.name=shards",
        "data.kind=shards",
        f"data.shards={index}",
        "trainer.num_workers=2",
        timeout=300,
    )
    assert res.returncode == 0 and "n 301" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_same_run_twice_gives_the_same_weights_bit_for_bit(tmp_path, on_gpu, precision):
    a = run(tmp_path, "run.name=a", "trainer.max_steps=12", f"trainer.precision={precision}")
    b = run(tmp_path, "run.name=b", "trainer.max_steps=12", f"trainer.precision={precision}")
    assert a.forward_dtypes == {DTYPES[precision]}
    assert next(unwrap(a.net).parameters()).device.type == "cuda"
    assert same(weights(a), weights(b))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_resumed_run_ends_bit_for_bit_where_the_straight_run_ends(tmp_path, on_gpu, precision):
    straight = run(tmp_path, "run.name=s", "trainer.max_steps=12", f"trainer.precision={precision}")
    run(tmp_path, "run.name=r", "trainer.max_steps=5", f"trainer.precision={precision}")
    resumed = run(tmp_path, "run.name=r", "trainer.max_steps=12", f"trainer.precision={precision}")
    assert same(weights(straight), weights(resumed))
    state = load_state(list_checkpoints(os.path.join(resumed.run_dir, "checkpoints"))[-1].path)
    # fp16's loss scale travels with the run
    assert (state["scaler"] is not None) == (precision == "fp16")


def test_the_weight_average_updates_on_the_gpu_without_a_host_sync_and_resumes_bit_for_bit(tmp_path, on_gpu):
    from ddplab.train.ema import WeightAverage

    ema = WeightAverage({"net": torch.nn.Linear(64, 64).cuda()}, 0.99)
    # any device-to-host copy or synchronize raises
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ema.update()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(t.device.type == "cuda" for t in ema.state_dict()["net"].values())
    straight = run(tmp_path, "run.name=s", "trainer.max_steps=12", "trainer.ema_decay=0.9")
    run(tmp_path, "run.name=r", "trainer.max_steps=5", "trainer.ema_decay=0.9")
    resumed = run(tmp_path, "run.name=r", "trainer.max_steps=12", "trainer.ema_decay=0.9")
    a, b = (
        load_state(list_checkpoints(os.path.join(e.run_dir, "checkpoints"))[-1].path)["ema"]["net"]
        for e in (straight, resumed)
    )
    assert same(a, b) and not same(a, weights(straight))


def test_optimizer_state_returns_to_the_gpu_after_a_resume(tmp_path, on_gpu):
    run(tmp_path, "trainer.max_steps=3")
    resumed = run(tmp_path, "trainer.max_steps=4")
    momentum = resumed.opt.state[next(iter(resumed.opt.state))]["momentum_buffer"]
    assert momentum.device.type == "cuda"


def _classifier(tmp_path, name, *args, expect=0):
    res = ddplab_cli("run", EXP, f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *args, timeout=300)
    assert res.returncode == expect, res.stdout + res.stderr
    return res


def _final(tmp_path, name):
    return torch.load(tmp_path / "classifier" / name / "results" / "final.pt", weights_only=True)


def test_a_killed_run_resumes_bit_for_bit_with_metrics_and_evaluation_on_the_gpu(tmp_path):
    out = _classifier(tmp_path, "straight", "trainer.max_steps=40", "trainer.eval_every=20").stdout
    # where it runs, said once
    assert "(cuda:0) (nccl, fp32)" in out
    proc = start(
        "run",
        EXP,
        f"run.dir={tmp_path}",
        "run.name=k",
        *COMMON,
        "trainer.max_steps=40",
        "trainer.eval_every=20",
        "trainer.checkpoint_every=5",
        "fault.step_sleep=0.2",
    )
    checkpoints = tmp_path / "classifier" / "k" / "checkpoints"
    deadline = time.monotonic() + 120
    while not [c for c in list_checkpoints(str(checkpoints)) if c.step >= 10] and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc)
    _classifier(tmp_path, "k", "trainer.max_steps=40", "trainer.eval_every=20")
    straight, resumed = _final(tmp_path, "straight"), _final(tmp_path, "k")
    assert same(straight["params"], resumed["params"])
    # a torchmetrics metric, kept on the GPU, counted every sample
    assert straight["seen"] == 40 * 32
    gpu_eval = json.loads((tmp_path / "classifier" / "straight" / "results" / "eval.json").read_text())
    cpu = ddplab_cli(
        "eval",
        EXP,
        "--checkpoint",
        str(tmp_path / "classifier" / "straight"),
        *COMMON,
        "--out",
        str(tmp_path / "cpu.json"),
        env=clean_env(CUDA_VISIBLE_DEVICES=""),
        timeout=300,
    )
    assert cpu.returncode == 0, cpu.stderr
    cpu_eval = json.loads((tmp_path / "cpu.json").read_text())
    assert cpu_eval["n"] == gpu_eval["n"] and cpu_eval["loss"] == pytest.approx(gpu_eval["loss"], rel=1e-5)


def test_predictions_on_the_gpu_match_the_cpu_row_for_row(tmp_path):
    res = ddplab_cli("run", EXP, f"run.dir={tmp_path}", "run.name=p", "trainer.max_steps=8", *COMMON, timeout=300)
    assert res.returncode == 0, res.stderr
    run = str(tmp_path / "classifier" / "p")
    for where, env in (("gpu", None), ("cpu", clean_env(CUDA_VISIBLE_DEVICES=""))):
        got = ddplab_cli(
            "predict", run, "--input", "eval", "--out", str(tmp_path / f"{where}.jsonl"), env=env, timeout=300
        )
        assert got.returncode == 0, got.stderr
    gpu, cpu = (
        [json.loads(line) for line in (tmp_path / f"{w}.jsonl").read_text().splitlines()] for w in ("gpu", "cpu")
    )
    assert len(gpu) == len(cpu) == 301
    assert [r["probability"] for r in gpu] == pytest.approx([r["probability"] for r in cpu], abs=1e-5)


@pytest.mark.parametrize("name, steps", [("bbbp", 30), ("translation", 12), ("alignment_stats", 12)])
def test_the_seed_experiments_resume_bit_for_bit_in_bf16(tmp_path, name, steps):
    common = [
        f"run.dir={tmp_path}",
        "trainer.progress=false",
        "log.tensorboard=false",
        "trainer.precision=bf16",
        "trainer.deterministic=true",
        "checkpoint.at_end=true",
    ]
    for run_name, stops in (("straight", [steps]), ("resumed", [steps // 2, steps])):
        for at in stops:
            # the resumed run stops by a shorter max_steps: a schedule over the run's length would differ
            schedule = ["optim.decay=inverse_sqrt"] if name == "translation" else []
            res = ddplab_cli(
                "run", name, f"run.name={run_name}", f"trainer.max_steps={at}", *common, *schedule, timeout=500
            )
            assert res.returncode == 0, res.stdout + res.stderr
    finals = [sorted((tmp_path / name / r / "final").glob("*.safetensors")) for r in ("straight", "resumed")]
    assert finals[0] and len(finals[0]) == len(finals[1])
    for a, b in zip(*finals, strict=True):
        assert same(load_file(a), load_file(b)), a.name


def test_data_parallel_trains_on_the_gpu(tmp_path):
    out = _classifier(tmp_path, "dp", "trainer.max_steps=6", "dist.strategy=dp").stdout
    assert "cuda" in out


def test_a_model_trained_on_the_gpu_loads_and_predicts_on_the_cpu(tmp_path):
    _classifier(tmp_path, "export", "trainer.max_steps=6")
    net = ddplab.load_model(str(tmp_path / "classifier" / "export"))
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert net(torch.zeros(3, 6)).shape == (3, 2)


def test_more_processes_than_gpus_is_refused_instead_of_training_on_the_cpu(tmp_path):
    gpus = torch.cuda.device_count()
    res = ddplab_cli("run", EXP, "-n", str(gpus + 1), f"run.dir={tmp_path}", *COMMON, timeout=120)
    assert res.returncode == 2
    assert (
        f"{gpus + 1} processes on this node but only {gpus} GPU(s) are visible; pass -n {gpus} to train on the "
        "GPUs, or dist.backend=gloo to train on the CPU on purpose"
    ) in res.stderr


def test_doctor_sees_the_gpu():
    res = ddplab_cli("doctor", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"cuda devices  {torch.cuda.device_count()}: {torch.cuda.get_device_name(0)}" in res.stdout


def test_a_compiled_run_on_the_gpu_resumes_bit_for_bit_and_reports_its_memory(tmp_path):
    compiled = [
        "trainer.compile=true",
        "trainer.precision=bf16",
        "trainer.max_steps=16",
        "trainer.log_every=4",
        "data.tokens_per_sample=5",
    ]
    out = _classifier(tmp_path, "straight", *compiled).stdout
    assert (
        "bf16, compiled)" in out and "; GPU " in out and "peak memory per rank: resident " in out and "tokens/s" in out
    )
    _classifier(
        tmp_path, "killed", *compiled, "trainer.checkpoint_every=4", "fault.die_at_step=10", "--max-restarts", "1"
    )
    assert (tmp_path / "classifier" / "killed" / "died-once").exists()
    straight, killed = _final(tmp_path, "straight"), _final(tmp_path, "killed")
    assert same(straight["params"], killed["params"])
    # one rank: compiled, no DDP to wrap
    assert straight["called_through"] == ["OptimizedModule", "Sequential"]
    summary = summary_of(tmp_path / "classifier" / "straight")
    assert len(summary["peak_mem_gib"]) == 1 and 0 < summary["peak_mem_gib"][0] < 80
    rows = [
        json.loads(line) for line in (tmp_path / "classifier" / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r for r in rows if "train/loss" in r]
    assert all(r["train/peak_mem_gib"] > 0 and 0 <= r["train/data_wait"] < 1 for r in logged)
    assert all(r["train/tokens_per_s"] == pytest.approx(5 * r["train/samples_per_s"], rel=1e-9) for r in logged)
