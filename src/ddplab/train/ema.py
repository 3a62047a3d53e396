"""`trainer.ema_decay`: an exponential moving average of the weights, kept beside them on the device.

After each optimizer step every floating-point tensor of each network (BatchNorm's statistics too) moves
`ema += (1 - decay)·(w - ema)` in one `_foreach_lerp_` per network with a Python-number weight: no host
sync. Checkpoints hold it (entry "ema"); evaluation (trainer.eval_with_ema), prediction and final/ use
it in place of the trained weights, which are put back bit for bit."""

from contextlib import contextmanager, nullcontext

import torch

from .capability import Capability


class WeightAverage(Capability):
    state_key = "ema"
    of_weights = True

    @classmethod
    def from_settings(cls, settings, models: dict[str, torch.nn.Module]) -> "WeightAverage | None":
        """trainer.ema_decay's average of `models` (0: none), evaluated with it when trainer.eval_with_ema."""
        if not settings.ema_decay:
            return None
        average = cls(models, settings.ema_decay)
        average.evaluate_with_it = settings.eval_with_ema
        return average

    def __init__(self, models: dict[str, torch.nn.Module], decay: float):
        # state_dict()'s tensors share storage with the networks': these are live views
        self.decay = decay
        self.live = {
            name: {k: v for k, v in m.state_dict().items() if v.is_floating_point()} for name, m in models.items()
        }
        self.average = {name: {k: v.clone() for k, v in views.items()} for name, views in self.live.items()}
        self.evaluate_with_it = True

    def after_update(self) -> None:
        self.update()

    def weights(self, purpose: str):
        """final/ holds the average; evaluation and prediction too, unless trainer.eval_with_ema=false."""
        return self.swapped() if purpose == "export" or self.evaluate_with_it else nullcontext()

    @torch.no_grad()
    def update(self) -> None:
        for name, views in self.live.items():
            torch._foreach_lerp_(list(self.average[name].values()), list(views.values()), 1.0 - self.decay)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.average

    def load_state_dict(self, saved: dict | None) -> None:
        """The saved average; none saved (a checkpoint of a run without EMA): start from the weights."""
        _copy(saved or self.live, self.average)

    @contextmanager
    def swapped(self):
        """Inside the block the networks hold the average; after it, their own weights again."""
        own = {name: {k: v.clone() for k, v in views.items()} for name, views in self.live.items()}
        _copy(self.average, self.live)
        try:
            yield
        finally:
            _copy(own, self.live)


@torch.no_grad()
def _copy(source: dict, target: dict) -> None:
    for name, tensors in target.items():
        for key, tensor in tensors.items():
            tensor.copy_(source[name][key])
