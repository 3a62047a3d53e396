"""`ddplab.Experiment`: the contract between your experiment and ddplab.

Subclass it, fill in the methods under "what a subclass writes", and call `fit()`. Networks
(`nn.Module` attributes with trainable parameters) are moved to the device and wrapped for DDP
after `build()`; optimizers and schedulers are found the same way. The loop is train/loop.py."""

import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .config import Config
from .distributed import runtime
from .distributed.console import print0
from .errors import ConfigError
from .train import inference, returns
from .train.data import BatchPlan
from .train.logs import RunLog
from .train.loop import Trainer


class Experiment:
    config_class: type = Config  # the settings schema: a dataclass extending ddplab.Config
    name: str | None = None  # the run directory's experiment folder; default: the class name
    collate_fn = staticmethod(default_collate)

    def __init__(self, cfg):
        self.cfg = cfg
        self.rt = runtime.current()
        self.trainer = Trainer(self)

    # ---- what a subclass writes -------------------------------------------------------------
    def build(self) -> None:
        raise NotImplementedError("build() creates the networks and optimizers as attributes of self")

    def train_dataset(self) -> Dataset:
        raise NotImplementedError("train_dataset() returns the training Dataset (or an IterableDataset)")

    def train_loader(self):
        """Instead of train_dataset(): an iterable of this rank's micro-batches, read once per epoch (docs/data.md)."""
        return None

    def eval_dataset(self) -> Dataset | dict[str, Dataset] | None:
        # or {name: dataset}: each evaluated exactly, its metrics named '<name>/<metric>'
        return None

    def training_step(self, batch) -> torch.Tensor | dict[str, torch.Tensor]:
        raise NotImplementedError("training_step(batch) returns the loss")

    def count_tokens(self, batch) -> int | torch.Tensor | None:
        """The tokens in a training micro-batch, for tokens/s (a tensor is summed on its device, no sync)."""
        return None

    def evaluation_step(self, batch) -> dict[str, torch.Tensor]:
        raise NotImplementedError("evaluation_step(batch) returns per-sample tensors, e.g. {'loss': ...}")

    def evaluation_metrics(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metrics from the outputs of the whole eval set (every rank sees all of them, in order).
        Default: the mean of each output over all samples."""
        return {k: v.double().mean().item() for k, v in outputs.items()}

    # ---- for `ddplab predict` ------------------------------------------------------------------
    def predict_dataset(self, source: str) -> Dataset:
        """The rows `ddplab predict --input SOURCE` runs over, in order. Default: a dataset of the experiment
        by name, 'train' or one of its eval sets ('eval' when it has one); override it to read a file."""
        sets = {} if (found := self.eval_dataset()) is None else found if isinstance(found, dict) else {"eval": found}
        if source == "train" or source in sets:
            return sets[source] if source in sets else self.train_dataset()
        raise ConfigError(
            f"{type(self).__name__} has no dataset named {source!r} to predict on (it has "
            f"{', '.join(['train', *sets])})",
            "name one, or give the experiment a predict_dataset(source) that reads such a file",
        )

    def predict_step(self, batch) -> dict[str, torch.Tensor]:
        """Per-sample outputs to write, one row per sample. Default, for a classifier (one network; batches
        of inputs, (inputs, targets), or a dict whose entries forward takes by name): the predicted class
        and its probability, from the logits the network returns (a tensor, a 'logits' entry or field,
        or a tuple's first tensor: train/returns.py)."""
        if len(self.models) != 1:
            raise ConfigError(
                f"the default predict_step knows one network, and {type(self).__name__} has {len(self.models)}",
                "write the experiment's predict_step(batch)",
            )
        ((name, network),) = self.models.items()
        logits = returns.logits_of(returns.call_with_inputs(network, batch, name), name).float()
        if logits.ndim == 1 or logits.shape[-1] == 1:
            # one logit: the probability of class 1
            return {"label": (logits.reshape(-1) > 0).long(), "probability": torch.sigmoid(logits.reshape(-1))}
        return {"label": logits.argmax(-1), "probability": logits.softmax(-1).amax(-1)}

    def predict_checkpoint(self, path: str, source: str) -> dict[str, torch.Tensor]:
        """`ddplab predict`: predict_step's outputs for every row of predict_dataset(source), in order."""
        return inference.predict_checkpoint(self.trainer, path, source)

    # ---- hooks for the rare cases -----------------------------------------------------------
    def on_epoch_end(self, epoch: int) -> None: ...

    def on_evaluation_end(self, metrics: dict[str, float]) -> None: ...

    def on_fit_end(self) -> None: ...

    def checkpoint_state(self) -> dict[str, Any]:
        """State of your own that checkpoints must hold, by name: objects with `state_dict()` and
        `load_state_dict()` (a curriculum, a generator of augmentations, a counter). Each is saved
        from this rank and restored on it; a checkpoint from before an entry existed leaves it as is."""
        return {}

    # ---- what a subclass may read -----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.rt.device

    @property
    def experiment_name(self) -> str:
        """The run.dir subfolder."""
        return experiment_folder(type(self))

    @property
    def epoch(self) -> int:
        """Whole epochs done."""
        return self.trainer.progress.epoch

    @property
    def last_eval(self) -> dict[str, float]:
        """The last evaluation's metrics."""
        return self.trainer.evaluation.metrics

    @property
    def total_steps(self) -> int:
        """Of the whole run; in build(): a schedule's length."""
        return self.trainer.total_steps()

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps; in build() too."""
        return self.trainer.count_epoch_steps()

    @property
    def step(self) -> int:
        """Optimizer steps done (the one under way: step + 1)."""
        return self.trainer.progress.step

    @property
    def run_dir(self) -> str:
        """run.dir/<experiment>/<run name>/, the same on every rank."""
        return self.trainer.run_dir

    @property
    def models(self) -> dict[str, nn.Module]:
        """build()'s networks by attribute name, unwrapped."""
        return self.trainer.parts.models

    @property
    def plan(self) -> BatchPlan:
        """The batch plan: global_batch, micro_batch, accumulate, world_size."""
        return self.trainer.plan

    @property
    def run_log(self) -> RunLog:
        """The run's metric sinks (metrics.jsonl, TensorBoard, W&B): `run_log.log(step, metrics, prefix)`
        and `run_log.hparams(hparams, metrics)`. Rank 0 writes; the other ranks' calls do nothing."""
        return self.trainer.run_log

    # ---- what a subclass may call -----------------------------------------------------------
    def log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        """Add a value to the training metrics (kept on device, averaged over ranks at log time)."""
        self.trainer.metrics.add(name, value, weight)

    def print(self, *args: Any) -> None:
        """A console line from rank 0, also kept in the run's log.txt; in any method."""
        self.trainer.say(" ".join(str(a) for a in args))

    def fit(self) -> dict[str, float]:
        """Train to trainer.max_steps / trainer.max_epochs; returns the last evaluation's metrics."""
        for line in foreign_hooks(type(self)):
            print0(f"ddplab: warning: {line}", file=sys.stderr)
        return self.trainer.fit()

    def evaluate(self) -> dict[str, float]:
        """Exact evaluation of the eval set, logged. Every rank must call it at the same step."""
        return self.trainer.evaluate()

    def compute_evaluation(self, dataset: Dataset | None = None) -> dict[str, float]:
        """Metrics of `dataset` (default: the eval set), without logging. Every rank must call it."""
        return self.trainer.compute_evaluation(dataset)

    def save_checkpoint(self) -> None:
        """Checkpoint now. Every rank must call it at the same step (it gathers random states)."""
        self.trainer.save_checkpoint()

    def load_best_checkpoint(self) -> str | None:
        """Load the networks of the best checkpoint (by checkpoint.monitor); returns its path, or
        None when there is none. Every rank reads it."""
        return self.trainer.load_best_checkpoint()

    def evaluate_checkpoint(self, path: str, only: str | None = None) -> dict[str, float]:
        """`ddplab eval`: build, load the networks of a checkpoint and evaluate them (every eval set, or
        the one named `only`); nothing is trained."""
        return inference.evaluate_checkpoint(self.trainer, path, only)


def experiment_folder(target: Any) -> str:
    """The run.dir subfolder of an experiment class (its `name`, else its name in lower case), known
    before any instance exists: to the sweep that plans its trials, to a session that reads its run."""
    return getattr(target, "name", None) or target.__name__.lower()


# Methods another framework calls (Lightning's, most of all) and ddplab never does: an experiment
# moved from there keeps them, and they would be silently skipped. What ddplab calls instead.
FOREIGN_HOOKS = {
    "configure_optimizers": "build() (make the optimizers there, as attributes)",
    "on_fit_start": "build()",
    "on_train_start": "build()",
    "setup": "build()",
    "validation_step": "evaluation_step(batch), returning per-sample tensors",
    "test_step": "evaluation_step(batch) (`ddplab eval --checkpoint RUN` evaluates a run)",
    "on_train_batch_end": "training_step(batch), once per micro-batch",
    "on_train_batch_start": "training_step(batch), once per micro-batch",
    "on_train_epoch_end": "on_epoch_end(epoch)",
    "training_epoch_end": "on_epoch_end(epoch)",
    "on_validation_epoch_end": "on_evaluation_end(metrics)",
    "validation_epoch_end": "on_evaluation_end(metrics)",
    "on_validation_end": "on_evaluation_end(metrics)",
    "on_train_end": "on_fit_end()",
    "train_dataloader": "train_dataset() (or train_loader() for a loader of your own)",
    "val_dataloader": "eval_dataset()",
}


def foreign_hooks(cls: type) -> list[str]:
    """For an experiment class: a line per method it defines that ddplab never calls, naming what
    ddplab calls instead (said once per run, as fit() starts)."""
    own = {name for klass in cls.__mro__ if klass not in Experiment.__mro__ for name in vars(klass)}
    return [
        f"{cls.__name__}.{name} is not a ddplab hook (ddplab never calls it); ddplab calls {instead}"
        for name, instead in FOREIGN_HOOKS.items()
        if name in own and not hasattr(Experiment, name)
    ]
