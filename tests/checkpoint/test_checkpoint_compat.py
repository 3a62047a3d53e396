"""Checkpoints written by an earlier ddplab still resume, bit for bit.

`fixtures/checkpoint-0.1.0/` was written by ddplab 0.1.0 before training state became a mapping of
named objects: step 20 of the Classifier on 2 ranks with dropout, an EMA of the weights and an
early-stop record. Beside it, the final weights (and their EMA) of the same run trained straight to
step 40 by that version. The command that wrote them:

    ddplab run tests/fixtures/experiments.py:Classifier -n 2 trainer.max_steps=20 (then =40) \
        trainer.progress=false log.tensorboard=false trainer.global_batch_size=32 model.dropout=0.1 \
        trainer.ema_decay=0.9 trainer.eval_every=10 trainer.early_stop.monitor=accuracy \
        trainer.early_stop.patience=50
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from ddplab.checkpoint.store import load_state
from helpers import FIXTURES, ddplab_here

EXP = "tests/fixtures/experiments.py:Classifier"
OLD = FIXTURES / "checkpoint-0.1.0"
SETTINGS = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "model.dropout=0.1",
    "trainer.ema_decay=0.9",
    "trainer.eval_every=10",
    "trainer.early_stop.monitor=accuracy",
    "trainer.early_stop.patience=50",
]
pytestmark = pytest.mark.timeout(60)


def _run_from(tmp_path, checkpoint):
    """A run folder whose only checkpoint is `checkpoint`, continued to step 40 on 2 ranks."""
    folder = tmp_path / "classifier" / "r" / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copytree(checkpoint, folder / checkpoint.name)
    where = [f"run.dir={tmp_path}", "run.name=r"]
    return ddplab_here("run", EXP, "-n", "2", *where, *SETTINGS, "trainer.max_steps=40")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_checkpoint_of_ddplab_0_1_0_resumes_bitwise(tmp_path):
    res = _run_from(tmp_path, OLD / "step-00000020")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed from" in res.stdout and "at step 20 (epoch 1, step 4 of the epoch)" in res.stdout
    run = tmp_path / "classifier" / "r"
    params = torch.load(run / "results" / "final.pt", weights_only=True)["params"]
    expected = torch.load(OLD / "straight-40-steps.pt", weights_only=True)["params"]
    assert params.keys() == expected.keys()
    assert all(_same(params[k], expected[k]) for k in expected)
    average = load_file(str(run / "final" / "model.safetensors"))
    expected_average = load_file(str(OLD / "straight-40-steps-ema.safetensors"))
    assert average.keys() == expected_average.keys()
    assert all(_same(average[k], expected_average[k]) for k in expected_average)


def _same(found: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit on the machine that recorded the fixture. Another CPU's kernels may round the last
    bit of a float32 sum otherwise (1.5e-8 seen after 20 steps on one): a restore that went wrong (the
    random streams, the optimizer's moments, the data position) moves the weights by 1e-3 and more."""
    return torch.equal(found, expected) or torch.allclose(found, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_checkpoint_of_an_unknown_layout_names_the_version_that_wrote_it(tmp_path):
    state = load_state(str(OLD / "step-00000020"))
    state["format"] = 99
    state["versions"]["ddplab"] = "9.9.0"
    future = tmp_path / "future" / "step-00000020"
    shutil.copytree(OLD / "step-00000020", future)
    torch.save(state, future / "state.pt")
    res = _run_from(tmp_path, future)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "ddplab 9.9.0" in lines[0] and "layout 99" in lines[0]


@pytest.mark.parametrize(
    "accumulate", [["trainer.accumulate=auto", "trainer.micro_batch_size=8"], ["trainer.accumulate=1"]]
)
def test_a_checkpoint_of_ddplab_0_1_0_predicts_with_any_accumulation_setting(tmp_path, accumulate):
    """Its batch plan lacks the accumulation it trained with: the settings give it, for that run's
    world size (with auto, `int("auto")` once ended `ddplab predict` in a traceback)."""
    import ddplab
    from fixtures.experiments import Cfg, Classifier

    settings = [f"run.dir={tmp_path}", *SETTINGS, *accumulate]
    exp = Classifier(ddplab.load_config(Cfg, settings))
    outputs = exp.predict_checkpoint(str(OLD / "step-00000020"), "eval")
    rows = len(exp.eval_dataset())
    assert all(len(column) == rows for column in outputs.values()) and outputs
