"""trainer.ema_decay: the moving average of the weights, its checkpoints, evaluation and export."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddplab.checkpoint.store import load_state
from ddplab.config import TrainerConfig
from ddplab.train.ema import WeightAverage
from helpers import ddplab_here, experiment_of

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "model.dropout=0.1",
    "trainer.ema_decay=0.8",
]


def test_the_average_moves_by_one_minus_decay_and_swapping_puts_the_weights_back_bit_for_bit():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = WeightAverage({"net": net}, decay=0.75)
    expected = {k: v.clone() for k, v in net.state_dict().items() if v.is_floating_point()}
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        # training mode: BatchNorm's running statistics move too
        net(torch.randn(8, 3))
        ema.update()
        expected = {k: e + 0.25 * (net.state_dict()[k] - e) for k, e in expected.items()}
    average = ema.state_dict()["net"]
    # an integer: not averaged
    assert set(average) == set(expected) and "1.num_batches_tracked" not in average
    assert all(torch.allclose(average[k], expected[k], atol=1e-6) for k in expected)
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    with ema.swapped():
        assert all(torch.equal(net.state_dict()[k], average[k]) for k in average)
    assert all(torch.equal(net.state_dict()[k], trained[k]) for k in trained)
    assert not torch.equal(average["0.weight"], trained["0.weight"])


def _settings(decay: float, eval_with_ema: bool = True):
    return TrainerConfig(ema_decay=decay, eval_with_ema=eval_with_ema)


def test_the_average_is_made_only_with_a_decay_and_its_weights_are_used_as_the_settings_say():
    net = nn.Linear(2, 2)
    assert WeightAverage.from_settings(_settings(0.0), {"net": net}) is None
    with torch.no_grad():
        net.weight.fill_(1.0)
    kept = WeightAverage.from_settings(_settings(0.4), {"net": net})
    without = WeightAverage.from_settings(_settings(0.4, eval_with_ema=False), {"net": net})
    assert kept.state_key == "ema" and kept.of_weights
    with torch.no_grad():
        net.weight.fill_(2.0)
    kept.update()
    # 0.6 of the way from 1 to 2
    assert torch.allclose(kept.state_dict()["net"]["weight"], torch.full((2, 2), 1.6))
    for average, purpose, swapped in [
        (kept, "evaluate", True),
        (kept, "export", True),
        (without, "evaluate", False),
        (without, "export", True),
    ]:
        with average.weights(purpose):
            seen = net.weight.clone()
        assert torch.equal(seen, average.state_dict()["net"]["weight"]) is swapped, (purpose, swapped)
        assert torch.equal(net.weight, torch.full((2, 2), 2.0))


def test_a_checkpoint_without_an_average_starts_it_from_the_loaded_weights():
    net = nn.Linear(2, 2)
    average = WeightAverage({"net": net}, decay=0.5)
    with torch.no_grad():
        net.weight.fill_(3.0)
    average.load_state_dict(None)
    assert torch.equal(average.state_dict()["net"]["weight"], torch.full((2, 2), 3.0))
    saved = {"net": {k: torch.full_like(v, 5.0) for k, v in net.state_dict().items()}}
    average.load_state_dict(saved)
    assert torch.equal(average.state_dict()["net"]["bias"], torch.full((2,), 5.0))
    assert torch.equal(net.weight, torch.full((2, 2), 3.0))
    # made directly (not from settings), it is what evaluation sees
    with average.weights("evaluate"):
        assert torch.equal(net.weight, torch.full((2, 2), 5.0))


def _run(tmp_path, name, *args):
    res = ddplab_here("run", EXP, "-n", "2", f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / "classifier" / name


def _eval(run, *args):
    """The run's last checkpoint evaluated in this process, with the settings ARGS changed."""
    return experiment_of(EXP, run, *args).evaluate_checkpoint(str(run))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_average_resumes_bitwise_is_what_evaluation_sees_and_is_what_final_holds(tmp_path):
    straight = _run(tmp_path, "straight", "trainer.max_steps=24")
    # mid-epoch (16 steps an epoch)
    _run(tmp_path, "resumed", "trainer.max_steps=10")
    resumed = _run(tmp_path, "resumed", "trainer.max_steps=24")
    a, b = (load_state(str(r / "checkpoints" / "step-00000024")) for r in (straight, resumed))
    assert a["ema"]["net"].keys() == b["ema"]["net"].keys() == a["models"]["net"].keys()
    assert all(torch.equal(a["ema"]["net"][k], b["ema"]["net"][k]) for k in a["ema"]["net"])
    assert not torch.equal(a["ema"]["net"]["0.weight"], a["models"]["net"]["0.weight"])

    exported = load_file(str(straight / "final" / "model.safetensors"))
    assert all(torch.equal(exported[k], a["ema"]["net"][k]) for k in exported)
    meta = json.loads((straight / "final" / "meta.json").read_text())
    assert meta["weights"] == "ema" and meta["ema_decay"] == 0.8

    # the evaluation at step 24
    in_run = json.loads((straight / "results" / "eval.json").read_text())
    averaged, trained = _eval(straight), _eval(straight, "trainer.eval_with_ema=false")
    # here 1 process, in the run 2: float sums differ a little
    assert averaged == pytest.approx(in_run, rel=1e-7)
    assert abs(trained["loss"] - averaged["loss"]) > 1e-4
    # the trained weights, as without EMA
    assert trained == _eval(straight, "trainer.ema_decay=0")
