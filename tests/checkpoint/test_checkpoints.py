"""Checkpoints and recovery with real processes: bitwise resume, restarts, preemption, safety."""

import json
import os
import signal
import time

import pytest
import torch

from ddplab import load_model
from ddplab.checkpoint.store import CheckpointManager, as_saved_onto, list_checkpoints, load_state, resolve_checkpoint
from helpers import budget, cuda_case, ddplab_here, finish, metrics_rows, run_target, start

EXP = "tests/fixtures/experiments.py:Classifier"
pytestmark = pytest.mark.timeout(60)
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32", "model.dropout=0.1"]


def _run(tmp_path, name, *args, n=2, expect=0):
    return run_target(EXP, tmp_path, name, *COMMON, *args, n=n, expect=expect)


def _params(tmp_path, name):
    return torch.load(tmp_path / "classifier" / name / "results" / "final.pt", weights_only=True)["params"]


def _wait_for_logged_steps(run_dir, count, limit_s=60):
    """Wait until a running job has logged `count` lines to metrics.jsonl (it is training)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + budget(limit_s)
    while not (metrics.exists() and metrics.read_text().count("\n") >= count) and time.monotonic() < deadline:
        time.sleep(0.1)


def _bitwise_equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The reference run's folder: 40 steps without interruption (2 ranks, dropout on), a
    checkpoint every 10 steps, all kept."""
    tmp = tmp_path_factory.mktemp("straight")
    _run(tmp, "ref", "trainer.max_steps=40", "trainer.checkpoint_every=10", "checkpoint.keep_last=0")
    return tmp / "classifier" / "ref"


@pytest.fixture(scope="module")
def straight(straight_run):
    """The reference run's final parameters."""
    return _params(straight_run.parents[1], "ref")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_mid_epoch_is_bitwise_identical(tmp_path, straight):
    # 512 samples / 32 = 16 steps per epoch: step 20 is in the middle of epoch 1.
    _run(tmp_path, "r", "trainer.max_steps=20")
    out = _run(tmp_path, "r", "trainer.max_steps=40").stdout
    assert "resumed from" in out and "at step 20 (epoch 1, step 4 of the epoch)" in out
    assert _bitwise_equal(_params(tmp_path, "r"), straight)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_agent_restarts_killed_worker_and_the_result_is_bitwise_identical(tmp_path, straight):
    res = _run(
        tmp_path,
        "k",
        "trainer.max_steps=40",
        "trainer.checkpoint_every=10",
        "fault.die_at_step=25",
        "--max-restarts",
        "2",
    )
    assert os.path.exists(tmp_path / "classifier" / "k" / "died-once")
    assert "restarted after a failure (restart 1" in res.stdout
    assert "at step 20" in res.stdout
    assert _bitwise_equal(_params(tmp_path, "k"), straight)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sigterm_saves_and_exits_then_resume_is_bitwise(tmp_path, straight):
    proc = start(
        "run",
        EXP,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=t",
        *COMMON,
        "trainer.max_steps=40",
        "fault.step_sleep=0.2",
        "trainer.log_every=1",
    )
    _wait_for_logged_steps(tmp_path / "classifier" / "t", 3)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code, out, err = finish(proc, timeout=60)
    assert time.monotonic() - started < 30, "must finish inside torchrun's 30 s grace period"
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in out + err
    saved = list_checkpoints(str(tmp_path / "classifier" / "t" / "checkpoints"))
    assert saved and 0 < saved[-1].step < 40
    _run(tmp_path, "t", "trainer.max_steps=40")
    assert _bitwise_equal(_params(tmp_path, "t"), straight)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_on_another_world_size_sees_the_same_batches(tmp_path):
    nodrop = ["model.dropout=0.0", "trainer.max_steps=24"]
    _run(tmp_path, "two", *nodrop)
    _run(tmp_path, "mixed", "model.dropout=0.0", "trainer.max_steps=12")
    out = _run(tmp_path, "mixed", *nodrop, n=1).stdout
    assert "written by 2 ranks and this run has 1" in out
    a, b = _params(tmp_path, "two"), _params(tmp_path, "mixed")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_corrupt_latest_falls_back_to_the_previous(tmp_path):
    _run(tmp_path, "c", "trainer.max_steps=20", "trainer.checkpoint_every=10", "checkpoint.keep_last=3")
    ckpts = list_checkpoints(str(tmp_path / "classifier" / "c" / "checkpoints"))
    assert [c.step for c in ckpts] == [10, 20]
    state = os.path.join(ckpts[-1].path, "state.pt")
    with open(state, "r+b") as f:
        f.truncate(os.path.getsize(state) // 2)
    res = _run(tmp_path, "c", "trainer.max_steps=30")
    assert "cannot be read" in res.stderr and "falling back to the previous checkpoint" in res.stderr
    assert "at step 10" in res.stdout


def test_kill_during_a_slow_save_keeps_the_previous_checkpoint(tmp_path):
    proc = start(
        "run",
        EXP,
        f"run.dir={tmp_path}",
        "run.name=s",
        *COMMON,
        "trainer.max_steps=40",
        "trainer.checkpoint_every=10",
        "fault.slow_save_s=30",
    )
    ckdir = tmp_path / "classifier" / "s" / "checkpoints"
    deadline = time.monotonic() + budget(120)
    # The first save (step 10) is slow too: wait for it to commit, then for the second to start.
    while time.monotonic() < deadline and not (ckdir / ".tmp-step-00000020" / "state.pt").exists():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    ckpts = list_checkpoints(str(ckdir))
    assert [c.step for c in ckpts] == [10]
    assert load_state(ckpts[0].path)["progress"]["step"] == 10


@pytest.mark.slow
def test_checkpoints_load_with_weights_only_and_reject_pickled_code(tmp_path):
    _run(tmp_path, "w", "trainer.max_steps=4", n=1)
    ckpt = list_checkpoints(str(tmp_path / "classifier" / "w" / "checkpoints"))[-1]
    state = torch.load(os.path.join(ckpt.path, "state.pt"), weights_only=True)
    assert {"models", "optimizers", "schedulers", "rng", "sampler", "progress", "config", "versions"} <= set(state)
    evil = tmp_path / "evil.pt"
    torch.save({"models": {}, "payload": Exploit()}, evil)
    res = ddplab_here("run", EXP, f"run.dir={tmp_path}", "run.name=w2", *COMMON, f"run.resume={evil}")
    assert res.returncode == 2 and "cannot be read" in res.stderr, res.stderr
    assert not (tmp_path / "pwned").exists()


class Exploit:
    def __reduce__(self):
        return (open, (str(os.path.join(os.path.dirname(__file__), "pwned")), "w"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoint_of_another_model_names_the_mismatch(tmp_path):
    _run(tmp_path, "m", "trainer.max_steps=4", n=1)
    ckpt = list_checkpoints(str(tmp_path / "classifier" / "m" / "checkpoints"))[-1].path
    res = ddplab_here("run", EXP, f"run.dir={tmp_path}", "run.name=m2", *COMMON, "model.hidden=8", f"run.resume={ckpt}")
    assert res.returncode == 2
    assert "does not fit network 'net'" in res.stderr and "(16, 6)" in res.stderr and "(8, 6)" in res.stderr
    res = ddplab_here("run", EXP, f"run.dir={tmp_path}", *COMMON, "run.resume=/no/such/checkpoint")
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_keep_last_and_keep_best_pruning(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=2, keep_best=1, monitor="auc", mode="max")
    for step, auc in [(1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7), (5, 0.65)]:
        mgr.save({"w": torch.tensor([float(step)])}, step, 0, auc)
    assert [c.step for c in mgr.list()] == [2, 4, 5]
    assert [c.step for c in mgr.best()] == [2]
    mgr = CheckpointManager(str(tmp_path / "min"), keep_last=1, keep_best=2, monitor="loss", mode="min")
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2), (4, 0.4)]:
        mgr.save({"w": torch.tensor([0.0])}, step, 0, loss)
    assert [c.step for c in mgr.list()] == [2, 3, 4]
    mgr = CheckpointManager(str(tmp_path / "one"), keep_last=1)
    for step in (1, 2, 3):
        mgr.save({"w": torch.tensor([0.0])}, step, 0, None)
    assert [c.step for c in mgr.list()] == [3]


def test_only_committed_checkpoints_with_readable_meta_are_listed_and_a_run_resolves_to_its_last(tmp_path):
    """A folder without COMMITTED is a save that was cut short; a committed one whose meta.json
    is missing or damaged is skipped, and the ones after it still count."""
    folder = tmp_path / "run" / "checkpoints"
    mgr = CheckpointManager(str(folder), keep_last=0)
    for step in (2, 4, 6, 8, 10):
        mgr.save({"w": torch.tensor([float(step)])}, step, 0, None)
    (folder / "step-00000004" / "meta.json").write_text("{not json")
    (folder / "step-00000006" / "meta.json").unlink()
    (folder / "step-00000010" / "COMMITTED").unlink()
    (folder / "notes").mkdir()
    (folder / "notes" / "COMMITTED").write_text("ok")
    assert [c.step for c in list_checkpoints(str(folder))] == [2, 8]
    assert resolve_checkpoint(str(tmp_path / "run")).endswith("step-00000008")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_async_save_equals_sync_save_bitwise(tmp_path, straight_run):
    _run(
        tmp_path,
        "async",
        "trainer.max_steps=30",
        "trainer.checkpoint_every=10",
        "checkpoint.keep_last=0",
        "checkpoint.async=true",
    )
    # the reference saved the same steps synchronously
    for step in (10, 20, 30):
        a = load_state(str(straight_run / "checkpoints" / f"step-{step:08d}"))
        b = load_state(str(tmp_path / "classifier" / "async" / "checkpoints" / f"step-{step:08d}"))
        assert _bitwise_equal(a["models"]["net"], b["models"]["net"])
        assert a["progress"] == b["progress"]


def test_an_async_save_holds_the_values_of_when_it_was_called(tmp_path):
    """Training changes the tensors in place as soon as save() returns, while the background
    writer is still at work: what lands on disk must be the values at the call, every tensor of
    them (model and optimizer state alike), never a later or half-changed one."""
    # 64 MB
    state = {
        "models": {"net": {f"w{i}": torch.zeros(2_000_000) for i in range(8)}},
        "optimizers": [{"state": {0: {"momentum_buffer": torch.zeros(1_000_000)}}}],
    }
    manager = CheckpointManager(str(tmp_path), async_save=True)
    manager.save(state, 1, 0, None)
    for tensor in [*state["models"]["net"].values(), state["optimizers"][0]["state"][0]["momentum_buffer"]]:
        # the next optimizer step
        tensor.add_(1.0)
    manager.wait()
    saved = load_state(str(tmp_path / "step-00000001"))
    assert all(not t.any() for t in saved["models"]["net"].values())
    assert not saved["optimizers"][0]["state"][0]["momentum_buffer"].any()


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=0)
    manager.save({"w": torch.zeros(3)}, 5, 0, None)
    # what saves killed half-way leave behind
    (tmp_path / ".tmp-step-00000007").mkdir()
    (tmp_path / ".old-step-00000003").mkdir()
    manager.save({"w": torch.ones(3)}, 5, 0, None)
    assert [c.step for c in manager.list()] == [5]
    assert torch.equal(load_state(str(tmp_path / "step-00000005"))["w"], torch.ones(3))
    # no .tmp- or .old- folder left behind
    assert sorted(os.listdir(tmp_path)) == ["step-00000005"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_never_refuses_a_used_run_folder_and_leaves_it_untouched(tmp_path):
    _run(tmp_path, "again", "trainer.max_steps=6", "trainer.checkpoint_every=2", "checkpoint.keep_last=0", n=1)
    folder = tmp_path / "classifier" / "again"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}
    res = _run(tmp_path, "again", "trainer.max_steps=6", "run.resume=never", n=1, expect=2)
    assert f"run.resume=never, but run folder {folder} already holds checkpoints" in res.stderr, res.stderr
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"} == before
    res = _run(tmp_path, "new", "trainer.max_steps=6", "run.resume=never", n=1)
    assert "resumed from" not in res.stdout
    assert _bitwise_equal(_params(tmp_path, "again"), _params(tmp_path, "new"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_with_another_global_batch_is_refused_in_one_line(tmp_path):
    _run(tmp_path, "b", "trainer.max_steps=4", n=1)
    res = _run(tmp_path, "b", "trainer.max_steps=8", "trainer.global_batch_size=64", n=1, expect=2)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "the checkpoint was trained with trainer.global_batch_size=32, this run asks for 64" in lines[0]
        and "another run.name" in lines[0]
    ), res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_export_load_model_eval_command_and_listing(tmp_path):
    _run(tmp_path, "x", "trainer.max_steps=16", "trainer.checkpoint_every=8", n=1)
    run = tmp_path / "classifier" / "x"
    assert {"model.safetensors", "config.yaml", "meta.json"} <= set(os.listdir(run / "final"))
    net = load_model(str(run))
    final = _params(tmp_path, "x")
    assert _bitwise_equal(dict(net.state_dict().items()), final)
    listing = ddplab_here("checkpoints", str(run)).stdout
    assert "step-00000008" in listing and "step-00000016" in listing and "latest" in listing
    res = ddplab_here("eval", EXP, "--checkpoint", str(run), "-n", "2", f"run.dir={tmp_path}", *COMMON)
    assert res.returncode == 0, res.stderr
    metrics = json.loads((run / "results" / "eval-step-00000016.json").read_text())
    assert metrics == json.loads((run / "results" / "eval.json").read_text())


@pytest.mark.slow
def test_sigusr1_saves_and_stops_a_single_process_run(tmp_path):
    proc = start(
        "run",
        EXP,
        f"run.dir={tmp_path}",
        "run.name=u",
        *COMMON,
        "trainer.max_steps=200",
        "fault.step_sleep=0.1",
        "trainer.log_every=1",
    )
    _wait_for_logged_steps(tmp_path / "classifier" / "u", 2)
    proc.send_signal(signal.SIGUSR1)
    code, _out, err = finish(proc, timeout=60)
    # a scheduler must not read a stopped job as done
    assert code == 128 + signal.SIGUSR1, err
    saved = list_checkpoints(str(tmp_path / "classifier" / "u" / "checkpoints"))
    assert saved and 0 < saved[-1].step < 200
    assert f"stopped by SIGUSR1; a checkpoint was saved at step {saved[-1].step}" in err
    # the command given: it has run.name
    assert err.split("To continue: ")[1].split().count("run.name=u") == 1


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_the_job_and_the_printed_command_continues_it(tmp_path, sig):
    """SLURM sends SIGUSR1 to the job step (the launcher); Ctrl-C sends SIGINT. Without run.name
    the printed command must name the run, or it would start a new one from step 0."""
    proc = start(
        "run",
        EXP,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        *COMMON,
        "trainer.max_steps=200",
        "fault.step_sleep=0.1",
        "trainer.log_every=1",
        "trainer.checkpoint_every=2",
    )
    runs = tmp_path / "classifier"
    deadline = time.monotonic() + budget(60)
    while not (runs.exists() and any(runs.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.1)
    run_dir = next(runs.iterdir())
    _wait_for_logged_steps(run_dir, 3)
    # SIGINT saves nothing at the stop: the continuation needs a periodic checkpoint already on
    # disk, and on a loaded machine the first one can still be in flight after step 3 is logged
    deadline = time.monotonic() + budget(60)
    while not list_checkpoints(str(run_dir / "checkpoints")) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    code, _out, err = finish(proc, timeout=60)
    assert code == 128 + sig, err
    saved = [c.step for c in list_checkpoints(str(run_dir / "checkpoints"))]
    assert saved, err
    if sig == signal.SIGUSR1:
        assert f"stopped by SIGUSR1; a checkpoint was saved at step {saved[-1]} in {run_dir}" in err
    else:
        # not a preemption signal by default: the workers stop at once
        assert "stopped by SIGINT; nothing was saved at the stop" in err
    command = err.split("To continue: ")[1].strip().split()
    assert command[:2] == ["ddplab", "run"] and f"run.name={run_dir.name}" in command
    res = ddplab_here(
        *[a for a in command[1:] if a != "trainer.max_steps=200"],
        "trainer.max_steps=" + str(saved[-1] + 2),
        "fault.step_sleep=0",
    )
    assert res.returncode == 0 and f"at step {saved[-1]} " in res.stdout, res.stdout + res.stderr


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_several_eval_sets_are_each_exact_named_ranked_by_and_evaluated_alone(tmp_path):
    exp = "tests/fixtures/experiments.py:TwoSets"
    res = ddplab_here(
        "run",
        exp,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=t",
        *COMMON,
        "trainer.max_steps=8",
        "trainer.eval_every=4",
        "checkpoint.monitor=shifted/accuracy",
        "checkpoint.keep_best=1",
        "trainer.early_stop.monitor=dev/loss",
        "trainer.early_stop.patience=5",
    )
    assert res.returncode == 0, res.stderr
    run = tmp_path / "twosets" / "t"
    logged = metrics_rows(run)
    evals = [r for r in logged if "eval/dev/loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    # every sample once, per set
    assert all(r["eval/dev/n"] == 301 and r["eval/shifted/n"] == 97 for r in evals)
    best = json.loads((run / "checkpoints" / "step-00000008" / "meta.json").read_text())
    assert best["monitor"] == "shifted/accuracy" and best["metric"] == evals[-1]["eval/shifted/accuracy"]
    alone = {}
    for n in ("1", "2"):
        # the one set asked for, exactly, on any number of processes
        out = tmp_path / f"shifted-{n}.json"
        command = ["eval", exp, "--checkpoint", str(run), "--set", "shifted", "--out", str(out), *COMMON]
        got = ddplab_here(*command) if n == "1" else ddplab_here(*command, "-n", n)
        assert got.returncode == 0, got.stderr
        alone[n] = json.loads(out.read_text())
    assert alone["1"] == alone["2"] and set(alone["1"]) == {
        "shifted/loss",
        "shifted/accuracy",
        "shifted/roc_auc",
        "shifted/n",
    }
    assert alone["1"]["shifted/accuracy"] == evals[-1]["eval/shifted/accuracy"]
    wrong = ddplab_here("eval", exp, "--checkpoint", str(run), "--set", "test", *COMMON)
    assert wrong.returncode == 2 and wrong.stderr.strip() == (
        "ddplab: error: TwoSets.eval_dataset() has no eval set 'test' (it has 'dev', 'shifted'); name one of its sets "
        "(ddplab eval --set NAME)"
    )


@pytest.mark.parametrize(
    "device",
    [
        # the meta device stands in for an accelerator where there is none: tensors saved from it
        # load onto it, as a GPU's do onto the resuming rank's GPU
        "meta",
        cuda_case(),
    ],
)
def test_a_resume_loads_each_tensor_back_where_it_was_saved(tmp_path, device):
    """Weights saved from the device come back onto the rank's device; a generator's state saved from
    the CPU (the experiment's own, like a generator of augmentations) stays on the CPU, where torch can
    set a generator from it. Loaded onto the device as a whole, `set_state` refused it on a GPU."""
    augment = torch.Generator().manual_seed(1)
    torch.save({"weight": torch.ones(3, device=device), "augment": augment.get_state()}, tmp_path / "state.pt")
    expected = torch.rand(2, generator=augment)
    loaded = load_state(str(tmp_path / "state.pt"), map_location=device)
    assert loaded["weight"].device.type == device
    restored = torch.Generator()
    restored.set_state(loaded["augment"])
    assert torch.equal(torch.rand(2, generator=restored), expected)
    # a run on the CPU loads everything onto the CPU
    assert as_saved_onto("cpu") == torch.device("cpu")
