"""dist.strategy=fsdp on real gloo ranks, with a GPT whose embedding and head share one weight
(tests/fixtures/model_families.py's TiedGPT): the same weights as DDP bit for bit at 2 ranks, sharded
checkpoints written by every rank, kill and resume, resume on 3 ranks and across strategies, exact
evaluation and an export that keeps the tie. Seven runs, made once, serve every check."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from filelock import FileLock
from safetensors.torch import load_file

from ddplab.checkpoint.sharded import PLACEHOLDER
from ddplab.checkpoint.store import load_latest_valid
from helpers import FIXTURES, ddplab_here, experiment_of, metrics_rows, run_target, suite_folder

TARGET = f"{FIXTURES / 'model_families.py'}:TiedGPT"
# accumulation, the weights' average and a clip that never binds (its norm is logged) in every run
COMMON = (
    "trainer.global_batch_size=12",
    "trainer.accumulate=2",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=3",
    "trainer.ema_decay=0.9",
    "trainer.grad_clip=1e9",
    "trainer.progress=false",
    "log.tensorboard=false",
    "dist.fsdp_units=Block",
)
FSDP = "dist.strategy=fsdp"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder}: ddp, fsdp (async save), killed (fsdp, SIGKILLed before step 5), f2d (DDP
    from fsdp's step 3), d2f (FSDP from ddp's step 3), on3 and on1 (FSDP on 3 ranks and on one process
    from fsdp's step 3).
    Made once for the whole suite: the first pytest worker to ask makes them, the others wait."""
    root = suite_folder(tmp_path_factory) / "fsdp-runs"
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            _make_runs(root)
            (root / "done").touch()
    return {name: root / "tiedgpt" / name for name in ("ddp", "fsdp", "killed", "f2d", "d2f", "on3", "on1")}


def _make_runs(root) -> None:
    run_target(TARGET, root, "ddp", *COMMON)
    run_target(TARGET, root, "fsdp", *COMMON, FSDP, "checkpoint.async_save=true")
    run_target(TARGET, root, "killed", *COMMON, FSDP, "die_at_step=5", "--max-restarts", "1")
    folder = root / "tiedgpt"
    step3 = "checkpoints/step-00000003"
    run_target(TARGET, root, "f2d", *COMMON, f"run.resume={folder / 'fsdp' / step3}")
    run_target(TARGET, root, "d2f", *COMMON, FSDP, f"run.resume={folder / 'ddp' / step3}")
    # nothing left to train: final/ is what 3 ranks read back from 2 ranks' shards, gathered again
    for n in (3, 1):
        only = ("trainer.max_steps=3", f"run.resume={folder / 'fsdp' / step3}")
        run_target(TARGET, root, f"on{n}", *COMMON, FSDP, *only, n=n)


def _final(run) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_trains_the_weights_ddp_trains_bit_for_bit(runs):
    # 2 ranks: a reduce-scatter of 2 summands is DDP's all_reduce of them, element for element
    assert _equal(_final(runs["fsdp"]), _final(runs["ddp"]))
    # the norm clipped by is the whole model's, not one rank's shard's
    norms = [[row["train/grad_norm"] for row in metrics_rows(runs[n]) if "train/grad_norm" in row] for n in runs]
    assert norms[0] and norms[1] == pytest.approx(norms[0], rel=1e-6)


def test_every_rank_writes_its_own_shards_and_rank_0_none_of_theirs(runs):
    step = runs["fsdp"] / "checkpoints" / "step-00000006"
    assert sorted(os.listdir(step / "shards")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # the weights, their average and the optimizer's moments are in the shards; state.pt names them
    saved = torch.load(step / "state.pt", weights_only=True)
    assert all(set(value) == {PLACEHOLDER} for value in saved["models"]["model"].values())
    assert all(set(value) == {PLACEHOLDER} for value in saved["ema"]["model"].values())
    moments = [m for state in saved["optimizers"][0]["state"].values() for k, m in state.items() if k != "step"]
    assert moments and all(set(m) == {PLACEHOLDER} for m in moments)
    # listed as any checkpoint, its size with the shards
    listed = ddplab_here("checkpoints", str(runs["fsdp"]))
    assert listed.returncode == 0 and "step-00000006" in listed.stdout, listed.stdout + listed.stderr
    meta = json.loads((step / "meta.json").read_text())
    assert meta["size"] == sum(f.stat().st_size for f in [step / "state.pt", *(step / "shards").iterdir()])


def test_the_shards_hold_exactly_what_ddp_saved(runs):
    """Read in one process without a process group: model, optimizer moments and the average."""
    for step in ("step-00000003", "step-00000006"):
        ddp = torch.load(runs["ddp"] / "checkpoints" / step / "state.pt", weights_only=True)
        wanted = {f"/models/model/{k}": v for k, v in ddp["models"]["model"].items()}
        wanted.update({f"/ema/model/{k}": v for k, v in ddp["ema"]["model"].items()})
        for index, moments in ddp["optimizers"][0]["state"].items():
            wanted.update({f"/optimizers/0/state/{index}/{k}": v for k, v in moments.items() if k != "step"})
        read = {key: torch.empty_like(value) for key, value in wanted.items()}
        dcp.load(read, checkpoint_id=str(runs["fsdp"] / "checkpoints" / step / "shards"), no_dist=True)
        assert _equal(read, wanted), step


def test_a_killed_run_resumes_bit_for_bit(runs):
    assert (runs["killed"] / "died-once").exists()
    assert _equal(_final(runs["killed"]), _final(runs["fsdp"]))


def test_a_checkpoint_crosses_strategies_both_ways_bit_for_bit(runs):
    # DDP continued from FSDP's shards, and FSDP from DDP's whole tensors, end where both did
    assert _equal(_final(runs["f2d"]), _final(runs["ddp"]))
    assert _equal(_final(runs["d2f"]), _final(runs["ddp"]))


@pytest.mark.parametrize("run", ["on3", "on1"])
def test_3_ranks_and_one_process_read_2_ranks_shards_exactly(runs, run):
    # final/ holds the average (trainer.ema_decay): as saved at step 3, resharded to uneven thirds (or
    # read whole into the unsharded network of one process) and exported again
    saved = torch.load(runs["ddp"] / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)["ema"]["model"]
    exported = _final(runs[run])
    assert all(torch.equal(exported[k], saved[k]) for k in exported) and "wte.weight" in exported


def test_evaluation_is_exact_and_a_sharded_checkpoint_evaluates_in_one_process(runs):
    def last_eval(run):
        return [row for row in metrics_rows(run) if "eval/loss" in row][-1]["eval/loss"]

    assert last_eval(runs["fsdp"]) == last_eval(runs["ddp"])
    exp = experiment_of(TARGET, runs["fsdp"])
    assert exp.evaluate_checkpoint(str(runs["fsdp"]))["loss"] == pytest.approx(last_eval(runs["ddp"]), rel=1e-6)
    rows = experiment_of(TARGET, runs["fsdp"]).predict_checkpoint(str(runs["fsdp"]), "eval")
    assert rows and all(len(values) == 37 for values in rows.values())


def test_the_export_keeps_the_tie(runs):
    written = _final(runs["fsdp"])
    assert "lm_head.weight" not in written
    from safetensors import safe_open

    with safe_open(str(runs["fsdp"] / "final" / "model.safetensors"), "pt") as f:
        assert f.metadata()["lm_head.weight"] == "wte.weight"


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(runs, tmp_path, capfd):
    copy = tmp_path / "checkpoints"
    shutil.copytree(runs["fsdp"] / "checkpoints", copy)
    shard = copy / "step-00000006" / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    info, _ = load_latest_valid(str(copy))
    assert info.step == 3
    assert "__1_0.distcp cannot be read (its size or SHA-256 is not what COMMITTED recorded" in capfd.readouterr().err


def test_networks_that_share_a_module_are_one_line_before_training(tmp_path):
    # an encoder and a decoder holding one embedding: the first network sharded it already
    target = f"{FIXTURES / 'model_families.py'}:SharedEmbedding"
    res = run_target(
        target, tmp_path, "shared", *COMMON, FSDP, "dist.fsdp_units=auto", "dist.fsdp_min_params=50", expect=2
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Decoder shares parameters with another network" in lines[0], res.stderr
    assert "use dist.strategy=ddp" in lines[0]


@pytest.mark.timeout(60)
def test_under_bf16_the_gradients_are_averaged_over_ranks_in_fp32():
    """What docs/scaling.md promises: weights computed in bf16, gradients reduced in fp32. Each rank's
    bf16 gradients, averaged in fp32, are what FSDP gives, bit for bit; averaged in bf16 they are not."""
    res = ddplab_here("run", str(FIXTURES / "fsdp_reduce.py"), "-n", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    gap = json.loads(res.stdout.strip().splitlines()[-1])
    assert gap["fp32"] == 0.0 and gap["bf16"] > 0.0, gap
