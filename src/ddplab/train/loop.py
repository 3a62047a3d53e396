"""The training loop behind `Experiment.fit()`: set up, then { step, log, evaluate, save } until done.

`fit` is the whole story on one screen; each part lives beside it: the step (step.py), the log interval
and heartbeat (intervals.py), the batches (sources.py, data.py), evaluation, checkpoint/state.py."""

import os

import torch
from omegaconf import OmegaConf
from torch.utils.data import IterableDataset

from .. import seeding
from ..checkpoint import state as checkpoint_state
from ..checkpoint.export import export_final
from ..checkpoint.store import CheckpointManager, load_latest_valid, load_state, resolve_checkpoint
from ..distributed import collectives
from ..distributed.wrapping import compile_network, wrap
from ..entries import entry_of
from ..errors import ConfigError
from . import components
from .data import BatchPlan, sized
from .ema import WeightAverage
from .evaluation import dataset_outputs, evaluate_dataset
from .intervals import LogIntervals
from .logs import RunLog, format_metrics, progress_bar, write_line
from .metrics import MetricTracker
from .nonfinite import NonFiniteGuard
from .precision import NO_CONTEXT, Precision
from .progress import TrainProgress
from .rundir import experiment_identity, prepare_run_dir, release_run_dir, write_run_info
from .signals import StopSignals
from .sources import TrainData
from .step import optimizer_step
from .summary import end_of_run


class Trainer:
    """One experiment's training run. Created with the experiment; `fit()` does the rest."""

    def __init__(self, exp):
        self.exp, self.cfg, self.rt, self.device = exp, exp.cfg, exp.rt, exp.rt.device
        self.progress = TrainProgress()
        self.metrics = MetricTracker(self.device)
        self.last_eval, self.run_dir, self.preempted = {}, None, False  # metrics; run.dir/<exp>/<name>; by a signal
        self.data = self.epoch_steps = None  # read at setup, or earlier when build() asks for the run's length
        self.intervals: LogIntervals | None = None  # during fit() only
        self._evaluated_at = self._saved_at = -1
        self.early_stop = {"best": None, "step": 0, "bad": 0}  # trainer.early_stop's record, kept in checkpoints

    def fit(self) -> dict[str, float]:
        """Train to trainer.max_steps / trainer.max_epochs; returns the last evaluation's metrics."""
        try:
            self.setup()
        except BaseException:  # a notebook that fixes the mistake and calls fit() again finds the folder free
            release_run_dir(self.run_dir)
            raise
        total = self.cfg.trainer.max_steps or (self.total_steps() if self.epoch_steps else None)  # None: unknown
        self._banner(total)
        self._begin_training(total)
        try:
            while self._more_steps(total):
                batches = self.data.epoch(self.progress.epoch, self.progress.step_in_epoch)
                while self._more_steps(total) and batches.has_step(self.progress.step_in_epoch):
                    if self.train_step(batches):  # a stop signal
                        break
                if (batches.exhausted or self.progress.step_in_epoch == self.epoch_steps) and not self.preempted:
                    self._end_epoch()
            if not self.preempted:
                self._finish()
        finally:
            self._end_training()
        return self.last_eval

    def train_step(self, batches) -> bool:
        """One optimizer step and what follows it (log, evaluate, save, agree with the other ranks);
        True when the ranks agreed to stop for a signal (a checkpoint is then saved)."""
        optimizer_step(self, batches)
        self.bar.update()
        self._after_step()
        if stop := self.intervals.beat(self.progress.step):
            self._stop_for_signal()
        return stop

    def setup(self) -> None:
        """Run directory, build, wrap, data, resume: everything before the first step."""
        cfg, rt, self.identity = self.cfg, self.rt, experiment_identity(type(self.exp))
        self.run_dir = prepare_run_dir(cfg, self.exp.experiment_name, self.identity, rt.is_main)
        self.plan = BatchPlan(cfg.trainer.global_batch_size, rt.world_size, cfg.trainer.accumulate)
        self._build(wrap_models=True)
        seeding.seed_rank(cfg.seed, rt.rank)  # per-rank randomness (dropout) from here on
        self.nonfinite = NonFiniteGuard(cfg.trainer.nonfinite, self.device, rt.rank, rt.world_size)
        self.settings = OmegaConf.to_object(cfg.trainer)  # per-step reads: an OmegaConf lookup costs microseconds
        self.count_epoch_steps()
        self._read_eval_sets()
        c = cfg.checkpoint
        self.checkpoints = CheckpointManager(os.path.join(self.run_dir, "checkpoints"), c.keep_last, c.keep_best,
                                             c.monitor or None, c.mode, c.async_save, rt.is_main)
        wandb_id = self._resume()
        self.run_log = RunLog(self.run_dir, cfg, rt.is_main, wandb_id)
        if rt.is_main:
            p = self.plan
            write_run_info(self.run_dir, {
                "experiment": self.exp.experiment_name, "target": self.identity, "entry": entry_of(type(self.exp)),
                "world_size": rt.world_size, "backend": rt.backend, "device": self.device.type, "global_batch": p.global_batch, "micro_batch":
                p.micro_batch, "accumulate": p.accumulate, "steps_per_epoch": self.epoch_steps,
                "resumed_at_step": self.progress.step})

    def _build(self, wrap_models: bool) -> None:
        """Seed, then the experiment's build(): the same initial weights on every rank."""
        seeding.deterministic(self.cfg.trainer.deterministic)
        seeding.seed_everything(self.cfg.seed)
        self.precision = Precision(self.cfg.trainer.precision, self.device)
        self.exp.build()
        wrapper = (lambda m: wrap(m, self.cfg.dist, self.device, self.rt.distributed)) if wrap_models else None
        if wrap_models and (mode := self.cfg.trainer.compile).lower() != "false":  # wrap, then compile
            wrapper = lambda m, wrap_one=wrapper: compile_network(wrap_one(m), mode, self.device)  # noqa: E731
        self.models, self.optimizers, self.schedulers = components.collect(self.exp, self.device, wrapper)
        self.ema = WeightAverage(self.models, self.cfg.trainer.ema_decay) if self.cfg.trainer.ema_decay else None
        self.wrapped = [getattr(self.exp, name) for name in self.models]

    @property
    def stalled(self) -> bool:
        """trainer.early_stop: the monitored metric has not improved for `patience` evaluations."""
        return bool(self.settings.early_stop.monitor) and self.early_stop["bad"] >= self.settings.early_stop.patience

    def total_steps(self) -> int:
        """trainer.max_steps when set (epochs run on as needed), else trainer.max_epochs whole epochs
        (config.check_values refuses both 0), which data without a length cannot count."""
        t = self.cfg.trainer
        if t.max_steps <= 0 and self.count_epoch_steps() is None:
            raise ConfigError(f"{self.data.what} has no length, so the run's number of steps is unknown",
                              "set trainer.max_steps (a schedule's length needs it)")
        return t.max_steps if t.max_steps > 0 else t.max_epochs * self.count_epoch_steps()

    def count_epoch_steps(self) -> int | None:
        """Optimizer steps per epoch (None: no length), read on first ask, maybe in build() for a schedule."""
        if self.data is None:
            self.data = TrainData(self.exp, self.plan)
            self.epoch_steps = self.data.steps
        return self.epoch_steps

    def _more_steps(self, total: int | None) -> bool:
        more = self.progress.step < total if total is not None else self.progress.epoch < self.settings.max_epochs
        return more and not (self.preempted or self.stalled)

    # ---- evaluation and checkpoints (every rank calls these at the same step) -----------------
    def evaluate(self) -> dict[str, float]:
        if self.eval_set is not None:  # (none: nothing to put after them, no flush and its sync at each epoch's end)
            self.flush_log()  # the training lines up to this step come first
        metrics = self.compute_evaluation()
        for key, monitor in (("checkpoint.monitor", self.cfg.checkpoint.monitor), ("trainer.early_stop.monitor",
                                                                                   self.settings.early_stop.monitor)):
            if monitor and monitor not in metrics:  # else it would never rank a checkpoint / never stop
                raise ConfigError(f"{key}={monitor!r} is not a metric the evaluation returns (it returns "
                                  f"{', '.join(sorted(metrics)) or 'none'})", f"pass {key}=<one of those>")
        self.last_eval, self._evaluated_at = metrics, self.progress.step
        self._track_early_stop(metrics)
        self.run_log.log(self.progress.step, metrics, prefix="eval/")
        if metrics:  # an experiment without an eval set has no evaluation to show
            self.run_log.text(f"eval  step {self.progress.step}  " + format_metrics(metrics))
        self.exp.on_evaluation_end(metrics)
        return metrics

    def compute_evaluation(self, dataset=None) -> dict[str, float]:
        """The metrics of `dataset` (default: the eval set), each set of a dict as '<name>/<metric>'."""
        dataset = self.eval_set if dataset is None else dataset
        sets = dataset if isinstance(dataset, dict) else {} if dataset is None else {"": dataset}
        batch_size = self.cfg.trainer.eval_batch_size or self.plan.micro_batch
        with self.eval_weights():
            return {f"{name}/{key}" if name else key: value for name, data in sets.items()
                    for key, value in evaluate_dataset(self.exp, data, self.models, self.precision, batch_size).items()}

    def eval_weights(self):
        """The weights evaluation and prediction use: the average with trainer.ema_decay and eval_with_ema."""
        return self.ema.swapped() if self.ema and self.cfg.trainer.eval_with_ema else NO_CONTEXT

    def _read_eval_sets(self, only: str | None = None, needed: bool = False) -> None:
        """eval_dataset(): none, one, or {name: dataset}, each sized and not empty (`only`: that one)."""
        what, self.eval_set = f"{type(self.exp).__name__}.eval_dataset()", self.exp.eval_dataset()
        sets = self.eval_set if isinstance(self.eval_set, dict) else {"": self.eval_set}
        if not sets or (only and only not in sets):
            names = ", ".join(map(repr, filter(None, sets))) or "one, unnamed"
            raise ConfigError(f"{what} has no eval set {only!r} (it has {names})" if sets else f"{what} returned "
                              "an empty dict", "name one of its sets (ddplab eval --set NAME); return at least one")
        for name in [name for name, data in sets.items() if (data is not None or needed) and not isinstance(data, IterableDataset)]:
            sized(sets[name], what + (f"[{name!r}]" if name else ""))
        self.eval_set = {only: sets[only]} if only else self.eval_set

    def save_checkpoint(self) -> None:
        self.flush_log()  # hands the last losses to the non-finite check, too
        self.nonfinite.check()  # never save weights that a NaN loss has already reached
        monitor = self.cfg.checkpoint.monitor if self._evaluated_at == self.progress.step else None  # of these weights
        metric = self.last_eval.get(monitor) if monitor else None
        self.checkpoints.save(checkpoint_state.capture(self), self.progress.step, self.progress.epoch, metric)
        self._saved_at = self.progress.step

    def load_best_checkpoint(self) -> str | None:
        """Rank 0 chooses, after its last write is committed, and every rank loads that one: a rank
        that looked for itself could find an older best while rank 0 is still writing."""
        self.checkpoints.wait()
        best = self.checkpoints.best() if self.rt.is_main else None
        path = collectives.broadcast_object(best[0].path if best else None)
        if path is not None:
            checkpoint_state.load_weights(self, load_state(path, map_location=self.device))
        return path

    def evaluate_checkpoint(self, path: str, only: str | None = None) -> dict[str, float]:
        self._build_from_checkpoint(path)
        self._read_eval_sets(only, needed=True)
        return self.compute_evaluation()

    def predict_checkpoint(self, path: str, source: str) -> dict:
        """predict_step's outputs for every sample of predict_dataset(source), in order, on every rank."""
        state = self._build_from_checkpoint(path)
        dataset = self.exp.predict_dataset(source)
        if not isinstance(dataset, IterableDataset):
            sized(dataset, f"{type(self.exp).__name__}.predict_dataset({source!r})")
        # the micro-batch the run trained with, whatever -n is now: the same batches give the same numbers
        trained = state["sampler"]["global_batch"] // (state["world_size"] * self.cfg.trainer.accumulate)
        batch_size = self.cfg.trainer.eval_batch_size or max(1, trained)
        with self.eval_weights():
            return dataset_outputs(self.exp, dataset, self.models, self.precision, batch_size, self.exp.predict_step,
                                   whole_batches=True)

    def _build_from_checkpoint(self, path: str) -> dict:
        """`ddplab eval` and `ddplab predict`: build the bare networks and load a checkpoint's weights. Any
        number of ranks: the batch per rank is trainer.eval_batch_size, else the global batch's share."""
        world = self.rt.world_size
        self.plan = BatchPlan(max(1, self.cfg.trainer.global_batch_size // world) * world, world, 1)
        self._build(wrap_models=False)
        state = load_state(resolve_checkpoint(path), map_location=self.device)
        checkpoint_state.load_weights(self, state, f"checkpoint {path}")
        self.progress.step = state.get("progress", {}).get("step", 0)
        return state

    def flush_log(self) -> None:
        """Every rank, at the same step: write every finished log line now."""
        if self.intervals is not None:
            self.intervals.flush(self.progress.step)

    # ---- the parts of fit() ------------------------------------------------------------------
    def _begin_training(self, total: int) -> None:
        """The progress bar, the stop signals and the log intervals, for the loop that follows."""
        rt, settings = self.rt, self.settings
        self.bar = progress_bar(total, self.progress.step, settings.progress and rt.is_local_main,
                               rt.node_rank if rt.cluster.num_nodes > 1 else None)
        self.signals = StopSignals(self.cfg.checkpoint.preempt_signals)
        self.intervals = LogIntervals(self.metrics, self.nonfinite, self.signals, self.run_log, self.bar,
                                      not (settings.progress and rt.is_local_main), settings, self._lr_and_epoch,
                                      self.plan, self.progress.step, self.device, rt.distributed)
        for m in self.wrapped:
            m.train()  # once here and again after each evaluation, not on every step

    def _after_step(self) -> None:
        s, step = self.settings, self.progress.step
        self.intervals.after_step(step)
        if s.eval_every and step % s.eval_every == 0:
            self.evaluate()
        if s.checkpoint_every and step % s.checkpoint_every == 0:
            self.save_checkpoint()

    def _end_epoch(self) -> None:
        self.progress.next_epoch()
        self.exp.on_epoch_end(self.progress.epoch - 1)
        if evaluate := not self.cfg.trainer.eval_every and self._evaluated_at != self.progress.step:
            self.evaluate()
        if self.cfg.checkpoint.every_epoch and (self._saved_at != self.progress.step or evaluate):
            self.save_checkpoint()  # again when saved before this evaluation: its metric belongs with it

    def _finish(self) -> None:
        """Last log, evaluation and checkpoint, then on_fit_end (which may swap in the best
        weights, e.g. to report and export the best model), then the export of final/."""
        self.intervals.end(self.progress.step)
        self.flush_log()
        if evaluate := self._evaluated_at != self.progress.step and not self.stalled:  # not again when resumed
            self.evaluate()
        if self.stalled:
            r, monitor = self.early_stop, self.settings.early_stop.monitor
            self.exp.print(f"early stop at step {self.progress.step}: eval {monitor} has not improved on {r['best']:.6g}"
                           f" (step {r['step']}) for {r['bad']} evaluations (trainer.early_stop.patience)")
        if self.cfg.checkpoint.at_end and (self._saved_at != self.progress.step or evaluate):
            self.save_checkpoint()
        self.checkpoints.wait()
        self.exp.on_fit_end()
        cuda = self.device.type == "cuda"  # each rank's peak memory, for the summary: one gather, at the end
        peaks = collectives.gather_object(torch.cuda.max_memory_allocated(self.device) / 2**30) if cuda else None
        if self.rt.is_main:
            with self.ema.swapped() if self.ema else NO_CONTEXT:  # the average, when there is one
                export_final(self.exp, self.models, os.path.join(self.run_dir, "final"), self.cfg.trainer.ema_decay)
            end_of_run(self, peaks)

    def _track_early_stop(self, metrics: dict[str, float]) -> None:
        """Rank 0 judges the (global) metric and every rank takes its record, so all stop at this step."""
        e, r = self.settings.early_stop, self.early_stop
        if e.monitor:
            value, sign = metrics[e.monitor], 1 if e.mode == "max" else -1
            better = r["best"] is None or sign * (value - r["best"]) > e.min_delta
            r = {"best": value, "step": self.progress.step, "bad": 0} if better else {**r, "bad": r["bad"] + 1}
            self.early_stop = collectives.broadcast_object(r if self.rt.is_main else None)

    def _lr_and_epoch(self) -> tuple[float, float]:
        """What a log line says besides the metrics: the learning rate and the fractional epoch."""
        p = self.progress
        return self.optimizers[0].param_groups[0]["lr"], p.epoch + p.step_in_epoch / (self.epoch_steps or float("inf"))

    def _stop_for_signal(self) -> None:
        self.preempted = True
        self.flush_log()
        if self._saved_at != self.progress.step:
            self.save_checkpoint()
        self.checkpoints.wait()
        self.stopped_by = self.signals.agreed(self.device)
        self.exp.print(f"stopped by {self.stopped_by} at step {self.progress.step}: checkpoint saved in "
                       f"{self.run_dir}; the same command with run.name={os.path.basename(self.run_dir)} continues it")

    def _end_training(self) -> None:
        self.signals.close()
        self.intervals = None
        self.bar.close()
        self.checkpoints.wait()
        self.run_log.close()
        release_run_dir(self.run_dir)

    # ---- helpers ----------------------------------------------------------------------------
    def _resume(self) -> str | None:
        """Load the checkpoint run.resume asks for; returns the W&B run id to re-attach to."""
        mode = self.cfg.run.resume
        if mode == "never":
            return None
        if mode == "auto":
            found = load_latest_valid(self.checkpoints.directory, map_location=self.device)
            if found is None:
                return None
            where, state = found[0].path, found[1]
        else:
            where, state = mode, load_state(resolve_checkpoint(mode), map_location=self.device)
        note = checkpoint_state.restore(self, state)
        self._saved_at = self.progress.step
        if self.rt.is_main:
            p = self.progress
            write_line(f"resumed from {where} at step {p.step} (epoch {p.epoch}, step {p.step_in_epoch} of the epoch)"
                       + (f"; note: {note}" if note else ""))
        return state.get("loggers", {}).get("wandb_id")

    def _banner(self, total: int) -> None:
        p, rt, t = self.plan, self.rt, self.cfg.trainer
        self.exp.print(f"{self.exp.experiment_name}: {rt.world_size} process(es) on {rt.device_name} ({rt.backend}, "
                       f"{t.precision}{', compiled' * (t.compile.lower() != 'false')}), micro-batch {p.micro_batch} per "
                       f"rank x accumulate {p.accumulate} x {rt.world_size} ranks = global batch {p.global_batch}; "
                       f"{self.epoch_steps or '?'} steps/epoch, {total or '?'} steps; run dir {self.run_dir}")
        if line := self.data.resume_line():
            self.exp.print(line)
