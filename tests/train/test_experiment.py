"""The training loop over real gloo processes: equivalence across world sizes and accumulation,
exact evaluation, determinism, aggregation helpers, and the mistakes users make."""

import json
import math

import pytest
import torch

from helpers import ddplab_here, metrics_rows, run_target

EXP = "tests/fixtures/experiments.py:Classifier"
pytestmark = pytest.mark.timeout(60)


def _train(tmp_path, name, *args, n=1):
    quiet = ["trainer.progress=false", "log.tensorboard=false"]
    res = run_target(EXP, tmp_path, name, *quiet, *args, n=n)
    run = tmp_path / "classifier" / name
    final = torch.load(run / "results" / "final.pt", weights_only=True)
    return final, json.loads((run / "results" / "eval.json").read_text()), res.stdout


def _max_rel_diff(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_train_and_evaluate_as_one_process_with_the_same_global_batch(tmp_path):
    """Float64, so that weights trained on 1 and on 2 ranks differ only in the last bits of their sums,
    and the evaluation's 301 samples over 2 ranks (no duplicates) give the one process's metrics."""
    steps = ["trainer.max_steps=24", "trainer.global_batch_size=32", "model.torchmetric=true", "data.dtype=float64"]
    one, single, _ = _train(tmp_path, "one", *steps)
    two, double, out = _train(tmp_path, "two", *steps, n=2)
    assert one["step"] == two["step"] == 24
    # a torchmetrics metric inside the steps, synced by itself
    assert one["seen"] == two["seen"] == 24 * 32
    assert _max_rel_diff(two["params"], one["params"]) < 1e-10
    # scheduler stepped once per optimizer step
    assert one["lr"] == two["lr"] == pytest.approx(0.2 * 0.5**4)
    assert "micro-batch 16 per rank x accumulate 1 x 2 ranks = global batch 32" in out
    assert single["n"] == double["n"] == 301
    for key in ("loss", "accuracy", "roc_auc"):
        assert math.isclose(single[key], double[key], rel_tol=0, abs_tol=1e-9), (key, single[key], double[key])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_accumulation_equals_one_big_batch(tmp_path):
    big, _, _ = _train(tmp_path, "big", "trainer.max_steps=20", "trainer.global_batch_size=64")
    acc, _, out = _train(
        tmp_path, "acc", "trainer.max_steps=20", "trainer.global_batch_size=64", "trainer.accumulate=4", n=2
    )
    assert "micro-batch 8 per rank x accumulate 4 x 2 ranks = global batch 64" in out
    assert _max_rel_diff(acc["params"], big["params"]) < 1e-5


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_exact_evaluation_with_three_ranks_and_a_tiny_eval_set(tmp_path):
    """2 eval samples on 3 ranks: one rank has nothing to evaluate and must not hang or skew."""
    args = ["trainer.max_steps=4", "trainer.global_batch_size=48", "data.dtype=float64", "data.n_eval=2"]
    _, single, _ = _train(tmp_path, "t1", *args)
    _, triple, _ = _train(tmp_path, "t3", *args, n=3)
    assert triple["n"] == 2
    assert math.isclose(single["loss"], triple["loss"], abs_tol=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_same_seed_twice_is_bitwise_identical(tmp_path):
    a, _, _ = _train(tmp_path, "a", "trainer.max_steps=15", "seed=5", n=2)
    b, _, _ = _train(tmp_path, "b", "trainer.max_steps=15", "seed=5", n=2)
    c, _, _ = _train(tmp_path, "c", "trainer.max_steps=15", "seed=6", n=2)
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert not all(torch.equal(a["params"][k], c["params"][k]) for k in a["params"])


def test_run_directory_contents(tmp_path):
    _, _, _out = _train(tmp_path, "files", "trainer.max_steps=6", "trainer.log_every=2", "log.tensorboard=true")
    run = tmp_path / "classifier" / "files"
    assert {"config.yaml", "metrics.jsonl", "log.txt", "tensorboard", "results"} <= {p.name for p in run.iterdir()}
    rows = metrics_rows(run)
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6]
    assert any("eval/roc_auc" in r for r in rows)
    assert "max_steps: 6" in (run / "config.yaml").read_text()
    assert "global batch 32" in (run / "log.txt").read_text()
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").rglob("*"))


@pytest.mark.slow
def test_collective_helpers_on_two_ranks(tmp_path):
    res = ddplab_here("run", "tests/fixtures/experiments.py:collectives_probe", "-n", "2", f"run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr
    ranks = [json.loads((tmp_path / f"collectives-rank{r}.json").read_text()) for r in (0, 1)]
    # every rank gets the same answers
    assert ranks[0] == {**ranks[1], "world": 2}
    got = ranks[0]
    assert got["sum"] == [3.0, 4.0]
    assert got["mean"] == [0.5]
    assert got["min"] == [0.0, -1.0] and got["max"] == [1.0, 0.0]
    # rank 0 holds 2 samples, rank 1 holds 3
    samples = [0.0, 1.0, 10.0, 11.0, 12.0]
    assert got["weighted_mean"] == pytest.approx(sum(samples) / len(samples))
    assert got["gather_concat"] == samples
    assert got["gather_variable"] == [[[0.0]] * 2, [[1.0, 1.0]] * 3]
    assert got["nested"] == {
        "layers": [[[[0.0] * 3] * 2, [[1.0] * 3] * 2], [[10.0] * 4, [11.0] * 4]],
        "step": [[0, 7], [1, 7]],
    }
    assert got["broadcast"] == {"from": 0}


@pytest.mark.parametrize(
    "args,message",
    [
        (["-n", "2", "trainer.global_batch_size=33"], "does not divide into 2 ranks x 1 micro-batches"),
        (
            ["trainer.global_batch_size=0"],
            "config key 'trainer.global_batch_size' is 0, but it must be an integer >= 1",
        ),
        (["trainer.global_batch_size=1024"], "fewer than one global batch"),
        (["trainer.precision=fp16"], "fp16 needs a CUDA device"),
        (["trainer.precison=bf16"], "did you mean trainer.precision"),
    ],
)
def test_user_mistakes_are_one_line(tmp_path, args, message):
    """Those refused while the run is planned (before any worker would start) and those found once
    the data or the device is there."""
    res = ddplab_here("run", EXP, f"run.dir={tmp_path}", "trainer.max_steps=2", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_bf16_autocast_trains_on_cpu(tmp_path):
    final, metrics, _ = _train(
        tmp_path, "bf16", "trainer.max_steps=10", "trainer.precision=bf16", "trainer.grad_clip=1.0"
    )
    assert all(torch.isfinite(v).all() for v in final["params"].values())
    assert metrics["accuracy"] > 0.5


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_wandb_offline_one_run_whose_id_survives_resume(tmp_path):
    pytest.importorskip("wandb")
    args = ["log.wandb=true", "log.wandb_mode=offline", "trainer.checkpoint_every=4"]
    first, _, _ = _train(tmp_path, "wb", "trainer.max_steps=4", *args, n=2)
    second, _, out = _train(tmp_path, "wb", "trainer.max_steps=8", *args, n=2)
    assert "resumed from" in out
    assert first["wandb_id"] and first["wandb_id"] == second["wandb_id"]
    runs = list((tmp_path / "classifier" / "wb" / "wandb").glob("offline-run-*"))
    # one run, not one per rank
    assert runs and all(r.name.endswith(first["wandb_id"]) for r in runs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dataloader_workers_do_not_change_the_result(tmp_path):
    a, _, _ = _train(tmp_path, "w0", "trainer.max_steps=6")
    b, _, _ = _train(tmp_path, "w2", "trainer.max_steps=6", "trainer.num_workers=2")
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_networks_with_two_optimizers(tmp_path):
    exp = "tests/fixtures/experiments.py:TwoNets"
    res1 = ddplab_here(
        "run",
        exp,
        f"run.dir={tmp_path}",
        "run.name=one",
        "trainer.max_steps=12",
        "trainer.progress=false",
        "log.tensorboard=false",
    )
    res2 = ddplab_here(
        "run",
        exp,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=two",
        "trainer.max_steps=12",
        "trainer.progress=false",
        "log.tensorboard=false",
    )
    assert res1.returncode == 0 and res2.returncode == 0, res1.stderr + res2.stderr
    one = torch.load(tmp_path / "twonets" / "one" / "results" / "final.pt", weights_only=True)
    two = torch.load(tmp_path / "twonets" / "two" / "results" / "final.pt", weights_only=True)
    assert set(one) == {"a", "b"}
    for name in ("a", "b"):
        assert all(torch.allclose(one[name][k], two[name][k], rtol=1e-5, atol=1e-6) for k in one[name])
    assert not torch.equal(one["a"]["weight"], one["b"]["weight"])
