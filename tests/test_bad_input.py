"""Bad input and faults, each ending fast in one clear line and a non-zero exit, with no checkpoint
lost. docs/reliability.md lists every case with its message; the cases tested elsewhere name
their test there."""

import math
from pathlib import Path

import pytest
import torch

from ddplab.checkpoint.store import list_checkpoints
from helpers import ddplab_here, metrics_rows

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
pytestmark = pytest.mark.timeout(60)


def _fails(tmp_path, *args, code=2):
    """Run the fixture experiment; return its one error line (or the whole stderr for code != 2)."""
    command = ["run", EXP, f"run.dir={tmp_path}", "run.name=r", *COMMON, *args]
    res = ddplab_here(*command)
    assert res.returncode == code, res.stdout + res.stderr
    if code != 2:
        return res.stderr
    lines = [ln for ln in res.stderr.strip().splitlines() if ln]
    assert len(lines) == 1, res.stderr
    return lines[0]


def _steps(tmp_path):
    return [c.step for c in list_checkpoints(str(tmp_path / "classifier" / "r" / "checkpoints"))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["-n", "2", "data.n_train=0"], "Classifier.train_dataset() is empty (0 samples); check the data path"),
        (
            ["-n", "2", "data.n_train=1", "trainer.global_batch_size=2"],
            "the training set has 1 samples, fewer than one global batch (trainer.global_batch_size=2)",
        ),
        (["trainer.max_steps=abc"], "config key 'trainer.max_steps' expects an integer, got 'abc'"),
        (["run.resume=no/such/checkpoint"], "checkpoint no/such/checkpoint does not exist"),
    ],
)
def test_bad_data_and_settings(tmp_path, args, message):
    assert message in _fails(tmp_path, "trainer.max_steps=2", *args)


# DataLoader worker processes fork beside ddplab's own threads
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["0", "2"])
def test_samples_that_cannot_be_batched_are_one_line_and_forking_loader_workers_prints_nothing(tmp_path, workers):
    res = ddplab_here(
        "run",
        "tests/fixtures/experiments.py:RaggedSamples",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        *COMMON,
        f"trainer.num_workers={workers}",
        "trainer.max_steps=2",
    )
    assert res.returncode == 2 and res.stderr.startswith(
        "ddplab: error: default_collate cannot make one batch of 16 samples (RuntimeError: stack expects"
    ), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_run_directory_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    line = _fails(tmp_path, f"run.dir={blocker}/runs", "trainer.max_steps=2")
    assert "cannot write the run directory" in line and "(Not a directory)" in line and "run.dir=PATH" in line


def test_a_checkpoint_that_is_not_one(tmp_path):
    bad = tmp_path / "state.pt"
    bad.write_bytes(b"these bytes are no checkpoint")
    line = _fails(tmp_path, f"run.resume={bad}", "trainer.max_steps=2")
    assert f"checkpoint {bad} cannot be read" in line and "another run.name" in line


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_nan_loss_stops_with_the_step_and_rank_and_saves_nothing_after_it(tmp_path):
    line = _fails(tmp_path, "-n", "2", "trainer.max_steps=20", "trainer.checkpoint_every=2", "fault.nan_at_step=5")
    assert "the loss is not a finite number (NaN or inf) at step 5 on rank 1" in line
    assert "trainer.nonfinite=skip" in line
    assert _steps(tmp_path) == [2, 4]


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_nan_loss_is_skipped_when_configured(tmp_path):
    res = ddplab_here(
        "run",
        EXP,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=r",
        *COMMON,
        "trainer.max_steps=8",
        "fault.nan_at_step=5",
        "trainer.nonfinite=skip",
        "trainer.log_every=4",
    )
    assert res.returncode == 0, res.stderr
    assert "step 5: gradients are not finite, optimizer step skipped" in res.stdout
    params = torch.load(tmp_path / "classifier" / "r" / "results" / "final.pt", weights_only=True)["params"]
    assert all(torch.isfinite(p).all() for p in params.values())

    logged = metrics_rows(tmp_path / "classifier" / "r")
    skipped = [r["train/skipped"] for r in logged if "train/skipped" in r]
    assert skipped == [0.0, 0.25] and all(math.isfinite(r.get("train/loss", 0.0)) for r in logged)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_an_exception_in_step_k_on_one_rank(tmp_path):
    err = _fails(tmp_path, "-n", "2", "trainer.max_steps=20", "fault.raise_at_step=3", code=1)
    assert "[rank 1/2] ddplab: RuntimeError in the experiment" in err
    assert "deliberate failure in step 3 on rank 1" in err
    assert err.strip().splitlines()[-1] == "ddplab: rank 1 exited with code 1 first; its own error is printed above."


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_worker_killed_without_restarts(tmp_path):
    err = _fails(
        tmp_path, "-n", "2", "trainer.max_steps=40", "trainer.checkpoint_every=10", "fault.die_at_step=25", code=1
    )
    assert (
        err.strip().splitlines()[-1]
        == "ddplab: rank 1 was killed by signal SIGKILL first, which leaves a process no time to print anything: "
        "the out-of-memory killer (see dmesg) or a kill from outside the job"
    )
    assert _steps(tmp_path) == [10, 20]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_file_that_only_defines_an_experiment_is_not_run_as_an_empty_script(tmp_path):
    body = "import ddplab\n\n\nclass Mine(ddplab.Experiment):\n    pass\n"
    (tmp_path / "only.py").write_text(body)
    # top-level code, but nothing that trains: still not a script
    (tmp_path / "busy.py").write_text(body + "\nprint('defined')\nSETTINGS = dict(lr=0.1)\n")
    (tmp_path / "guarded.py").write_text(body + "\n\nif __name__ == '__main__':\n    print('the script ran')\n")
    (tmp_path / "initialised.py").write_text(body + "\nrt = ddplab.init()\nprint('the script ran')\n")
    for name in ("only", "busy"):
        res = ddplab_here("run", str(tmp_path / f"{name}.py"))
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
        assert f"ddplab run {tmp_path / name}.py:Mine" in lines[0] and "defined" not in res.stdout
    for name in ("guarded", "initialised"):
        res = ddplab_here("run", str(tmp_path / f"{name}.py"))
        assert res.returncode == 0 and "the script ran" in res.stdout, res.stderr


@pytest.mark.parametrize(
    "name, what",
    [("Net", "the class Net"), ("Settings", "the class Settings"), ("net", "a Linear")],
)
def test_a_target_that_is_neither_an_experiment_nor_a_function_is_refused(tmp_path, name, what):
    """A network, a dataclass or a module-level object would be called, train nothing and exit 0."""
    (tmp_path / "things.py").write_text(
        "from dataclasses import dataclass\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    pass\n\n\n"
        "@dataclass\nclass Settings:\n    lr: float = 0.1\n\n\nnet = nn.Linear(2, 2)\n"
    )
    res = ddplab_here("run", f"{tmp_path / 'things.py'}:{name}")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert f"is {what}, neither an Experiment nor a function" in lines[0]


@pytest.mark.slow
def test_evaluation_outputs_that_differ_between_ranks_stop_every_rank_in_one_line(tmp_path):
    """Gathered as they were, float32 on one rank and float64 on another would make a number (or a hang)."""
    line = _fails(tmp_path, "-n", "2", "trainer.max_steps=2", "fault.eval_dtype_on_rank1=float32")
    assert "evaluation_step returned other keys, dtypes or shapes on some ranks than on rank 0" in line


@pytest.mark.parametrize("command", [["collectives", "-n", "1", "all_reduce"], ["bench", "comm", "-n", "1"]])
def test_tools_that_exchange_between_processes_refuse_a_single_one(command):
    res = ddplab_here(*command)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines == [
        "ddplab: error: -n 1: this command runs collectives between processes; pass -n 2 or more"
    ], res.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_results_that_cannot_be_written_are_one_line(tmp_path):
    ddplab_here("run", EXP, f"run.dir={tmp_path}", "run.name=r", *COMMON, "trainer.max_steps=2", expect=0)
    run_dir, blocker = tmp_path / "classifier" / "r", tmp_path / "a_file"
    blocker.write_text("not a folder")
    # a folder
    res = ddplab_here("eval", EXP, "--checkpoint", str(run_dir), "--out", str(tmp_path), *COMMON)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert f"cannot write the evaluation metrics to {tmp_path} (Is a directory)" in lines[0]
    res = ddplab_here("report", str(run_dir), "--out", str(blocker / "report"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"ddplab: error: cannot write {blocker / 'report'} (Not a directory); pass --out PATH elsewhere"
    ], res.stderr


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name, n", [("json", "1"), ("logging", "2")])
def test_an_experiment_file_named_like_a_standard_module_runs(tmp_path, name, n):
    """json.py or logging.py in the working folder must hide neither module from torch nor ddplab's
    own imports, in one process or in the launcher and its workers (two): both files are there, and
    one of them is the target."""
    for module in ("json", "logging"):
        (tmp_path / f"{module}.py").write_text(Path("tests/fixtures/experiments.py").read_text())
    res = ddplab_here(
        "run",
        f"{name}.py:Classifier",
        "-n",
        n,
        f"run.dir={tmp_path}/runs",
        "run.name=r",
        *COMMON,
        "trainer.max_steps=2",
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "runs" / "classifier" / "r" / "final").is_dir()


@pytest.mark.parametrize("seed", ["9223372036854775807", "1795541054936000000"])
def test_any_seed_the_settings_allow_trains(tmp_path, seed):
    """The largest seed, and one from `date +%s%N`: the data order and every generator take it."""
    res = ddplab_here("run", EXP, f"run.dir={tmp_path}", "run.name=r", *COMMON, f"seed={seed}", "trainer.max_steps=2")
    assert res.returncode == 0, res.stdout + res.stderr


DYING_WORKER = """
import os, signal
import torch
from torch.utils.data import Dataset, get_worker_info
import ddplab

class Dying(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        # as the kernel's out-of-memory killer ends a loader worker
        if i == 100 and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((3,), float(i)), torch.tensor(float(i))

class E(ddplab.Experiment):
    def build(self):
        self.net = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-4)

    def train_dataset(self):
        return Dying()

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_dataloader_worker_that_dies_is_one_line_naming_the_rank_and_the_worker(tmp_path):
    (tmp_path / "dying.py").write_text(DYING_WORKER)
    res = ddplab_here(
        "run",
        f"{tmp_path}/dying.py:E",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "trainer.num_workers=2",
        "trainer.max_epochs=2",
        "trainer.global_batch_size=16",
        "trainer.progress=false",
        "log.tensorboard=false",
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "a DataLoader worker process of rank" in lines[0] and "(pid " in lines[0]
    # torch says which of its two checks saw the SIGKILLed worker first: the signal, or the exit (under load)
    assert "died (Killed)" in lines[0] or "died (exited unexpectedly)" in lines[0], lines[0]
    assert "trainer.num_workers" in lines[0]


@pytest.mark.parametrize(
    "message, named",
    [
        ("DataLoader worker (pid 23071) is killed by signal: Killed. ", "(pid 23071) died (Killed)"),
        ("DataLoader worker (pid(s) 12, 13) exited unexpectedly", "(pid 12, 13) died (exited unexpectedly)"),
    ],
)
def test_both_ways_torch_reports_a_dead_loader_worker_are_read(message, named):
    from ddplab.train.sources import loader_worker_died

    assert named in str(loader_worker_died(RuntimeError(message)))
    assert loader_worker_died(RuntimeError("CUDA error: out of memory")) is None


class _DiesAfterAWhile(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        import os
        import signal
        import time

        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)


class _ResetWhileFetched(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.timeout(60)
def test_a_reset_connection_while_a_loader_worker_dies_is_named_once_torch_sees_the_worker_dead():
    """A worker killed while it hands a batch over resets the connection before the kernel lets torch
    see it dead: the diagnosis waits for torch's own check rather than showing the reset."""
    import signal

    from torch.utils.data import DataLoader

    from ddplab.train.sources import loader_worker_died

    before = signal.getsignal(signal.SIGCHLD)
    # starts the worker (which dies half a second later) and torch's SIGCHLD handler
    dying = iter(DataLoader(_DiesAfterAWhile(), num_workers=1))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        with pytest.raises(ConnectionResetError) as reset:
            next(iter(DataLoader(_ResetWhileFetched())))
        found = loader_worker_died(reset.value, wait_s=10)
        assert found is not None and "died (Killed)" in str(found), found
        assert f"(pid {dying._workers[0].pid})" in str(found)
        # a reset connection of the user's own, raised outside the DataLoader, is not a dead worker
        assert loader_worker_died(ConnectionResetError(104, "Connection reset by peer"), wait_s=10) is None
    finally:
        del dying
        signal.signal(signal.SIGCHLD, before)
