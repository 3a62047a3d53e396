"""trainer.oom_backoff's parts (train/oom.py) in this process: the loop against a network that runs out
of memory (torch.OutOfMemoryError, as CUDA raises it) on micro-batches above a size, in the forward or
the backward; the cut of a batch into pieces; what a checkpoint keeps (the gradient sum in buckets is
tests/distributed/test_gradients.py's).
Two ranks, one of them running out, are test_oom_backoff.py's; these are the fast tests the mutation
run of the module uses (scripts/mutation.py)."""

import json
from dataclasses import dataclass

import pytest
import torch

import ddplab
from ddplab.errors import DdplabError
from ddplab.train import oom
from ddplab.train.oom import OomBackoff, split_batch
from helpers import metrics_rows
from test_loop_reference import Cfg, Regression

pytestmark = pytest.mark.timeout(60)


class _OutOfMemoryInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test in the backward)")


@dataclass
class MemoryCfg(Cfg):
    oom_above: int = -1  # micro-batches above this many samples run out of memory (-1: never)
    oom_in: str = "forward"  # or backward
    oom_from_step: int = 1  # the first step that runs out


class MemoryBound(Regression):
    def training_step(self, batch):
        x, y, i = batch
        if 0 <= self.cfg.oom_above < len(y) and self.step + 1 >= self.cfg.oom_from_step:
            if self.cfg.oom_in == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (raised by the test in the forward)")
            x = _OutOfMemoryInBackward.apply(x.requires_grad_())
        return super().training_step((x, y, i))


def _load(tmp_path, *overrides):
    return ddplab.load_config(
        MemoryCfg,
        [
            f"run.dir={tmp_path}",
            "trainer.progress=false",
            "log.tensorboard=false",
            "trainer.global_batch_size=8",
            "trainer.max_steps=6",
            "dropout=0.3",
            *overrides,
        ],
    )


def _params(exp):
    return {k: v.clone() for k, v in exp.net.state_dict().items()}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_runs_out_is_redone_with_halved_micro_batches_and_trains_as_if_they_were_used_from_the_start(
    tmp_path, capsys, where, world
):
    straight = MemoryBound(_load(tmp_path, "run.name=s", "trainer.accumulate=4"))
    straight.fit()
    backoff = MemoryBound(_load(tmp_path, "run.name=b", "trainer.oom_backoff=true", "oom_above=2", f"oom_in={where}"))
    backoff.fit()
    out = [line for line in capsys.readouterr().out.splitlines() if "out of memory" in line]
    assert out == [
        "step 1: out of memory with micro-batches of 8 samples; every rank redoes the step with 4 "
        "(trainer.oom_backoff): the same global batch",
        "step 1: out of memory with micro-batches of 4 samples; every rank redoes the step with 2 "
        "(trainer.oom_backoff): the same global batch",
    ]
    a, b = _params(straight), _params(backoff)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the same samples, in the same pieces
    assert [s.tolist() for s in straight.seen] == [s.tolist() for s in backoff.seen[-len(straight.seen) :]]


@pytest.mark.parametrize(
    ("straight", "backoff"),
    [
        # two micro-batches of 4, each cut in two: every piece's loss weighted 1/4, as four micro-batches of 2
        (["trainer.accumulate=4"], ["trainer.accumulate=2", "oom_above=2"]),
        # four micro-batches of 2 cut into samples: each weighted 1/8 (1/2 of 1/4, not 1/2 to the 4th)
        (["trainer.accumulate=8"], ["trainer.accumulate=4", "oom_above=1"]),
        # backoff on and nothing runs out: the step divides by its micro-batches as DDP's step does
        (["trainer.accumulate=2"], ["trainer.accumulate=2"]),
    ],
)
def test_with_several_micro_batches_a_step_with_backoff_trains_as_the_plain_step(tmp_path, world, straight, backoff):
    plain = MemoryBound(_load(tmp_path, "run.name=s", *straight))
    plain.fit()
    cut = MemoryBound(_load(tmp_path, "run.name=b", "trainer.oom_backoff=true", *backoff))
    cut.fit()
    a, b = _params(plain), _params(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_later_step_that_runs_out_is_named_by_its_own_number(tmp_path, capsys):
    exp = MemoryBound(_load(tmp_path, "run.name=l", "trainer.oom_backoff=true", "oom_above=4", "oom_from_step=4"))
    exp.fit()
    out = [line for line in capsys.readouterr().out.splitlines() if "out of memory" in line]
    assert out == [
        "step 4: out of memory with micro-batches of 8 samples; every rank redoes the step with 4 "
        "(trainer.oom_backoff): the same global batch"
    ]


def test_the_losses_and_metrics_of_a_backed_off_step_are_kept_once(tmp_path):
    straight = MemoryBound(
        _load(tmp_path, "run.name=s", "trainer.accumulate=4", "with_mae=true", "trainer.log_every=1")
    )
    straight.fit()
    backoff = MemoryBound(
        _load(tmp_path, "run.name=b", "trainer.oom_backoff=true", "oom_above=2", "with_mae=true", "trainer.log_every=1")
    )
    backoff.fit()

    def logged(name):
        rows = [
            json.loads(line) for line in (tmp_path / "memorybound" / name / "metrics.jsonl").read_text().splitlines()
        ]
        return [(r.get("step"), r.get("train/loss"), r.get("train/mae")) for r in rows if "train/loss" in r]

    assert logged("b") == logged("s") and len(logged("s")) == 6


def test_a_backed_off_steps_data_wait_is_the_time_its_batches_took(tmp_path, monkeypatch):
    """The step's wait for data is the clock after its batches were fetched less the clock before: on
    a clock that stands still it is nothing, whatever the clock reads."""
    monkeypatch.setattr(oom, "time", type("StillClock", (), {"perf_counter": staticmethod(lambda: 1000.0)}))
    exp = MemoryBound(_load(tmp_path, "run.name=b", "trainer.oom_backoff=true", "trainer.log_every=1"))
    exp.fit()
    rows = metrics_rows(tmp_path / "memorybound" / "b")
    waits = [r["train/data_wait"] for r in rows if "train/data_wait" in r]
    assert len(waits) == 6 and set(waits) == {0.0}


def test_one_sample_too_many_ends_the_run_in_one_line(tmp_path):
    exp = MemoryBound(_load(tmp_path, "run.name=o", "trainer.oom_backoff=true", "oom_above=0"))
    with pytest.raises(DdplabError) as failed:
        exp.fit()
    assert failed.value.cause == "step 1 ran out of memory with one sample per micro-batch (trainer.oom_backoff)"
    assert failed.value.fix.startswith("the model itself does not fit: use trainer.precision=bf16")


def test_a_checkpoint_keeps_the_largest_piece_that_fit_and_a_resume_on_any_size_starts_no_larger():
    backoff = OomBackoff(8, 2, torch.device("cpu"), True)
    assert (backoff.split, backoff.piece, backoff.state_dict()) == (1, 8, {"largest_piece": 8})
    backoff.split = 4
    assert backoff.state_dict() == {"largest_piece": 2}
    # resumed with micro-batches of 16 (half the ranks): pieces of 2 again
    resumed = OomBackoff(16, 1, torch.device("cpu"), True)
    resumed.load_state_dict({"largest_piece": 2})
    assert (resumed.split, resumed.piece) == (8, 2)
    assert resumed.resume_note == (
        "each micro-batch of 16 is cut into 8 pieces of at most 2 samples, the largest that fit before "
        "(trainer.oom_backoff)"
    )
    # pieces that do not divide: the largest is no larger than before
    odd = OomBackoff(7, 1, torch.device("cpu"), True)
    odd.load_state_dict({"largest_piece": 3})
    assert (odd.split, odd.piece) == (3, 3)
    # cut in two is cut too, and said
    halved = OomBackoff(8, 1, torch.device("cpu"), True)
    halved.load_state_dict({"largest_piece": 4})
    assert halved.split == 2 and halved.resume_note.startswith(
        "each micro-batch of 8 is cut into 2 pieces of at most 4"
    )
    for saved in (None, {}, {"largest_piece": 8}, {"largest_piece": 20}):
        fresh = OomBackoff(8, 1, torch.device("cpu"), True)
        fresh.load_state_dict(saved)
        assert fresh.split == 1 and fresh.resume_note is None


def test_halving_says_the_step_and_both_sizes():
    said = []
    backoff = OomBackoff(5, 1, torch.device("cpu"), True)
    experiment = type("E", (), {"print": staticmethod(said.append)})
    backoff.halve(3, experiment)
    backoff.halve(3, experiment)
    assert said == [
        "step 3: out of memory with micro-batches of 5 samples; every rank redoes the step with 3 "
        "(trainer.oom_backoff): the same global batch",
        "step 3: out of memory with micro-batches of 3 samples; every rank redoes the step with 2 "
        "(trainer.oom_backoff): the same global batch",
    ]
    backoff.halve(3, experiment)
    assert backoff.piece == 1
    with pytest.raises(DdplabError, match="step 4 ran out of memory with one sample per micro-batch"):
        backoff.halve(4, experiment)


def test_a_batch_is_cut_along_its_first_dimension_with_each_pieces_share():
    batch = {"x": torch.arange(16).view(8, 2), "y": (torch.arange(8), torch.arange(8) * 10)}
    assert split_batch(batch, 1) == [(batch, 1.0)]
    pieces = split_batch(batch, 3)
    assert [share for _, share in pieces] == [3 / 8, 3 / 8, 2 / 8]
    assert [p["y"][0].tolist() for p, _ in pieces] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert pieces[2][0]["x"].tolist() == [[12, 13], [14, 15]] and pieces[1][0]["y"][1].tolist() == [30, 40, 50]
    # more pieces than samples: one sample each
    assert [share for _, share in split_batch(torch.zeros(2, 3), 4)] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("batch", "leaves"),
    [
        ((torch.zeros(4, 2), ["a", "b", "c", "d"]), "['Tensor', 'str', 'str', 'str']"),
        ((torch.zeros(4), torch.zeros(3)), "['Tensor', 'Tensor']"),
        ((torch.zeros(4), torch.tensor(1.0)), "['Tensor', 'Tensor']"),
        # nothing to cut at all
        ({}, "[]"),
    ],
)
def test_a_batch_that_cannot_be_cut_is_one_line(batch, leaves):
    with pytest.raises(DdplabError) as refused:
        split_batch(batch, 2)
    assert refused.value.cause.endswith(f"that share their first dimension (leaves: {leaves})")
    assert refused.value.fix.startswith("return batches of tensors (collate strings into ids)")


def test_a_world_of_one_asks_no_other_rank_whether_it_ran_out():
    # no process group here: a collective would fail
    alone = OomBackoff(4, 1, torch.device("cpu"), True)
    assert alone.any_rank_ran_out(True) is True and alone.any_rank_ran_out(False) is False


def test_every_rank_learns_that_one_ran_out(gloo_group):
    backoff = OomBackoff(4, 2, torch.device("cpu"), True)
    assert backoff.any_rank_ran_out(True) is True and backoff.any_rank_ran_out(False) is False
