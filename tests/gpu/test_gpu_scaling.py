"""DDP's levers on GPUs (NCCL): SyncBatchNorm makes a BatchNorm network train the same at -n 1 and
-n 2, bf16 compression runs, PowerSGD and a sharded optimizer resume bit for bit, live replicas
survive a kill. Each needs two GPUs
(`make test-gpu` on such a machine); elsewhere they are skipped. Their CPU halves are test_scaling.py
and test_hangs.py (the flight recorder)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import clean_env, ddplab, finish, start

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs: `make test-gpu`"
    ),
]
EXP = "tests/fixtures/scaling.py:Levers"
COMMON = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "trainer.max_steps=24",
    "trainer.deterministic=true",
]


def _run(tmp_path, name, *args, n=2):
    res = ddplab(
        "run", EXP, *(["-n", str(n)] if n > 1 else []), f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *args,
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _params(tmp_path, name):
    return torch.load(tmp_path / "levers" / name / "results" / "final.pt", weights_only=True)["params"]


def test_sync_batchnorm_trains_the_same_at_one_and_two_ranks(tmp_path):
    # one rank normalizes its micro-batch of 32; two ranks with SyncBatchNorm normalize their two
    # micro-batches of 16 together: the statistics of the same 32 samples
    _run(tmp_path, "one", "model.batchnorm=true", n=1)
    out = _run(tmp_path, "two", "model.batchnorm=true", "dist.sync_batchnorm=true")
    assert "BatchNorm layers" not in out.stdout + out.stderr
    one, two = _params(tmp_path, "one"), _params(tmp_path, "two")
    # float tolerance: the sums over the batch are split differently between ranks
    assert all(torch.allclose(one[k], two[k], rtol=1e-4, atol=1e-5) for k in one)


def test_without_sync_batchnorm_two_ranks_train_another_network(tmp_path):
    _run(tmp_path, "one", "model.batchnorm=true", n=1)
    out = _run(tmp_path, "two", "model.batchnorm=true")
    assert "BatchNorm layers (1: BatchNorm1d)" in out.stderr
    one, two = _params(tmp_path, "one"), _params(tmp_path, "two")
    assert not all(torch.allclose(one[k], two[k], rtol=1e-4, atol=1e-5) for k in one)


@pytest.mark.parametrize("lever", [["dist.comm_hook=bf16"], ["dist.comm_hook=powersgd", "dist.powersgd_start_iter=2"]])
def test_compressed_runs_resume_bit_for_bit_on_nccl(tmp_path, lever):
    _run(tmp_path, "ref", *lever, "trainer.checkpoint_every=10")
    _run(tmp_path, "k", *lever, "trainer.checkpoint_every=10", "fault.die_at_step=15", "--max-restarts", "1")
    a, b = _params(tmp_path, "ref"), _params(tmp_path, "k")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_optimizer_resumes_bit_for_bit_on_nccl(tmp_path):
    adam = ["model.optimizer=adam", "dist.shard_optimizer=true", "trainer.checkpoint_every=10"]
    _run(tmp_path, "ref", *adam)
    _run(tmp_path, "k", *adam, "fault.die_at_step=15", "--max-restarts", "1")
    a, b = _params(tmp_path, "ref"), _params(tmp_path, "k")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_collective_that_times_out_on_nccl_leaves_each_ranks_flight_recorder(tmp_path):
    """Rank 1 stops answering in its step while rank 0 waits in DDP's all_reduce: NCCL's watchdog
    or ddplab's report (whichever comes first) writes each rank's flight recorder to the run."""
    res = ddplab(
        "run", "tests/fixtures/experiments.py:Classifier", "-n", "2", f"run.dir={tmp_path}",
        "trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32",
        "trainer.max_steps=20", "fault.stall_at_step=3", "dist.timeout_s=10",
        timeout=120,
    )  # fmt: skip
    assert res.returncode != 0
    (folder,) = tmp_path.glob("classifier/*/flight_recorder")
    assert {"rank_0", "rank_1"} <= {p.name for p in folder.iterdir()}, res.stderr


def _exported(tmp_path, name):
    """final/'s weights: a sharded network's, gathered whole (its state_dict on a rank holds slices)."""
    from safetensors.torch import load_file

    return load_file(tmp_path / "levers" / name / "final" / "model.safetensors")


FSDP = ["dist.strategy=fsdp", "dist.fsdp_units=Linear", "model.optimizer=adam", "trainer.checkpoint_every=10"]


def test_fsdp_on_nccl_trains_as_ddp_and_resumes_bit_for_bit(tmp_path):
    # the CPU half (gloo, bitwise against DDP, resharding, across strategies) is tests/distributed/test_fsdp.py
    _run(tmp_path, "ddp", "model.optimizer=adam", "trainer.checkpoint_every=10")
    _run(tmp_path, "ref", *FSDP)
    _run(tmp_path, "k", *FSDP, "fault.die_at_step=15", "--max-restarts", "1")
    ddp, ref, k = (_exported(tmp_path, name) for name in ("ddp", "ref", "k"))
    assert all(torch.equal(ref[key], k[key]) for key in ref)
    # NCCL's reduce-scatter and all_reduce may sum in other orders
    assert all(torch.allclose(ref[key], ddp[key], rtol=1e-4, atol=1e-6) for key in ref)


def test_fsdp_in_bf16_gathers_bf16_weights_and_keeps_fp32_ones(tmp_path):
    _run(tmp_path, "bf16", *FSDP, "trainer.precision=bf16")
    params = _exported(tmp_path, "bf16")
    # MixedPrecisionPolicy computes in bf16; the sharded weights, checkpoints and final/ stay fp32
    assert all(value.dtype == torch.float32 and torch.isfinite(value).all() for value in params.values())


def test_live_replicas_on_two_gpus_one_each_survive_a_kill_inside_the_backward(tmp_path):
    """dist.fault_tolerance=live on NCCL: each replica on its own GPU (CUDA_VISIBLE_DEVICES from the
    launcher), torchft's NCCL process group; the CPU half is tests/distributed/test_live.py."""
    pytest.importorskip("torchft")
    env = clean_env(
        DDPLAB_TEST_KILL="1:5:backward", DDPLAB_TEST_KILL_ONCE=str(tmp_path / "killed"), DDPLAB_TEST_STEP_S="0.15"
    )
    args = ["run", "tests/fixtures/live.py:Replicated", "-n", "2", f"run.dir={tmp_path}", "run.name=live",
            "trainer.max_steps=40", "trainer.global_batch_size=32", "trainer.progress=false",
            "log.tensorboard=false", "dist.fault_tolerance=live", "dist.timeout_s=60"]  # fmt: skip
    code, out, err = finish(start(*args, env=env), 400, "ddplab run (live, NCCL)")
    assert code == 0 and "on cuda" in out, out + err
    folders = [tmp_path / "replicated" / "live" / f"replica-{r}" for r in range(2)]
    survivor = [json.loads(line) for line in (folders[0] / "live.jsonl").read_text().splitlines()]
    assert len({r["pid"] for r in survivor}) == 1 and survivor[-1]["step"] == 40
    a, b = (load_file(next((f / "final").glob("*.safetensors"))) for f in folders)
    assert all(torch.equal(a[k], b[k]) for k in a)
