"""The training loop against the same training written as a plain PyTorch loop, in this process.

The expected values come from the plain loop below (forward, loss / accumulate, backward, clip,
optimizer and scheduler step), run on the very batches ddplab handed the experiment, from the same
initial weights: never from ddplab's own output. Each test runs in a second or two, so these are
also the fast tests the mutation runs use for the step, the loop, the log interval and
state/resume (scripts/mutation.py). Behaviour across ranks is tested with real processes in
test_experiment.py and test_step_effects.py.
"""

import copy
import fcntl
import json
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import Dataset

import ddplab
from ddplab.checkpoint.store import list_checkpoints, load_state
from ddplab.distributed.wrapping import DDP, unwrap
from ddplab.errors import ConfigError, DdplabError
from ddplab.train.returns import split_output
from ddplab.train.rundir import new_run_name
from ddplab.train.sources import to_device

N_TRAIN, N_EVAL = 40, 13
# a loop that never ends (or a gloo group that waits) fails fast
pytestmark = pytest.mark.timeout(60)


class Indexed(Dataset):
    """Linear regression samples that also say which sample they are, so a test knows what was
    trained on."""

    def __init__(self, n: int, seed: int, weights: tuple[float, ...]):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor(weights) + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Unsized(Dataset):
    """A map-style dataset that forgot __len__."""

    def __getitem__(self, i):
        return torch.zeros(4), torch.zeros(()), i


class Stack(nn.Sequential):
    """Another network class whose tensors are the same as nn.Sequential's."""


class Regression(ddplab.Experiment):
    def build(self):
        network = {"Sequential": nn.Sequential, "Stack": Stack}[self.cfg.network]
        self.net = network(
            nn.Linear(4, self.cfg.hidden), nn.Tanh(), nn.Dropout(self.cfg.dropout), nn.Linear(self.cfg.hidden, 1)
        )
        self.initial = copy.deepcopy(self.net.state_dict())
        params = self.net.parameters()
        self.opt = (
            torch.optim.AdamW(params, lr=0.05)
            if self.cfg.optimizer == "adamw"
            else torch.optim.SGD(params, lr=0.05, momentum=0.9)
        )
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        if self.cfg.warmup:
            # a schedule over the run's length, as build() learns it
            self.total_at_build, self.epoch_steps_at_build = self.total_steps, self.steps_per_epoch
            self.sched = ddplab.warmup_schedule(self.opt, self.cfg.warmup, self.total_steps, decay="linear")
        # the sample indices of each micro-batch, in order
        self.seen: list[torch.Tensor] = []
        self.epochs_ended: list[int] = []
        self.forward_dtypes: set[torch.dtype] = set()
        # how many micro-batches had been taken when DDP all-reduced
        self.synced_at: list[int] = []
        self.training_modes: set[bool] = set()
        # as a build() that evaluates something would leave it: the loop must train
        self.net.eval()

    def train_dataset(self):
        return Unsized() if self.cfg.data == "train_unsized" else Indexed(self.cfg.n_train, 1, (1.0, -2.0, 0.5, 0.0))

    def eval_dataset(self):
        wrong = {
            "eval_unsized": Unsized(),
            "eval_empty": Indexed(0, 2, (1.0, 0.0, 0.5, 0.0)),
            "eval_none": None,
            "eval_no_sets": {},
        }
        if self.cfg.data in wrong:
            return wrong[self.cfg.data]
        # shifted: its loss falls, then rises
        return Indexed(N_EVAL, 2, (1.0, 0.0, 0.5, 0.0))

    def training_step(self, batch):
        x, y, i = batch
        self.seen.append(i.clone())
        if isinstance(self.net, DDP) and len(self.seen) == 1:
            self.net.register_comm_hook(None, self._count_sync)
        if self.cfg.nan_at_step == self.step + 1 and len(self.seen) % self.plan.accumulate == 0:
            return F.mse_loss(self.net(x).squeeze(-1), y) * float("nan")
        time.sleep(self.cfg.step_sleep)
        if self.cfg.signal_at_step == self.step + 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        out = self.net(x).squeeze(-1)
        self.forward_dtypes.add(out.dtype)
        self.training_modes.add(self.net.training)
        loss = F.mse_loss(out.float(), y)
        return {"loss": loss, "mae": (out.float() - y).abs().mean()} if self.cfg.with_mae else loss

    def evaluation_step(self, batch):
        x, y, _ = batch
        rows = (self.net(x).squeeze(-1) - y) ** 2
        return {
            "rows": {"loss": rows},
            "mean": {"loss": rows.mean(0, keepdim=True)},
            "scalar": {"loss": rows.mean()},
            "float": {"loss": rows.mean().item()},
            "list": [rows],
            "none": None,
        }[self.cfg.eval_output]

    def _count_sync(self, state, bucket):
        self.synced_at.append(len(self.seen))
        return default_hooks.allreduce_hook(None, bucket)

    def on_epoch_end(self, epoch):
        self.epochs_ended.append(epoch)

    def on_fit_end(self):
        if self.cfg.load_best:
            self.best_path = self.load_best_checkpoint()


@dataclass
class Cfg(ddplab.Config):
    nan_at_step: int = 0
    signal_at_step: int = 0
    eval_output: str = "rows"  # what evaluation_step returns: rows (right) | mean | scalar | float | list | none
    with_mae: bool = False
    step_sleep: float = 0.0
    n_train: int = N_TRAIN
    hidden: int = 8
    dropout: float = 0.0
    load_best: bool = False
    optimizer: str = "sgd"  # or adamw
    network: str = "Sequential"  # or Stack: another class, the same tensors
    warmup: int = 0  # > 0: ddplab.warmup_schedule with this many warm-up steps instead of StepLR
    data: str = "right"  # or train_unsized | eval_unsized | eval_empty | eval_none


def run(tmp_path, *overrides: str) -> Regression:
    exp = Regression(config(tmp_path, *overrides))
    exp.fit()
    return exp


def config(tmp_path, *overrides: str):
    return ddplab.load_config(
        Cfg,
        [
            "run.name=r",
            f"run.dir={tmp_path}",
            "trainer.progress=false",
            "log.tensorboard=false",
            "trainer.global_batch_size=8",
            *overrides,
        ],
    )


class Reference:
    """The plain PyTorch loop: the experiment's initial weights, its batches, the same optimizer."""

    def __init__(self, exp: Regression, clip: float = 0.0, skip_steps: tuple[int, ...] = ()):
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 1))
        self.net.load_state_dict(exp.initial)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.data, self.eval_data = exp.train_dataset(), exp.eval_dataset()
        self.clip, self.skip = clip, skip_steps
        # per step, each micro-batch's loss
        self.losses: list[list[float]] = []
        # after each step, from step 0
        self.weights: list[dict] = [copy.deepcopy(self.net.state_dict())]

    def train(self, micro_batches: list[torch.Tensor], accumulate: int) -> "Reference":
        for s in range(0, len(micro_batches), accumulate):
            step_losses = []
            for idx in micro_batches[s : s + accumulate]:
                x, y = self.data.x[idx], self.data.y[idx]
                loss = F.mse_loss(self.net(x).squeeze(-1), y)
                step_losses.append(loss.item())
                (loss / accumulate).backward()
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
            if len(self.losses) + 1 not in self.skip:
                self.opt.step()
            self.opt.zero_grad()
            self.sched.step()
            self.losses.append(step_losses)
            self.weights.append(copy.deepcopy(self.net.state_dict()))
        return self

    def eval_loss(self, step: int) -> float:
        net = copy.deepcopy(self.net)
        net.load_state_dict(self.weights[step])
        with torch.no_grad():
            return F.mse_loss(net(self.eval_data.x).squeeze(-1), self.eval_data.y).item()


def logged(exp: Regression, kind: str) -> dict[int, dict]:
    """metrics.jsonl, by step, for 'train/' or 'eval/' entries."""
    out: dict[int, dict] = {}
    with open(os.path.join(exp.run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            values = {k[len(kind) :]: v for k, v in rec.items() if k.startswith(kind)}
            if values:
                out.setdefault(rec["step"], {}).update(values)
    return out


def assert_same_weights(module: nn.Module, expected: dict) -> None:
    got = unwrap(module).state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7, msg=f"{name} differs from plain PyTorch")


@pytest.mark.parametrize("accumulate, clip", [(1, 0.0), (2, 0.0), (4, 0.05)])
def test_weights_losses_and_lr_follow_the_plain_loop(tmp_path, world, accumulate, clip, capsys):
    exp = run(
        tmp_path,
        "trainer.max_steps=7",
        "trainer.log_every=2",
        f"trainer.accumulate={accumulate}",
        f"trainer.grad_clip={clip}",
    )
    assert len(exp.seen) == 7 * accumulate and all(len(i) == 8 // accumulate for i in exp.seen)
    ref = Reference(exp, clip).train(exp.seen, accumulate)
    assert_same_weights(exp.net, ref.weights[7])
    # final/: the last weights
    exported = load_file(os.path.join(exp.run_dir, "final", "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in unwrap(exp.net).state_dict().items())
    train = logged(exp, "train/")
    # every log_every steps, and the last step
    assert sorted(train) == [2, 4, 6, 7]
    for step, since in ((2, 0), (4, 2), (6, 4), (7, 6)):
        losses = [v for s in ref.losses[since:step] for v in s]
        assert train[step]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
        # StepLR after `step` steps
        assert train[step]["lr"] == pytest.approx(0.05 * 0.5 ** (step // 3))
        assert train[step]["epoch"] == pytest.approx(step / (N_TRAIN // 8))
    # only trainer.nonfinite=skip counts
    assert ("grad_norm" in train[2]) == bool(clip) and "skipped" not in train[2]
    assert exp.training_modes == {True}
    # echoed without a bar
    assert f"train step 2  {'grad_norm' if clip else 'loss'}" in capsys.readouterr().out
    info = json.loads(Path(exp.run_dir, "run.json").read_text())
    assert (info["target"], info["steps_per_epoch"], info["accumulate"]) == (
        "test_loop_reference.Regression",
        5,
        accumulate,
    )
    if world == "gloo":
        # DDP all-reduces once a step, on its last micro-batch (no_sync on the others)
        assert exp.synced_at == [accumulate * s for s in range(1, 8)]


def test_every_epoch_is_a_permutation_and_evaluation_follows_each_epoch(tmp_path):
    exp = run(
        tmp_path,
        "trainer.max_epochs=3",
        "trainer.log_every=100",
        "checkpoint.every_epoch=true",
        "trainer.checkpoint_every=5",
        "checkpoint.keep_last=0",
        "checkpoint.monitor=loss",
    )
    steps_per_epoch = N_TRAIN // 8
    assert len(exp.seen) == 3 * steps_per_epoch and exp.step == 3 * steps_per_epoch and exp.epoch == 3
    epochs = [torch.cat(exp.seen[e * steps_per_epoch : (e + 1) * steps_per_epoch]) for e in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(N_TRAIN))
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    assert exp.epochs_ended == [0, 1, 2]
    ref = Reference(exp).train(exp.seen, 1)
    evals = logged(exp, "eval/")
    assert sorted(evals) == [5, 10, 15]
    for step in evals:
        assert evals[step]["loss"] == pytest.approx(ref.eval_loss(step), rel=1e-5)
    assert exp.last_eval["loss"] == pytest.approx(ref.eval_loss(15), rel=1e-5)
    # saved by checkpoint_every before the epoch's evaluation, then again with its metric
    saved = list_checkpoints(os.path.join(exp.run_dir, "checkpoints"))
    assert [c.step for c in saved] == [5, 10, 15]
    assert [c.metric for c in saved] == pytest.approx([ref.eval_loss(s) for s in (5, 10, 15)], rel=1e-5)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_forward_runs_in_the_precision_asked_for(tmp_path, precision, dtype):
    exp = run(tmp_path, "trainer.max_steps=2", f"trainer.precision={precision}")
    assert exp.forward_dtypes == {dtype}
    # the weights stay fp32
    assert all(p.dtype == torch.float32 for p in exp.net.parameters())


@pytest.mark.parametrize("log_every", [1, 4])
def test_extra_values_from_training_step_are_logged_as_their_mean(tmp_path, world, log_every):
    """With a gloo group several log intervals, each with loss, mae and grad_norm, share one heartbeat."""
    exp = run(
        tmp_path,
        "trainer.max_steps=4",
        f"trainer.log_every={log_every}",
        "with_mae=true",
        "trainer.accumulate=2",
        "trainer.grad_clip=100",
    )
    ref = Reference(exp, clip=100).train(exp.seen, 2)
    net = copy.deepcopy(ref.net)
    maes = []
    for m, idx in enumerate(exp.seen):
        # micro-batch m is taken with the weights after step m // 2
        net.load_state_dict(ref.weights[m // 2])
        with torch.no_grad():
            maes.append((net(ref.data.x[idx]).squeeze(-1) - ref.data.y[idx]).abs().mean().item())
    train = logged(exp, "train/")
    for step in range(log_every, 5, log_every):
        mine = maes[2 * (step - log_every) : 2 * step]
        assert train[step]["mae"] == pytest.approx(sum(mine) / len(mine), rel=1e-5)
        losses = [v for s in ref.losses[step - log_every : step] for v in s]
        assert train[step]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["n_train=7"], "fewer than one global batch"),
        (["n_train=0"], "is empty"),
    ],
)
def test_a_run_that_cannot_take_a_step_is_refused_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, *overrides)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            "train_unsized",
            r"Regression.train_dataset\(\) returned Unsized, which has no len\(\); return a Dataset with "
            "__len__ and __getitem__",
        ),
        ("eval_unsized", r"Regression.eval_dataset\(\) returned Unsized, which has no len\(\)"),
        ("eval_empty", r"Regression.eval_dataset\(\) is empty \(0 samples\); check the data path"),
    ],
)
def test_a_dataset_without_len_or_samples_is_refused_before_training(tmp_path, data, message):
    exp = Regression(config(tmp_path, f"data={data}"))
    with pytest.raises(ConfigError, match=message):
        exp.fit()
    assert exp.step == 0 and exp.seen == []
    with open(os.path.join(exp.run_dir, ".lock")) as other_job:
        # the failed setup let go of the run folder
        fcntl.flock(other_job, fcntl.LOCK_EX | fcntl.LOCK_NB)


class Ragged(Regression):
    """Samples of two lengths, which default_collate cannot stack."""

    def train_dataset(self):
        return [(torch.zeros(1 + i % 2), torch.zeros(()), i) for i in range(16)]


def no_batch(samples):
    return None


def broken(samples):
    raise ValueError("a bug in the user's own collate_fn")


# in this process, and sent back by a DataLoader worker process
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    "experiment, error, message",
    [
        (
            Ragged,
            ConfigError,
            r"^default_collate cannot make one batch of 8 samples \(RuntimeError: stack expects each "
            r"tensor to be equal size[^\n]*\); give the experiment a collate_fn that pads them",
        ),
        (
            type("NoBatch", (Regression,), {"collate_fn": staticmethod(no_batch)}),
            ConfigError,
            r"^collate_fn no_batch returned None for 8 samples; return the batch, e.g. default_collate\(samples\)$",
        ),
        (type("Broken", (Regression,), {"collate_fn": staticmethod(broken)}), ValueError, "a bug in the user's own"),
    ],
)
def test_a_collate_fn_that_breaks_its_contract_is_one_line_and_a_bug_in_one_keeps_its_error(
    tmp_path, workers, experiment, error, message
):
    exp = experiment(config(tmp_path, "trainer.max_steps=2", f"trainer.num_workers={workers}"))
    before = set(multiprocessing.active_children())
    with pytest.raises(error, match=message):
        exp.fit()
    assert exp.step == 0
    # the loader's workers stopped with the run, not at a later garbage collection (a 5 s wait)
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.slow
def test_an_experiment_without_an_eval_set_trains_and_shows_no_evaluation(tmp_path, capsys):
    exp = run(tmp_path, "trainer.max_steps=3", "trainer.log_every=1", "data=eval_none")
    lines = capsys.readouterr().out.splitlines()
    assert (
        exp.step == 3
        and exp.last_eval == {}
        and "train step 3  loss" in [x for x in lines if x.startswith(("train", "eval"))][-1]
    )
    assert not [line for line in lines if line.startswith("eval")]


@pytest.mark.slow
@pytest.mark.parametrize("epochs", [1, 4])
def test_epoch_ends_without_an_eval_set_do_not_flush_the_log(tmp_path, monkeypatch, epochs):
    """Each flush costs a host sync on a GPU; with nothing to evaluate an epoch's end has no lines
    to put after the training's, so the flushes are the run's own (end, final checkpoint) whatever
    the number of epochs, and every step's line is still written."""
    from ddplab.train.intervals import LogIntervals

    flushes, flush = [], LogIntervals.flush
    monkeypatch.setattr(LogIntervals, "flush", lambda self, step: (flushes.append(step), flush(self, step))[1])
    exp = run(tmp_path, f"trainer.max_epochs={epochs}", "trainer.log_every=1", "data=eval_none")
    assert exp.step == epochs * N_TRAIN // 8 and exp.epochs_ended == list(range(epochs))
    # the end of training, the checkpoint at the end
    assert flushes == [exp.step] * 2
    assert sorted(logged(exp, "train/")) == list(range(1, exp.step + 1))


def test_evaluating_a_checkpoint_needs_an_eval_dataset(tmp_path):
    first = run(tmp_path, "trainer.max_steps=2")
    with pytest.raises(ConfigError, match=r"Regression.eval_dataset\(\) returned None, which has no len\(\)"):
        Regression(config(tmp_path, "run.name=e", "data=eval_none")).evaluate_checkpoint(first.run_dir)
    # one unnamed set: there is nothing to name, so the fix is to name none
    with pytest.raises(
        ConfigError,
        match=r"^Regression.eval_dataset\(\) has one eval set, unnamed, so there is no set 'test'; leave out --set$",
    ):
        Regression(config(tmp_path, "run.name=e")).evaluate_checkpoint(first.run_dir, "test")
    with pytest.raises(
        ConfigError, match=r"^Regression.eval_dataset\(\) returned an empty dict; return at least one eval set"
    ):
        Regression(config(tmp_path, "run.name=e", "data=eval_no_sets")).evaluate_checkpoint(first.run_dir)


@pytest.mark.parametrize(
    "mode, enabled, warn_only",
    [("warn", True, True), ("true", True, False), ("True", True, False), ("false", False, False)],
)
def test_trainer_deterministic_sets_torch_s_deterministic_mode(tmp_path, mode, enabled, warn_only):
    run(tmp_path, "trainer.max_steps=1", f"trainer.deterministic={mode}")
    assert torch.are_deterministic_algorithms_enabled() is enabled
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    assert torch.backends.cudnn.deterministic is enabled and torch.backends.cudnn.benchmark is False
    # unless the user chose
    assert not enabled or os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")


def test_a_batch_moves_to_the_device_whole_and_a_bad_training_step_is_named():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1), 3]), "name": "a"}
    moved = to_device(batch, torch.device("cpu"))
    assert moved.keys() == batch.keys() and type(moved["pair"]) is tuple and type(moved["pair"][1]) is list
    assert moved["pair"][1][1] == 3 and moved["name"] == "a" and torch.equal(moved["x"], batch["x"])
    weight = torch.ones((), requires_grad=True)
    assert split_output({"loss": weight * 2, "acc": 1})[1] == {"acc": 1}
    assert split_output(torch.ones(1) * weight)[0].numel() == 1
    for bad in ({"acc": torch.ones(())}, torch.ones(4), torch.ones(0), 0.5, None, [torch.ones(()), torch.ones(())]):
        with pytest.raises(ConfigError, match=r"training_step returned .*: no one-element loss in it"):
            split_output(bad)
    # a loss that gradients cannot flow from (detached, or made under no_grad): one line, not a traceback
    for no_gradient in (torch.ones(()), (weight * 2).detach()):
        with pytest.raises(ConfigError, match=r"training_step returned a loss with no gradient"):
            split_output(no_gradient)


def test_evaluation_and_checkpoints_at_their_intervals_hold_the_weights_of_that_step(tmp_path, world):
    exp = run(
        tmp_path,
        "trainer.max_steps=9",
        "trainer.eval_every=4",
        "trainer.checkpoint_every=3",
        "checkpoint.keep_last=0",
        "checkpoint.monitor=loss",
        "checkpoint.mode=min",
    )
    ref = Reference(exp).train(exp.seen, 1)
    assert sorted(logged(exp, "eval/")) == [4, 8, 9]
    assert [v["loss"] for v in logged(exp, "eval/").values()] == pytest.approx(
        [ref.eval_loss(s) for s in (4, 8, 9)], rel=1e-5
    )
    saved = list_checkpoints(os.path.join(exp.run_dir, "checkpoints"))
    assert [c.step for c in saved] == [3, 6, 9]
    for c in saved:
        state = load_state(c.path)
        assert state["progress"]["step"] == c.step and state["progress"]["samples_seen"] == 8 * c.step
        assert state["progress"]["epoch"] == c.step // 5 and state["progress"]["step_in_epoch"] == c.step % 5
        for name, tensor in ref.weights[c.step].items():
            assert torch.equal(state["models"]["net"][name], tensor) or torch.allclose(
                state["models"]["net"][name], tensor, rtol=1e-6, atol=1e-7
            ), name
        assert state["schedulers"][0]["last_epoch"] == c.step
    # a metric is stored only with the weights it was computed on: none at 3 and 6 (evaluated at 4
    # and 8); the last checkpoint is written again after the final evaluation at step 9
    assert [c.metric for c in saved[:2]] == [None, None]
    assert saved[2].metric == pytest.approx(ref.eval_loss(9), rel=1e-5)
    assert state["eval_metrics"]["loss"] == pytest.approx(ref.eval_loss(9), rel=1e-5)


def test_a_resumed_run_continues_exactly_where_the_first_stopped(tmp_path, world, capsys):
    first = run(tmp_path, "trainer.max_steps=7", "trainer.log_every=3")
    # the same run.name: resumes
    second = run(tmp_path, "trainer.max_steps=12", "trainer.log_every=3")
    assert (
        f"resumed from {first.run_dir}/checkpoints/step-00000007 at step 7 (epoch 1, step 2 of the epoch)"
        in capsys.readouterr().out
    )
    assert second.step == 12 and len(second.seen) == 5
    ref = Reference(first).train(first.seen + second.seen, 1)
    assert_same_weights(second.net, ref.weights[12])
    epochs = torch.cat(first.seen + second.seen)
    # epoch 0 across the resume
    assert sorted(epochs[:N_TRAIN].tolist()) == list(range(N_TRAIN))
    state = load_state(list_checkpoints(os.path.join(second.run_dir, "checkpoints"))[-1].path)
    assert state["optimizers"][0]["state"][0]["momentum_buffer"].shape == (8, 4)
    train = logged(second, "train/")
    assert train[9]["loss"] == pytest.approx(sum(v for s in ref.losses[7:9] for v in s) / 2, rel=1e-5)


@pytest.mark.parametrize("nan_at", [2, 5])
def test_a_nan_loss_stops_the_run_naming_its_step(tmp_path, world, nan_at):
    with pytest.raises(DdplabError, match=rf"not a finite number .* at step {nan_at} on rank 0"):
        run(
            tmp_path,
            "trainer.max_steps=8",
            "trainer.log_every=4",
            f"nan_at_step={nan_at}",
            "trainer.checkpoint_every=3",
        )
    saved = list_checkpoints(os.path.join(tmp_path, "regression", "r", "checkpoints"))
    # never weights a NaN has reached
    assert [c.step for c in saved] == [s for s in (3,) if s < nan_at]


def test_a_nan_loss_is_caught_by_the_periodic_check_when_nothing_is_saved(tmp_path, world):
    with pytest.raises(DdplabError, match=r"at step 2 on rank 0"):
        run(tmp_path, "trainer.max_steps=8", "trainer.log_every=2", "nan_at_step=2", "checkpoint.at_end=false")


def test_skip_mode_skips_exactly_the_step_whose_gradients_are_not_finite(tmp_path, capsys):
    exp = run(tmp_path, "trainer.max_steps=8", "trainer.nonfinite=skip", "nan_at_step=4", "trainer.log_every=4")
    # the same batches; no optimizer step at 4
    ref = Reference(exp, skip_steps=(4,)).train(exp.seen, 1)
    assert_same_weights(exp.net, ref.weights[8])
    train = logged(exp, "train/")
    assert train[4]["skipped"] == pytest.approx(1 / 4) and train[8]["skipped"] == 0.0
    assert "step 4: gradients are not finite, optimizer step skipped" in capsys.readouterr().out
    # NaN left out
    assert train[4]["loss"] == pytest.approx(sum(ref.losses[s][0] for s in range(3)) / 3, rel=1e-5)


def test_a_stop_signal_saves_at_that_step_and_the_rerun_finishes_the_same(tmp_path):
    stopped = run(tmp_path, "trainer.max_steps=8", "signal_at_step=3", "trainer.log_every=2")
    assert stopped.step == 3 and stopped.trainer.preempted
    saved = list_checkpoints(os.path.join(stopped.run_dir, "checkpoints"))
    assert [c.step for c in saved] == [3]
    rest = run(tmp_path, "trainer.max_steps=8", "trainer.log_every=2")
    ref = Reference(stopped).train(stopped.seen + rest.seen, 1)
    assert rest.step == 8 and len(rest.seen) == 5
    assert_same_weights(rest.net, ref.weights[8])


def test_the_best_checkpoint_is_loaded_at_the_end_and_evaluates_to_its_metric(tmp_path):
    exp = run(
        tmp_path,
        "trainer.max_steps=12",
        "trainer.eval_every=2",
        "trainer.checkpoint_every=2",
        "checkpoint.monitor=loss",
        "checkpoint.mode=min",
        "checkpoint.keep_best=2",
        "load_best=true",
    )
    ref = Reference(exp).train(exp.seen, 1)
    losses = {s: ref.eval_loss(s) for s in range(2, 13, 2)}
    best = min(losses, key=losses.get)
    assert best not in (2, 12), "the scenario needs a best checkpoint that is neither the first nor the last"
    assert exp.best_path.endswith(f"step-{best:08d}")
    assert_same_weights(exp.net, ref.weights[best])
    again = Regression(config(tmp_path, "run.name=again"))
    assert again.evaluate_checkpoint(exp.best_path)["loss"] == pytest.approx(losses[best], rel=1e-5)
    assert again.step == best


def test_resume_with_dropout_is_bitwise_the_uninterrupted_run(tmp_path):
    straight = run(tmp_path, "run.name=straight", "trainer.max_steps=9", "dropout=0.5")
    run(tmp_path, "run.name=resumed", "trainer.max_steps=4", "dropout=0.5")
    resumed = run(tmp_path, "run.name=resumed", "trainer.max_steps=9", "dropout=0.5")
    assert torch.equal(torch.cat(straight.seen[4:]), torch.cat(resumed.seen))
    for name, tensor in straight.net.state_dict().items():
        assert torch.equal(resumed.net.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "change, message",
    [
        ("trainer.global_batch_size=4", "trained with trainer.global_batch_size=8"),
        ("hidden=5", "does not fit network 'net'.*shape mismatch"),
        ("seed=1", "trained with seed=0, this run asks for 1"),
        ("optimizer=adamw", r"trained by optimizers \['SGD'\], this run has \['AdamW'\]"),
        ("network=Stack", r"trained by models \['Sequential'\], this run has \['Stack'\]"),
    ],
)
def test_resume_refuses_a_checkpoint_it_cannot_continue(tmp_path, change, message):
    run(tmp_path, "trainer.max_steps=2")
    with pytest.raises(DdplabError, match=message):
        run(tmp_path, "trainer.max_steps=4", change)


class Renamed(Regression):
    """The same networks and optimizer, in another experiment."""


def test_resume_refuses_a_checkpoint_of_another_experiment(tmp_path):
    first = run(tmp_path, "trainer.max_steps=2")
    with pytest.raises(
        DdplabError,
        match=r"trained by experiment test_loop_reference.Regression, this run has test_loop_reference.Renamed",
    ):
        Renamed(config(tmp_path, "run.name=other", f"run.resume={first.run_dir}")).fit()


def test_a_monitored_metric_the_evaluation_never_returns_is_refused_at_the_first_evaluation(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.monitor='auc' is not a metric .* returns loss\)"):
        run(
            tmp_path,
            "trainer.max_steps=6",
            "trainer.eval_every=2",
            "trainer.checkpoint_every=1",
            "checkpoint.monitor=auc",
        )
    saved = list_checkpoints(os.path.join(tmp_path, "regression", "r", "checkpoints"))
    # the one before the first evaluation, then nothing
    assert [c.step for c in saved] == [1]


class Pickled:
    def __reduce__(self):
        # what a checkpoint that runs code on load holds (harmless here)
        return (print, ("loaded",))


def test_a_checkpoint_that_does_not_load_says_why(tmp_path):
    torch.save({"net": {"w": torch.ones(3)}}, tmp_path / "good.pt")
    good = (tmp_path / "good.pt").read_bytes()
    torch.save({"net": Pickled()}, tmp_path / "pickled.pt")
    cases = {
        "pickled.pt": r"\(it holds pickled Python objects, which ddplab never loads",
        "truncated.pt": r"\(RuntimeError: PytorchStreamReader failed",
        "garbage.pt": r"\(UnpicklingError: damaged or "
        r"not a checkpoint\)",
        "empty.pt": r"\(EOFError: damaged or not a checkpoint\)",
    }
    (tmp_path / "truncated.pt").write_bytes(good[: len(good) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.pt").write_bytes(b"")
    for name, why in cases.items():
        with pytest.raises(DdplabError, match=rf"checkpoint .*{name} cannot be read {why}"):
            load_state(str(tmp_path / name))


def test_every_checkpoint_corrupt_is_an_error_that_lists_them_and_deletes_nothing(tmp_path):
    first = run(tmp_path, "trainer.max_steps=4", "trainer.checkpoint_every=2", "checkpoint.keep_last=0")
    saved = list_checkpoints(os.path.join(first.run_dir, "checkpoints"))
    for c in saved:
        with open(os.path.join(c.path, "state.pt"), "r+b") as f:
            f.truncate(100)
    with pytest.raises(DdplabError, match=r"none of the checkpoints .* \(step-00000002, step-00000004\)"):
        run(tmp_path, "trainer.max_steps=8")
    assert list_checkpoints(os.path.join(first.run_dir, "checkpoints")) == saved


def test_a_run_folder_belongs_to_one_experiment_and_one_job_at_a_time(tmp_path):
    first = run(tmp_path, "trainer.max_steps=2")
    # the same class name, another module
    other = type("Regression", (Regression,), {"__module__": "elsewhere"})
    with pytest.raises(
        ConfigError,
        match=r"belongs to experiment test_loop_reference.Regression, not "
        r"elsewhere.Regression",
    ):
        other(config(tmp_path, "trainer.max_steps=4")).fit()
    # another job holding the folder
    holder = open(os.path.join(first.run_dir, ".lock"), "a+")  # noqa: SIM115 (held: the lock lasts while it is open)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.truncate(0)
    holder.write("pid 4242 on node7 since 2026-01-01 00:00:00")
    holder.flush()
    with pytest.raises(ConfigError, match=r"is in use by pid 4242 on node7"):
        run(tmp_path, "trainer.max_steps=4")
    # the holder ended (a killed job's lock goes with its process): the folder is free again
    holder.close()
    assert run(tmp_path, "trainer.max_steps=4").step == 4


def test_runs_without_a_name_started_in_the_same_second_get_their_own_folders(tmp_path):
    names = {new_run_name() for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(time.strftime("%Y%m%d-")) for n in names)
    a, b = run(tmp_path, "run.name=null", "trainer.max_steps=1"), run(tmp_path, "run.name=null", "trainer.max_steps=1")
    assert a.run_dir != b.run_dir


@pytest.mark.parametrize(
    "output, message",
    [
        # a silent wrong mean before
        ("mean", r"must return one row per sample: it gave \{'loss': 3\} rows for 13 samples"),
        ("scalar", r"evaluation_step returned a dict with 'loss', and its 'loss' is one number for the whole batch"),
        ("float", r"evaluation_step returned a dict with 'loss', and its 'loss' is .*, not one row per sample"),
        ("list", r"evaluation_step returned a list of tensor\(\d+,\), not a dict of per-sample tensors"),
        ("none", r"evaluation_step returned None, not a dict of per-sample tensors"),
    ],
)
def test_an_evaluation_step_that_breaks_its_contract_is_named_instead_of_averaged(tmp_path, output, message):
    with pytest.raises(ConfigError, match=message):
        run(tmp_path, "trainer.max_steps=1", f"eval_output={output}", "trainer.eval_batch_size=5")


@pytest.mark.parametrize("relative", [True, False])
def test_resume_from_a_path_continues_that_checkpoint_in_a_new_run(tmp_path, monkeypatch, relative):
    first = run(tmp_path, "trainer.max_steps=6", "trainer.checkpoint_every=2", "checkpoint.keep_last=0")
    # a relative path, as users type it, or an absolute one
    monkeypatch.chdir(tmp_path)
    where = "regression/r/checkpoints/step-00000004"
    second = run(".", "run.name=from4", f"run.resume={where if relative else tmp_path / where}", "trainer.max_steps=8")
    assert second.step == 8 and len(second.seen) == 4
    ref = Reference(first).train(first.seen[:4] + second.seen, 1)
    assert_same_weights(second.net, ref.weights[8])


def test_every_epoch_checkpoints_come_at_epoch_ends_whatever_the_evaluation_interval(tmp_path):
    exp = run(
        tmp_path,
        "trainer.max_epochs=2",
        "checkpoint.every_epoch=true",
        "trainer.eval_every=3",
        "checkpoint.keep_last=0",
        "checkpoint.at_end=false",
    )
    assert [c.step for c in list_checkpoints(os.path.join(exp.run_dir, "checkpoints"))] == [5, 10]


def test_epochs_of_more_than_256_steps_end_where_they_should(tmp_path):
    """Small integers are shared objects in CPython: a step compared with `is` works up to 256 only."""
    exp = run(
        tmp_path,
        "trainer.max_epochs=2",
        "n_train=300",
        "trainer.global_batch_size=1",
        "trainer.log_every=1000",
        "checkpoint.at_end=false",
    )
    assert (exp.step, exp.epoch, exp.epochs_ended, len(exp.seen)) == (600, 2, [0, 1], 600)
    with open(os.path.join(exp.run_dir, "metrics.jsonl")) as f:
        # each once
        assert [r["step"] for r in map(json.loads, f) if "eval/loss" in r] == [300, 600]


@pytest.mark.parametrize(
    "overrides, saved",
    [
        (["trainer.max_steps=1"], [1]),
        # evaluated at the end already: saved at the end
        (["trainer.max_steps=8", "trainer.eval_every=4"], [8]),
        (["trainer.max_steps=4", "checkpoint.at_end=false"], []),
    ],
)
def test_the_last_step_is_saved_once_when_checkpoint_at_end_asks(tmp_path, overrides, saved):
    exp = run(tmp_path, *overrides)
    assert exp.step == int(overrides[0].split("=")[1])
    assert [c.step for c in list_checkpoints(os.path.join(exp.run_dir, "checkpoints"))] == saved
    with open(os.path.join(exp.run_dir, "metrics.jsonl")) as f:
        eval_steps = [r["step"] for r in map(json.loads, f) if "eval/loss" in r]
    assert len(eval_steps) == len(set(eval_steps)), "an evaluation ran twice at one step"


def test_resume_and_never_given_explicitly_and_global_batches_past_256(tmp_path):
    """Explicit values are strings made at run time (not interned): compared with `is` they fail."""
    run(tmp_path, "run.resume=never", "n_train=600", "trainer.global_batch_size=300", "trainer.max_steps=1")
    again = run(tmp_path, "run.resume=auto", "n_train=600", "trainer.global_batch_size=300", "trainer.max_steps=2")
    # resumed at 1: a batch of 300 is not "another" batch
    assert again.step == 2 and len(again.seen) == 1


def test_networks_load_by_name_and_a_mismatch_names_every_difference():
    from ddplab.checkpoint.state import _load_list, load_matching, load_networks

    net, other = nn.Linear(2, 3), nn.Linear(2, 3)
    # a network more in the file is fine
    load_networks({"net": net}, {"net": other.state_dict(), "extra": {}})
    assert torch.equal(net.weight, other.weight)
    saved = {"weight": torch.zeros(4, 2), "scale": torch.ones(1)}
    with pytest.raises(DdplabError) as e:
        load_matching(net, saved, "net")
    assert str(e.value).startswith(
        "the checkpoint does not fit network 'net': missing ['bias']; unexpected "
        "['scale']; shape mismatch ['weight: checkpoint (4, 2) vs model (3, 2)']"
    )
    # six tensors: the message lists four
    deep = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    with pytest.raises(
        DdplabError,
        match=r"missing \['0.weight', '0.bias', '1.weight', '1.bias'\]; unexpected "
        r"\['a', 'b', 'c', 'd'\]; shape mismatch",
    ):
        load_matching(
            deep, {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0, "2.weight": torch.zeros(5, 2), "2.bias": torch.zeros(2)}
        )
    with pytest.raises(DdplabError, match=r"shape mismatch \['weight: checkpoint \(2, 2\) vs model \(3, 2\)'\]"):
        # smaller, and only that
        load_matching(net, {"weight": torch.zeros(2, 2), "bias": torch.zeros(3)}, "net")
    with pytest.raises(DdplabError, match=r"does not fit network 'net': unexpected \['scale'\]; load a checkpoint"):
        # one tensor more, and only that
        load_matching(net, {**net.state_dict(), "scale": torch.ones(1)}, "net")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(DdplabError, match=r"the checkpoint has 2 optimizer.s., this experiment 1"):
        _load_list("optimizer", [opt], [opt.state_dict(), opt.state_dict()])
    with pytest.raises(DdplabError, match=r"the checkpoint has 1 optimizer.s., this experiment 2"):
        _load_list("optimizer", [opt, opt], [opt.state_dict()])


@pytest.mark.parametrize(
    "length, total", [(["trainer.max_epochs=3"], 3 * (N_TRAIN // 8)), (["trainer.max_steps=7"], 7)]
)
def test_build_knows_the_run_s_length_and_a_schedule_over_it_ends_on_its_last_step(tmp_path, length, total):
    """Accumulation does not change the count (a global batch of 8 is one step, however it is cut);
    a run stopped by a signal and resumed learns the same length and lands on the same last rate."""
    stopped = run(tmp_path, "warmup=2", "trainer.accumulate=2", "signal_at_step=3", *length)
    assert stopped.total_at_build == total and stopped.epoch_steps_at_build == N_TRAIN // 8 and stopped.step == 3
    rest = run(tmp_path, "warmup=2", "trainer.accumulate=2", *length)
    assert rest.total_at_build == total and rest.step == total
    # linear decay reaches 0 after the last step, not before
    assert rest.opt.param_groups[0]["lr"] == 0.0
    # two micro-batches a step, and only the steps after the stop
    assert len(rest.seen) == 2 * (total - 3)


@pytest.mark.parametrize(
    "warmup, total, decay", [(2, 6, "cosine"), (3, 9, "linear"), (0, 4, "cosine"), (1, 5, "linear")]
)
def test_warmup_schedule_follows_torch_s_own_warmup_and_decay_schedulers(warmup, total, decay):
    """The expected rates come from torch's LinearLR / CosineAnnealingLR chained by SequentialLR."""

    def optimizer():
        return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)

    ours, theirs = optimizer(), optimizer()
    mine = ddplab.warmup_schedule(ours, warmup, total, decay=decay, min_factor=0.1)
    S = torch.optim.lr_scheduler
    decaying = (
        S.CosineAnnealingLR(theirs, total - warmup, eta_min=0.04)
        if decay == "cosine"
        else S.LinearLR(theirs, 1.0, 0.1, total - warmup)
    )
    reference = (
        decaying
        if warmup == 0
        else S.SequentialLR(
            theirs, [S.LinearLR(theirs, 1 / warmup, 1.0, max(warmup - 1, 1)), decaying], milestones=[warmup]
        )
    )
    for step in range(total + 1):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-6), step
        ours.step(), theirs.step(), mine.step(), reference.step()


@pytest.mark.parametrize("warmup, total, decay", [(4, 4, "cosine"), (-1, 4, "linear"), (1, 4, "step")])
def test_a_schedule_that_cannot_be_built_is_one_line(warmup, total, decay):
    with pytest.raises(ConfigError, match=r"^warmup_schedule cannot warm up .*; use 0 <= warmup_steps < total_steps"):
        ddplab.warmup_schedule(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), warmup, total, decay=decay)
