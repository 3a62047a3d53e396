"""`ddplab.Experiment`: write the science, get the distributed training loop.

A subclass fills in:

    build()                    create networks, optimizers, schedulers as attributes of self
    train_dataset()            a map-style Dataset
    training_step(batch)       -> loss, or {"loss": loss, "acc": ...}
    eval_dataset()             optional Dataset for exact distributed evaluation
    evaluation_step(batch)     -> {"name": per-sample tensor, ...}
    evaluation_metrics(out)    optional: metrics from the outputs of the whole eval set

Networks (`nn.Module` attributes with trainable parameters) are moved to the device and wrapped
for DDP after `build()`; optimizers and schedulers are found the same way. The loop below is the
whole story: seed, build, then { step, log, evaluate } until done.
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import Dataset, default_collate

from . import collectives, runtime
from .config import Config
from .data import BatchPlan, eval_loader, steps_per_epoch, train_loader
from .errors import ConfigError
from .checkpoint import CheckpointManager, load_latest_valid, load_state, resolve_checkpoint
from .export import export_final
from .logs import Progress, RunLog, format_metrics, write_line
from .heartbeat import Beat, Heartbeat
from .preemption import StopSignals
from .state import experiment_state, load_matching, restore_experiment
from .metrics import MetricTracker
from .rundir import prepare_run_dir, write_run_info
from .training import NO_CONTEXT, NonFiniteGuard, Precision, clip_gradients, split_output
from .wrapping import has_trainable_parameters, no_sync, wrap


class Experiment:
    config_class: type = Config
    name: str | None = None  # the run directory's experiment folder; default: the class name
    collate_fn = staticmethod(default_collate)

    def __init__(self, cfg):
        self.cfg = cfg
        self.rt = runtime.current()
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.step_in_epoch = 0
        self.run_dir: str | None = None
        self.metrics = MetricTracker(self.rt.device)
        self.last_eval: dict[str, float] = {}
        self.preempted = False
        self._evaluated_at = self._saved_at = -1
        self._heartbeat: Heartbeat | None = None  # the loop's periodic collective, during fit()
        # Each micro-batch's loss (detached) since the last hand-over, in one list that becomes the
        # logged mean and goes to the NaN check (`_hand_over_losses`): keeping every loss in two
        # places cost more host time per step than anything else the loop adds.
        self._losses: list[torch.Tensor] = []
        self._losses_from_step = 1

    # ---- what a subclass writes -------------------------------------------------------------
    def build(self) -> None:
        raise NotImplementedError("build() creates the networks and optimizers as attributes of self")

    def train_dataset(self) -> Dataset:
        raise NotImplementedError("train_dataset() returns the training Dataset")

    def eval_dataset(self) -> Dataset | None:
        return None

    def training_step(self, batch) -> torch.Tensor | dict[str, torch.Tensor]:
        raise NotImplementedError("training_step(batch) returns the loss")

    def evaluation_step(self, batch) -> dict[str, torch.Tensor]:
        raise NotImplementedError("evaluation_step(batch) returns per-sample tensors, e.g. {'loss': ...}")

    def evaluation_metrics(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metrics from the outputs of the whole eval set (every rank sees all of them, in order).
        Default: the mean of each output over all samples."""
        return {k: v.double().mean().item() for k, v in outputs.items()}

    # ---- hooks for the rare cases -----------------------------------------------------------
    def on_epoch_end(self, epoch: int) -> None: ...

    def on_evaluation_end(self, metrics: dict[str, float]) -> None: ...

    def on_fit_end(self) -> None: ...

    # ---- what a subclass may use ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.rt.device

    @property
    def experiment_name(self) -> str:
        return self.name or type(self).__name__.lower()

    def log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        """Add a value to the training metrics (kept on device, averaged over ranks at log time)."""
        self.metrics.add(name, value, weight)

    def print(self, *args: Any) -> None:
        """A console line from rank 0, also kept in the run's log.txt."""
        self._log.text(" ".join(str(a) for a in args))

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to trainer.max_steps / trainer.max_epochs; returns the last evaluation's metrics."""
        self.setup()
        total = self.total_steps()
        self._banner(total)
        self._begin_training(total)
        try:
            while self.step < total and not self.preempted:
                batches = iter(self._train_loader())
                while self.step < total and self.step_in_epoch < self.steps_per_epoch:
                    if self._train_step(batches):
                        break
                if self.step_in_epoch == self.steps_per_epoch and not self.preempted:
                    self._end_epoch()
            if not self.preempted:
                self._finish()
        finally:
            self._end_training()
        return self.last_eval

    def save_checkpoint(self) -> None:
        """Checkpoint now. Every rank must call it at the same step (it gathers RNG states)."""
        self._hand_over_losses()
        self._flush_log()
        self.nonfinite.check()  # never save weights that a NaN loss has already reached
        state = experiment_state(self)
        metric = self.last_eval.get(self.cfg.checkpoint.monitor) if self.cfg.checkpoint.monitor else None
        self.checkpoints.save(state, self.step, self.epoch, metric)
        self._saved_at = self.step

    def setup(self) -> None:
        """Seed, run directory, build, wrap, data, resume: everything before the first step."""
        cfg = self.cfg
        seed_everything(cfg.seed)
        self.run_dir = prepare_run_dir(cfg, self.experiment_name, self.rt.is_main)
        self.precision = Precision(cfg.trainer.precision, self.device)
        self.nonfinite = NonFiniteGuard(cfg.trainer.nonfinite, self.device, self.rt.rank, self.rt.world_size)
        self.build()
        self._collect_components()
        # Per-rank randomness (dropout) from here on; initial weights above are the same everywhere.
        seed_everything(cfg.seed + 7919 * (self.rt.rank + 1))
        self.plan = BatchPlan(cfg.trainer.global_batch_size, self.rt.world_size, cfg.trainer.accumulate)
        # A plain dataclass for the per-step reads: an OmegaConf lookup costs microseconds each.
        self._trainer = OmegaConf.to_object(cfg.trainer)
        self._train_set = self.train_dataset()
        self._eval_set = self.eval_dataset()
        self.steps_per_epoch = steps_per_epoch(len(self._train_set), self.plan.global_batch)
        self._check_dataset_size(len(self._train_set))
        c = cfg.checkpoint
        self.checkpoints = CheckpointManager(os.path.join(self.run_dir, "checkpoints"), c.keep_last, c.keep_best,
                                             c.monitor or None, c.mode, c.async_save, self.rt.is_main)
        wandb_id = self._resume()
        self._log = RunLog(self.run_dir, cfg, self.rt.is_main, wandb_id)
        if self.rt.is_main:
            p = self.plan
            write_run_info(self.run_dir, {
                "experiment": self.experiment_name, "world_size": self.rt.world_size, "backend": self.rt.backend,
                "device": self.device.type, "global_batch": p.global_batch, "micro_batch": p.micro_batch,
                "accumulate": p.accumulate, "steps_per_epoch": self.steps_per_epoch, "resumed_at_step": self.step})

    def _check_dataset_size(self, n: int) -> None:
        if n == 0:
            raise ConfigError(f"{type(self).__name__}.train_dataset() is empty (0 samples)",
                              "check the data path and any filtering of the data")
        if n < self.rt.world_size:
            raise ConfigError(f"the training set has {n} samples, fewer than the {self.rt.world_size} ranks "
                              "(every rank needs at least one sample per step)", "use more data or fewer processes")
        if self.steps_per_epoch == 0:
            raise ConfigError(f"the training set has {n} samples, fewer than one global batch "
                              f"(trainer.global_batch_size={self.plan.global_batch})",
                              "lower trainer.global_batch_size or use more data")

    def total_steps(self) -> int:
        """trainer.max_steps when set (epochs run on as needed), else trainer.max_epochs whole epochs."""
        t = self.cfg.trainer
        if t.max_steps > 0:
            return t.max_steps
        if t.max_epochs > 0:
            return t.max_epochs * self.steps_per_epoch
        raise ConfigError("neither trainer.max_steps nor trainer.max_epochs is set", "set one of them above 0")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact evaluation over the whole eval set: unpadded shards, unwrapped forward, gathered
        outputs in dataset order. Every rank gets the same metrics."""
        self._flush_log()  # the training lines up to this step come first
        metrics = self.compute_evaluation()
        self.last_eval, self._evaluated_at = metrics, self.step
        self._log.log(self.step, metrics, prefix="eval/")
        self._log.text(f"eval  step {self.step}  " + format_metrics(metrics))
        self.on_evaluation_end(metrics)
        return metrics

    @torch.no_grad()
    def compute_evaluation(self, dataset: Dataset | None = None) -> dict[str, float]:
        """Metrics of `dataset` (default: the eval set), without logging. Every rank must call it."""
        dataset = self._eval_set if dataset is None else dataset
        if dataset is None:
            return {}
        outputs = self._gather_outputs(self._evaluation_outputs(dataset))
        return self.evaluation_metrics(outputs) if outputs else {}

    def load_best_checkpoint(self) -> str | None:
        """Load the networks of the best checkpoint (by checkpoint.monitor) into this experiment;
        returns its path, or None when there is none. Every rank reads it."""
        self.checkpoints.wait()
        best = self.checkpoints.best()
        if not best:
            return None
        state = load_state(best[0].path, map_location=self.device)
        for name, model in self.models.items():
            load_matching(model, state["models"][name], name)
        return best[0].path

    def evaluate_checkpoint(self, path: str) -> dict[str, float]:
        """`ddplab eval`: load the networks of a checkpoint and evaluate them; nothing is trained."""
        seed_everything(self.cfg.seed)
        self.precision = Precision(self.cfg.trainer.precision, self.device)
        self.build()
        self._collect_components(wrap_models=False)
        self.plan = BatchPlan(self.cfg.trainer.global_batch_size, self.rt.world_size, 1)
        self._eval_set = self.eval_dataset()
        if self._eval_set is None:
            raise ConfigError(f"{type(self).__name__} has no eval_dataset()", "define eval_dataset() to evaluate")
        state = load_state(resolve_checkpoint(path), map_location=self.device)
        for name, model in self.models.items():
            if name not in state.get("models", {}):
                raise ConfigError(f"checkpoint {path} has no network '{name}'", "pass a checkpoint of this experiment")
            load_matching(model, state["models"][name], name)
        self.step = state.get("progress", {}).get("step", 0)
        return self.compute_evaluation()

    # ---- internals ---------------------------------------------------------------------------
    def _begin_training(self, total: int) -> None:
        """The progress bar, the stop signals and the heartbeat, for the loop that follows."""
        self._progress = Progress(total, self.step, self.cfg.trainer.progress and self.rt.is_local_main,
                                  self.rt.node_rank if self.rt.cluster.num_nodes > 1 else None)
        self._signals = StopSignals(self.cfg.checkpoint.preempt_signals)
        self._heartbeat = Heartbeat(self.metrics, self.nonfinite, self._signals, self.device, self.rt.distributed,
                                    self.step)
        self._tick = (time.perf_counter(), self.step)
        self._losses, self._losses_from_step = [], self.step + 1
        for m in self._wrapped:
            m.train()  # once here and again after each evaluation, not on every step

    def _train_step(self, batches: Iterator) -> bool:
        """One optimizer step and what follows it (log, evaluate, save, agree with the other
        ranks); True when the ranks agreed to stop for a signal (a checkpoint is saved)."""
        self._optimizer_step(batches)
        self._progress.update()
        self._after_step()
        if self._act_on(self._heartbeat.after_step(self.step)):
            self._stop_for_preemption(self._signals.received)
            return True
        return False

    def _end_training(self) -> None:
        self._signals.close()
        self._heartbeat = None
        self._progress.close()
        self.checkpoints.wait()
        self._log.close()

    def _after_step(self) -> None:
        t = self._trainer
        if self.step % t.log_every == 0:
            self._end_log_interval()
        elif len(self._losses) >= NonFiniteGuard.FOLD:  # bounded memory when logging is rare
            self._hand_over_losses()
        if t.eval_every and self.step % t.eval_every == 0:
            self.evaluate()
        if t.checkpoint_every and self.step % t.checkpoint_every == 0:
            self.save_checkpoint()

    def _end_epoch(self) -> None:
        self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.on_epoch_end(self.epoch - 1)
        if not self.cfg.trainer.eval_every and self._evaluated_at != self.step:
            self.evaluate()
        if self.cfg.checkpoint.every_epoch and self._saved_at != self.step:
            self.save_checkpoint()

    def _finish(self) -> None:
        """Last log, evaluation and checkpoint, then on_fit_end (which may swap in the best
        weights, e.g. to report and export the best model), then the export of final/."""
        self._log_training()
        if self._evaluated_at != self.step:
            self.evaluate()
        if self.cfg.checkpoint.at_end and self._saved_at != self.step:
            self.save_checkpoint()
        self.checkpoints.wait()
        self.on_fit_end()
        if self.rt.is_main:
            export_final(self, os.path.join(self.run_dir, "final"))

    def _stop_for_preemption(self, signal_name: str | None) -> None:
        self.preempted = True
        self._flush_log()
        if self._saved_at != self.step:
            self.save_checkpoint()
        self.checkpoints.wait()
        self.print(f"stopped by {signal_name or 'a signal on another rank'} at step {self.step}: checkpoint saved "
                   f"in {self.run_dir}; run the same command again to continue")

    def _resume(self) -> str | None:
        """Load the checkpoint run.resume asks for; returns the W&B run id to re-attach to."""
        mode = self.cfg.run.resume
        if mode == "never":
            return None
        if mode == "auto":
            found = load_latest_valid(self.checkpoints.directory, map_location=self.device)
            if found is None:
                return None
            info, state = found
        else:
            info = None
            state = load_state(resolve_checkpoint(mode), map_location=self.device)
        note = restore_experiment(self, state)
        self._saved_at = self.step
        where = info.path if info else mode
        if self.rt.is_main:
            write_line(f"resumed from {where} at step {self.step} (epoch {self.epoch}, step {self.step_in_epoch} "
                       "of the epoch)" + (f"; note: {note}" if note else ""))
        return state.get("loggers", {}).get("wandb_id")

    def _collect_components(self, wrap_models: bool = True) -> None:
        """Find the networks, optimizers and schedulers that build() assigned to self."""
        models: dict[str, nn.Module] = {}
        optimizers: list[torch.optim.Optimizer] = []
        schedulers: list[Any] = []
        for name, value in list(vars(self).items()):
            if isinstance(value, nn.Module) and not _is_metric(value):
                value.to(self.device)
                if has_trainable_parameters(value):
                    models[name] = value
                    if wrap_models:
                        setattr(self, name, wrap(value, self.cfg.dist, self.device, self.rt.distributed))
            else:  # an optimizer or scheduler, or a list of them (one per replicate network)
                for item in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(item, torch.optim.Optimizer):
                        optimizers.append(item)
                    elif isinstance(item, torch.optim.lr_scheduler.LRScheduler):
                        schedulers.append(item)
        if not models or not optimizers:
            raise ConfigError(f"{type(self).__name__}.build() made no trainable network or no optimizer",
                              "assign them to attributes of self, e.g. self.net = Net(); self.opt = AdamW(...)")
        self.models, self.optimizers, self.schedulers = models, optimizers, schedulers

    @property
    def _wrapped(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.models]

    def _train_loader(self):
        t = self.cfg.trainer
        return train_loader(self._train_set, self.plan, self.rt.rank, self.cfg.seed, self.epoch, self.step_in_epoch,
                            self.collate_fn, t.num_workers, self.device.type == "cuda")

    def _optimizer_step(self, batches: Iterator) -> None:
        t, accumulate = self._trainer, self.plan.accumulate
        skip_nonfinite = t.nonfinite == "skip"
        on_accelerator = self.device.type != "cpu"  # on CPU the batch is where it must be
        for micro in range(accumulate):
            batch = next(batches)
            if on_accelerator:
                batch = to_device(batch, self.device)
            with no_sync(self._wrapped) if micro < accumulate - 1 else NO_CONTEXT:
                with self.precision.autocast():
                    loss, extra = split_output(self.training_step(batch))
                self.precision.backward(loss / accumulate if accumulate > 1 else loss)
            if skip_nonfinite:  # a NaN must not poison the logged mean: weight it 0
                finite = torch.isfinite(loss.detach()).double()
                self.metrics.add("loss", torch.nan_to_num(loss.detach(), 0.0, 0.0, 0.0), finite)
            else:
                self._losses.append(loss.detach())
            for key, value in extra.items():
                self.metrics.add(key, value)
        if t.grad_clip or skip_nonfinite:
            for opt in self.optimizers:
                self.precision.unscale(opt)
        if t.grad_clip:
            self.metrics.add("grad_norm", clip_gradients(self._wrapped, t.grad_clip))
        if skip_nonfinite and not self.nonfinite.gradients_finite(self._wrapped):
            self.precision.skip()
            self.metrics.add("skipped", 1.0)
            self.print(f"step {self.step + 1}: gradients are not finite, optimizer step skipped (trainer.nonfinite=skip)")
        else:
            self.precision.step(self.optimizers)
            if skip_nonfinite:
                self.metrics.add("skipped", 0.0)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for sched in self.schedulers:
            sched.step()
        self.step += 1
        self.step_in_epoch += 1

    def _log_training(self) -> None:
        """Log the training metrics up to now (at the end of training)."""
        self._end_log_interval()
        self._flush_log()

    def _hand_over_losses(self) -> None:
        """The losses kept since the last hand-over join the logged 'loss' and the NaN check."""
        losses, first = self._losses, self._losses_from_step
        self._losses, self._losses_from_step = [], self.step + 1
        if losses:
            self.metrics.add_all("loss", losses)
            self.nonfinite.watch(losses, first, self.plan.accumulate)

    def _end_log_interval(self) -> None:
        """Close the log interval: its metrics wait for the next heartbeat's collective."""
        self._hand_over_losses()
        now, then = time.perf_counter(), self._tick
        steps = self.step - then[1]
        if not steps:
            return
        known = {"lr": self.optimizers[0].param_groups[0]["lr"],
                 "samples_per_s": steps * self.plan.global_batch / max(now - then[0], 1e-9),
                 "epoch": self.epoch + self.step_in_epoch / self.steps_per_epoch, "time": round(time.time(), 3)}
        self._tick = (now, self.step)
        self._heartbeat.end_interval(self.step, known)

    def _flush_log(self) -> None:
        """Every rank, at the same step: write every finished log line now."""
        if self._heartbeat is not None:
            self._act_on(self._heartbeat.flush(self.step))

    def _act_on(self, beat: Beat) -> bool:
        """Write the beat's log lines, stop on a non-finite loss; True when the ranks agreed to
        stop for a signal."""
        if beat.lines:
            lines = [(step, metrics, metrics.pop("time")) for step, metrics in beat.lines]
            self._log.log_lines(lines, prefix="train/")
            self._progress.show(lines[-1][1])
            if not (self._trainer.progress and self.rt.is_local_main):
                self._log.text("\n".join(f"train step {step}  " + format_metrics(m) for step, m, _ in lines))
        if beat.nonfinite:
            self.nonfinite.check()
        return beat.stop

    def _evaluation_outputs(self, dataset: Dataset) -> dict[str, torch.Tensor]:
        t = self.cfg.trainer
        loader = eval_loader(dataset, t.eval_batch_size or self.plan.micro_batch, self.rt.rank,
                             self.rt.world_size, self.collate_fn, t.num_workers, self.device.type == "cuda")
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        with self._unwrapped_models():
            for batch in loader:
                with self.precision.autocast():
                    out = self.evaluation_step(to_device(batch, self.device))
                for key, value in out.items():
                    parts[key].append(value.detach())
        return {k: torch.cat(v) for k, v in parts.items()}

    def _gather_outputs(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Concatenate every rank's outputs in rank order, i.e. dataset order. A rank whose shard
        is empty learns the output names, dtypes and shapes from rank 0."""
        layout = collectives.broadcast_object({k: (v.dtype, tuple(v.shape[1:])) for k, v in local.items()})
        out = {}
        for key in sorted(layout):
            dtype, tail = layout[key]
            mine = local.get(key, torch.empty((0, *tail), dtype=dtype, device=self.device))
            out[key] = collectives.gather_concat(mine)
        return out

    @contextmanager
    def _unwrapped_models(self):
        """Evaluate on the bare networks: DDP's forward may broadcast buffers, a collective that
        would hang when ranks have different numbers of eval batches."""
        wrapped = {name: getattr(self, name) for name in self.models}
        try:
            for name, model in self.models.items():
                setattr(self, name, model)
                model.eval()
            yield
        finally:
            for name, model in wrapped.items():
                setattr(self, name, model)
                model.train()

    def _banner(self, total: int) -> None:
        p, rt = self.plan, self.rt
        self.print(
            f"{self.experiment_name}: {rt.world_size} process(es) on {rt.device.type} ({rt.backend}), "
            f"micro-batch {p.micro_batch} per rank x accumulate {p.accumulate} x {rt.world_size} ranks "
            f"= global batch {p.global_batch}; {self.steps_per_epoch} steps/epoch, {total} steps; run dir {self.run_dir}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors in nested lists/tuples/dicts to the device (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _is_metric(module: nn.Module) -> bool:
    """torchmetrics metrics are nn.Modules but not networks: move them, never wrap them."""
    return any(cls.__module__.startswith("torchmetrics") for cls in type(module).__mro__)
