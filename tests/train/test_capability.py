"""The seam for optional capabilities (train/capability.py), in this process: the loop calls each
hook at its point of the step and in the order of Trainer.capabilities; a capability's state rides
in every checkpoint under its state_key and comes back at a resume (None from a checkpoint that
lacks it); a stop reason ends training at that step and is summary.json's status; a capability's
weights for "evaluate" are the ones evaluation sees."""

from contextlib import contextmanager

import pytest
import torch

from ddplab.train.capability import Capability
from ddplab.train.loop import Trainer
from helpers import summary_of
from test_loop_reference import Regression, config

pytestmark = pytest.mark.timeout(60)


class Recorder(Capability):
    """Notes every hook the loop calls, with the step the run had reached when it was called."""

    def __init__(self, name: str, calls: list, trainer: Trainer, stop_after: int = 0):
        self.name = name
        self.calls = calls
        self.trainer = trainer
        self.stop_after = stop_after
        self.updates = 0
        self.loaded = "never"
        self.state_key = f"recorder_{name}"

    def _note(self, hook: str, *args) -> None:
        self.calls.append((self.name, hook, self.trainer.progress.step, *args))

    def before_training(self, step):
        self._note("before_training", step)

    def after_update(self):
        self.updates += 1
        self._note("after_update")

    def after_evaluation(self, metrics, step):
        self._note("after_evaluation", step, sorted(metrics))

    def before_save(self):
        self._note("before_save")

    def after_step(self, step):
        self._note("after_step", step)

    def stop_reason(self):
        return "stopped early" if self.stop_after and self.trainer.progress.step >= self.stop_after else None

    def closing_line(self, step):
        return f"{self.name} stopped the run at step {step}" if self.stop_reason() else None

    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, saved):
        self.loaded = saved
        self.updates = saved["updates"] if saved else 0


def _with_recorders(monkeypatch, calls: list, recorders: dict) -> None:
    """Trainer._capabilities with two recorders after the settings' own, A then B."""
    built = Trainer._capabilities

    def capabilities(trainer):
        made = [Recorder(name, calls, trainer, **recorders.get(name, {})) for name in ("A", "B")]
        recorders["made"] = made
        return [*built(trainer), *made]

    monkeypatch.setattr(Trainer, "_capabilities", capabilities)


def test_the_loop_calls_each_hook_at_its_point_in_the_lists_order(tmp_path, monkeypatch):
    calls, made = [], {}
    _with_recorders(monkeypatch, calls, made)
    exp = Regression(config(tmp_path, "trainer.max_steps=3", "trainer.eval_every=2", "trainer.checkpoint_every=2"))
    exp.fit()
    a = [call[1:] for call in calls if call[0] == "A"]
    step = [
        ("after_update", 0),
        ("after_step", 1, 1),
        ("after_update", 1),
        ("after_evaluation", 2, 2, ["loss"]),
        ("before_save", 2),
        ("after_step", 2, 2),
        ("after_update", 2),
        ("after_step", 3, 3),
    ]
    # the end: the last evaluation, then the checkpoint at_end
    end = [("after_evaluation", 3, 3, ["loss"]), ("before_save", 3)]
    assert a == [("before_training", 0, 0), *step, *end]
    # every hook on A, then on B: the list's order
    assert [call[0] for call in calls] == [name for _ in a for name in ("A", "B")]
    assert [call[1:] for call in calls if call[0] == "B"] == a


def test_a_capabilitys_state_rides_in_checkpoints_and_comes_back_at_a_resume(tmp_path, monkeypatch):
    calls, made = [], {}
    _with_recorders(monkeypatch, calls, made)
    Regression(config(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every=2")).fit()
    first = made["made"][0]
    assert first.loaded == "never"
    saved = torch.load(next((tmp_path / "regression" / "r" / "checkpoints").glob("step-*/state.pt")))
    assert saved["recorder_A"] == {"updates": 2} and saved["recorder_B"] == {"updates": 2}
    Regression(config(tmp_path, "trainer.max_steps=3")).fit()
    resumed = made["made"][0]
    assert resumed is not first and resumed.loaded == {"updates": 2} and resumed.updates == 3


def test_a_checkpoint_without_the_capabilitys_entry_hands_it_none(tmp_path, monkeypatch):
    Regression(config(tmp_path, "trainer.max_steps=2")).fit()
    calls, made = [], {}
    _with_recorders(monkeypatch, calls, made)
    Regression(config(tmp_path, "trainer.max_steps=3")).fit()
    assert made["made"][0].loaded is None and made["made"][0].updates == 1


def test_a_stop_reason_ends_training_at_that_step_and_is_the_runs_status(tmp_path, monkeypatch, capsys):
    calls, made = [], {"B": {"stop_after": 2}}
    _with_recorders(monkeypatch, calls, made)
    exp = Regression(config(tmp_path, "trainer.max_steps=6"))
    exp.fit()
    assert exp.step == 2
    summary = summary_of(tmp_path / "regression" / "r")
    assert summary["status"] == "stopped early"
    assert "B stopped the run at step 2" in capsys.readouterr().out


class Zeroed(Capability):
    """Evaluation sees the networks' weights set to zero; afterwards their own again."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    @contextmanager
    def weights(self, purpose):
        if purpose != "evaluate":
            yield
            return
        own = {k: v.clone() for k, v in self.trainer.exp.net.state_dict().items()}
        with torch.no_grad():
            for tensor in self.trainer.exp.net.parameters():
                tensor.zero_()
        try:
            yield
        finally:
            self.trainer.exp.net.load_state_dict(own)


def test_evaluation_sees_the_weights_a_capability_gives_it(tmp_path, monkeypatch):
    straight = Regression(config(tmp_path, "run.name=s", "trainer.max_steps=2"))
    straight.fit()
    built = Trainer._capabilities
    monkeypatch.setattr(Trainer, "_capabilities", lambda trainer: [*built(trainer), Zeroed(trainer)])
    zeroed = Regression(config(tmp_path, "run.name=z", "trainer.max_steps=2"))
    zeroed.fit()
    # the same training (evaluation changes nothing it trains), another evaluation
    assert all(torch.equal(a, b) for a, b in zip(straight.net.parameters(), zeroed.net.parameters(), strict=True))
    with Zeroed(straight.trainer).weights("evaluate"):
        of_zeros = straight.trainer.compute_evaluation()
    assert zeroed.last_eval == of_zeros and of_zeros["loss"] != straight.last_eval["loss"]
    # and put back: the trained weights evaluate as before
    assert straight.trainer.compute_evaluation() == straight.last_eval


def test_loading_a_checkpoints_weights_loads_only_what_belongs_with_them(tmp_path, monkeypatch):
    """The best checkpoint's weights at the end of a run, or a checkpoint's for `ddplab eval`, bring
    a capability's state only when it belongs with the weights (the average): never a count or a
    verdict of the run so far."""
    calls, made = [], {}
    _with_recorders(monkeypatch, calls, made)
    exp = Regression(config(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every=1"))
    exp.fit()
    a, b = made["made"]
    b.of_weights = True
    first = torch.load(next((tmp_path / "regression" / "r" / "checkpoints").glob("step-00000001/state.pt")))
    exp.trainer.load_weights(first)
    assert (a.loaded, a.updates) == ("never", 2)
    assert (b.loaded, b.updates) == ({"updates": 1}, 1)
