"""The training loop behind `Experiment.fit()`: set up, then { step, log, evaluate, save } until done.

`fit` is the whole story on one screen; each part lives beside it: the step (step.py), the log
interval and heartbeat (intervals.py), the batches (sources.py, data.py), evaluation (evaluation.py),
the records a checkpoint keeps (records.py) and what a checkpoint holds (checkpoint/state.py)."""

import os

import torch
from omegaconf import OmegaConf

from .. import seeding
from ..checkpoint import state as checkpoint_state
from ..checkpoint.export import export_final
from ..checkpoint.store import CheckpointManager, load_state, resolve_checkpoint
from ..config_rules import switch_value
from ..distributed import collectives, hangs
from ..distributed.wrapping import RankBuffers, compile_network, sync_buffers, wrap
from ..errors import ConfigError
from . import components, ending
from .checkpointed import checkpointed
from .data import BatchPlan, plan_batches
from .ema import WeightAverage
from .evaluation import check_monitors, evaluate_sets, read_eval_sets
from .intervals import LogIntervals, LogOutput
from .logs import RunLog, banner, format_metrics, progress_bar, write_line
from .metrics import MetricTracker
from .nonfinite import NonFiniteGuard
from .oom import OomBackoff, step_with_backoff
from .precision import NO_CONTEXT, Precision
from .profiling import profiler_for
from .progress import TrainProgress
from .pruning import SweepTrial
from .records import EarlyStop, LastEvaluation
from .rundir import experiment_identity, prepare_run_dir, release_run_dir, run_info, write_run_record
from .schedules import per_step, plateau_monitor, step_on_evaluation
from .signals import StopSignals
from .sources import TrainData
from .step import StepParts, StepRecords, optimizer_step
from .stragglers import StragglerWatch
from .summary import end_of_run, peak_memory


class Trainer:
    """One experiment's training run. Created with the experiment; `fit()` does the rest."""

    def __init__(self, exp):
        self.exp = exp
        self.cfg = exp.cfg
        self.rt = exp.rt
        self.device = exp.rt.device
        # the trainer settings, read once: an OmegaConf lookup costs microseconds on every step
        self.settings = OmegaConf.to_object(self.cfg.trainer)
        self.progress = TrainProgress()
        self.metrics = MetricTracker(self.device)
        self.evaluation = LastEvaluation()
        self.early_stop = EarlyStop(self.settings.early_stop, SweepTrial.from_env())
        # the metrics the settings name: every evaluation must return them
        self.monitors = {
            "checkpoint.monitor": self.cfg.checkpoint.monitor,
            "trainer.early_stop.monitor": self.settings.early_stop.monitor,
        }
        # run.dir/<experiment>/<name>, once set up
        self.run_dir = None
        # read at setup, or earlier when build() asks for the run's length
        self.data = None
        # during fit() only
        self.intervals: LogIntervals | None = None
        # stopped by a signal (SIGTERM, SIGUSR1), which one
        self.preempted = False
        self.stopped_by = None
        self._saved_at = -1
        # trainer.oom_backoff (train/oom.py), from setup(); trainer.profile (profiling.py), from fit()
        self.backoff = None
        self.profiler = None

    def fit(self) -> dict[str, float]:
        """Train to trainer.max_steps / trainer.max_epochs; returns the last evaluation's metrics."""
        try:
            self.setup()
        except BaseException:
            # a notebook that fixes the mistake and calls fit() again finds the folder free
            release_run_dir(self.run_dir)
            raise
        # None: data without a length and no trainer.max_steps, so epochs are counted instead
        total = self.cfg.trainer.max_steps or (self.total_steps() if self.data.steps else None)
        self._banner(total)
        self._begin_training(total)
        try:
            while self._more_steps(total):
                batches = self.data.epoch(self.progress.epoch, self.progress.step_in_epoch)
                while self._more_steps(total) and batches.has_step(self.progress.step_in_epoch):
                    stop_signal = self.train_step(batches)
                    if stop_signal:
                        break
                epoch_done = batches.exhausted or self.progress.step_in_epoch == self.data.steps
                if epoch_done and not self.preempted:
                    self._end_epoch()
            if not self.preempted:
                self._finish()
        finally:
            self._end_training()
        return self.evaluation.metrics

    def train_step(self, batches) -> bool:
        """One optimizer step and what follows it (log, evaluate, save, agree with the other ranks);
        True when the ranks agreed to stop for a signal (a checkpoint is then saved)."""
        take_step = step_with_backoff if self.backoff else optimizer_step
        take_step(self.step_parts, self.step_records, batches, self.plan.accumulate, self.plan.global_batch)
        self.bar.update()
        self._after_step()
        stop = self.intervals.beat(self.progress.step)
        if self.profiler is not None:
            self.profiler.after_step(self.progress.step)
        if stop:
            self._stop_for_signal()
        return stop

    def setup(self) -> None:
        """Run directory, build, wrap, data, resume: everything before the first step."""
        cfg = self.cfg
        rt = self.rt
        self.identity = experiment_identity(type(self.exp))
        self.run_dir = prepare_run_dir(cfg, self.exp.experiment_name, self.identity, rt.is_main)
        if rt.distributed:
            hangs.record_flight_to(os.path.join(self.run_dir, "flight_recorder"))
        trainer = cfg.trainer
        self.plan = plan_batches(trainer.global_batch_size, rt.world_size, trainer.accumulate, trainer.micro_batch_size)
        buffers = cfg.dist.broadcast_buffers
        self.backoff = (
            OomBackoff(self.plan.micro_batch, rt.world_size, self.device, buffers) if trainer.oom_backoff else None
        )
        self.build(wrap_models=True)
        # The datasets too are built from the run's seed alone, the same on every rank (a split
        # drawn from torch's global generator, as the tutorials do it, is one split for all).
        self.count_epoch_steps()
        self.read_eval_sets()
        # per-rank randomness (dropout) from here on
        seeding.seed_rank(cfg.seed, rt.rank)
        self.nonfinite = NonFiniteGuard(cfg.trainer.nonfinite, self.device, rt.rank, rt.world_size)
        self.checkpoints = CheckpointManager(
            os.path.join(self.run_dir, "checkpoints"),
            keep_last=cfg.checkpoint.keep_last,
            keep_best=cfg.checkpoint.keep_best,
            monitor=cfg.checkpoint.monitor or None,
            mode=cfg.checkpoint.mode,
            async_save=cfg.checkpoint.async_save,
            is_main=rt.is_main,
        )
        self.state = checkpointed(self)
        tracker_ids = self._resume()
        self.run_log = RunLog(self.run_dir, cfg, rt.is_main, tracker_ids)
        if rt.is_main:
            info = run_info(self.exp, self.identity, self.plan, self.data.steps, self.progress.step)
            write_run_record(self.run_dir, cfg, info)

    def build(self, wrap_models: bool) -> None:
        """Seed, then the experiment's build(): the same initial weights on every rank. Networks
        are wrapped for training (DDP, then torch.compile with trainer.compile), or left bare for
        `ddplab eval` and `ddplab predict`."""
        seeding.deterministic(self.cfg.trainer.deterministic)
        seeding.seed_everything(self.cfg.seed)
        self.precision = Precision(self.cfg.trainer.precision, self.device)
        self.exp.build()
        components.shape_lazy_parameters(self.exp, lambda: self.train_data().first_batch())
        wrapper = self._wrapper() if wrap_models else None
        self.models, self.optimizers, self.schedulers = components.collect(self.exp, self.device, wrapper)
        self.hook_states = {}
        if wrap_models:
            self.optimizers, self.hook_states = components.apply_levers(
                self.exp, self.models, self.optimizers, self.schedulers
            )
        self.ema = None
        if self.settings.ema_decay:
            self.ema = WeightAverage(self.models, self.settings.ema_decay)
        # the networks as training calls them (wrapped for DDP, maybe compiled); models: bare, by name
        self.networks = [getattr(self.exp, name) for name in self.models]

    def _wrapper(self):
        """The network as training calls it: wrapped for DDP, then compiled (trainer.compile)."""
        mode = switch_value(self.settings.compile)

        def wrap_network(network: torch.nn.Module) -> torch.nn.Module:
            # trainer.oom_backoff copies the buffers after the step (train/oom.py)
            wrapped = wrap(network, self.cfg.dist, self.device, self.rt.distributed, not self.backoff)
            if mode is False:
                return wrapped
            return compile_network(wrapped, mode, self.device)

        return wrap_network

    def total_steps(self) -> int:
        """trainer.max_steps when set (epochs run on as needed), else trainer.max_epochs whole epochs
        (config.check_values refuses both 0), which data without a length cannot count."""
        if self.settings.max_steps > 0:
            return self.settings.max_steps
        if self.count_epoch_steps() is None:
            raise ConfigError(
                f"{self.data.what} has no length, so the run's number of steps is unknown",
                "set trainer.max_steps (a schedule's length needs it)",
            )
        return self.settings.max_epochs * self.count_epoch_steps()

    def count_epoch_steps(self) -> int | None:
        """Optimizer steps per epoch (None: no length). Reading the training data is what tells, so
        the first ask reads it: at setup, or earlier when build() asks for a schedule's length."""
        return self.train_data().steps

    def train_data(self) -> TrainData:
        if self.data is None:
            self.data = TrainData(self.exp, self.plan, self.progress, self.settings.num_workers)
        return self.data

    def _more_steps(self, total: int | None) -> bool:
        if self.preempted or self.early_stop.stalled:
            return False
        if total is None:
            return self.progress.epoch < self.settings.max_epochs
        return self.progress.step < total

    # ---- evaluation and checkpoints (every rank calls these at the same step) -----------------
    def evaluate(self) -> dict[str, float]:
        # without an eval set there is nothing to order after the training lines: no flush, no sync
        if self.eval_set is not None:
            # the training lines up to this step come first
            self.flush_log()
        metrics = self.compute_evaluation()
        check_monitors(metrics, self.monitors)
        step_on_evaluation(self.schedulers, metrics, plateau_monitor(self.schedulers, self.monitors))
        step = self.progress.step
        self.evaluation.record(metrics, step)
        self.early_stop.judge(metrics, step, self.rt.is_main)
        self.run_log.log(step, metrics, prefix="eval/")
        # an experiment without an eval set has no evaluation to show
        if metrics:
            self.run_log.text(f"eval  step {step}  " + format_metrics(metrics))
        self.exp.on_evaluation_end(metrics)
        return metrics

    def compute_evaluation(self, dataset=None) -> dict[str, float]:
        """The metrics of `dataset` (default: the eval set), each set of a dict as '<name>/<metric>'."""
        dataset = self.eval_set if dataset is None else dataset
        if self.cfg.dist.broadcast_buffers:
            sync_buffers(self.networks)
        batch_size = self.settings.eval_batch_size or self.plan.micro_batch
        with self.eval_weights():
            return evaluate_sets(self.exp, dataset, self.models, self.precision, batch_size)

    def eval_weights(self):
        """The weights evaluation and prediction use: the average with trainer.ema_decay and eval_with_ema."""
        return self.ema.swapped() if self.ema and self.settings.eval_with_ema else NO_CONTEXT

    def read_eval_sets(self, only: str | None = None, needed: bool = False) -> None:
        """eval_dataset(): none, one, or {name: dataset} (`only`: that one)."""
        self.eval_set = read_eval_sets(self.exp, only, needed)

    def save_checkpoint(self) -> None:
        # hands the last losses to the non-finite check, too
        self.flush_log()
        # never save weights that a NaN loss has already reached
        self.nonfinite.check()
        # the monitored metric, when it was measured on these weights
        metric = None
        monitor = self.cfg.checkpoint.monitor
        if monitor and self.evaluation.step == self.progress.step:
            metric = self.evaluation.metrics.get(monitor)
        about = {
            "world_size": self.rt.world_size,
            "loggers": self.run_log.ids(),
            "kinds": self._kinds(),
            "config": OmegaConf.to_yaml(self.cfg, resolve=True),
        }
        state = checkpoint_state.capture(self.state, about)
        self.checkpoints.save(state, self.progress.step, self.progress.epoch, metric)
        self._saved_at = self.progress.step

    def load_best_checkpoint(self) -> str | None:
        """Rank 0 chooses, after its last write is committed, and every rank loads that one: a rank
        that looked for itself could find an older best while rank 0 is still writing."""
        self.checkpoints.wait()
        best = self.checkpoints.best() if self.rt.is_main else None
        path = collectives.broadcast_object(best[0].path if best else None)
        if path is not None:
            self.load_weights(load_state(path, map_location=self.device))
        return path

    def load_for_inference(self, path: str) -> dict:
        """`ddplab eval` and `ddplab predict`: the bare networks with checkpoint `path`'s weights, on
        any number of ranks (the batch per rank is the global batch's share unless
        trainer.eval_batch_size says); returns what the checkpoint holds."""
        world = self.rt.world_size
        per_rank = max(1, self.settings.global_batch_size // world)
        self.plan = BatchPlan(per_rank * world, world, 1)
        self.build(wrap_models=False)
        saved = load_state(resolve_checkpoint(path), map_location=self.device)
        self.load_weights(saved, f"checkpoint {path}")
        # the experiment may read the step its weights were trained to
        self.progress.step = saved.get("progress", {}).get("step", 0)
        return saved

    def load_weights(self, saved: dict, source: str = "the checkpoint") -> None:
        """The networks' weights, and with trainer.ema_decay their average (none saved: the weights themselves)."""
        checkpoint_state.Networks(self.models, source).load_state_dict(saved.get("models"))
        if self.ema:
            self.ema.load_state_dict(saved.get("ema"))

    def flush_log(self) -> None:
        """Every rank, at the same step: write every finished log line now."""
        if self.intervals is not None:
            self.intervals.flush(self.progress.step)

    # ---- the parts of fit() ------------------------------------------------------------------
    def _begin_training(self, total: int) -> None:
        """The progress bar, the stop signals, the log intervals and the step's parts, for the loop that follows."""
        rt = self.rt
        settings = self.settings
        show_bar = settings.progress and rt.is_local_main
        self.bar = progress_bar(total, self.progress.step, show_bar, rt.node_rank if rt.cluster.num_nodes > 1 else None)
        self.signals = StopSignals(self.cfg.checkpoint.preempt_signals)
        self.intervals = LogIntervals(
            self.metrics,
            self.nonfinite,
            self.signals,
            LogOutput(self.run_log, self.bar, echo=not show_bar, lr_and_epoch=self._lr_and_epoch),
            settings,
            self.plan,
            self.progress.step,
            rank=rt.rank,
            stragglers=StragglerWatch(rt.world_size, self.run_log.text, self.run_log.ranks) if rt.distributed else None,
        )
        self.step_parts = StepParts(
            experiment=self.exp,
            networks=self.networks,
            optimizers=self.optimizers,
            schedulers=per_step(self.schedulers, self.monitors),
            precision=self.precision,
            ema=self.ema,
            grad_clip=settings.grad_clip,
            skip_nonfinite=settings.nonfinite == "skip",
            backoff=self.backoff,
            rank_buffers=RankBuffers(self.networks, self.device) if rt.distributed else None,
        )
        self.profiler = profiler_for(
            settings, self.run_dir, rt.rank, self.device, total, self.progress.step, self.run_log.text
        )
        self.step_records = StepRecords(self.intervals, self.metrics, self.nonfinite, self.progress)
        for network in self.networks:
            # once here and again after each evaluation, not on every step
            network.train()

    def _after_step(self) -> None:
        step = self.progress.step
        self.intervals.after_step(step)
        if self.settings.eval_every and step % self.settings.eval_every == 0:
            self.evaluate()
        if self.settings.checkpoint_every and step % self.settings.checkpoint_every == 0:
            self.save_checkpoint()

    def _end_epoch(self) -> None:
        self.progress.next_epoch()
        self.exp.on_epoch_end(self.progress.epoch - 1)
        evaluated = not self.settings.eval_every and self.evaluation.step != self.progress.step
        if evaluated:
            self.evaluate()
        # again when saved before this evaluation: its metric belongs with it
        if self.cfg.checkpoint.every_epoch and (self._saved_at != self.progress.step or evaluated):
            self.save_checkpoint()

    def _finish(self) -> None:
        """Last log, evaluation and checkpoint, then the end of the run."""
        self.intervals.end(self.progress.step)
        self.flush_log()
        # not again when a resumed run has nothing left to train, nor after an early stop
        evaluated = self.evaluation.step != self.progress.step and not self.early_stop.stalled
        if evaluated:
            self.evaluate()
        if self.early_stop.stalled:
            self.exp.print(self.early_stop.describe(self.progress.step))
        if self.cfg.checkpoint.at_end and (self._saved_at != self.progress.step or evaluated):
            self.save_checkpoint()
        self.checkpoints.wait()
        self._end_run()

    def _end_run(self) -> None:
        """on_fit_end (it may swap in the best weights to export them), the export of final/ (the average,
        when there is one) and the summary; a failure in a part is named (ending.py)."""
        end = ending.RunEnd(self.run_dir, self.progress.step, self._saved_at, self.rt.rank)
        # each rank's peak memory for the summary, before on_fit_end (which may call collectives on some ranks)
        peaks = collectives.gather_object(peak_memory(self.device))
        with end.part("on_fit_end"):
            self.exp.on_fit_end()
        if self.rt.is_main:
            with end.part("export"), self.ema.swapped() if self.ema else NO_CONTEXT:
                export_final(self.exp, self.models, os.path.join(self.run_dir, "final"), self.settings.ema_decay)
                self.run_log.log_model(os.path.join(self.run_dir, "final"))
            # the summary is the last thing on the screen: the bar must not draw itself after it
            self.bar.close()
            end_of_run(self.exp, self.run_dir, self.early_stop.status, peaks)

    def _lr_and_epoch(self) -> tuple[float, float]:
        """What a log line says besides the metrics: the learning rate and the fractional epoch."""
        lr = self.optimizers[0].param_groups[0]["lr"]
        epoch = self.progress.epoch + self.progress.step_in_epoch / (self.data.steps or float("inf"))
        return lr, epoch

    def _stop_for_signal(self) -> None:
        self.preempted = True
        self.flush_log()
        if self._saved_at != self.progress.step:
            self.save_checkpoint()
        self.checkpoints.wait()
        self.stopped_by = self.signals.agreed(self.device)
        # the launcher says how to continue (launch/stops.py): the signal may also be the elastic
        # agent's, regrouping the job for a node that joins (it continues by itself)
        self.exp.print(f"stopped by {self.stopped_by} at step {self.progress.step}: checkpoint saved in {self.run_dir}")

    def _end_training(self) -> None:
        self.signals.close()
        self.intervals = None
        self.bar.close()
        self.checkpoints.wait()
        self.run_log.close()
        release_run_dir(self.run_dir)

    # ---- helpers ----------------------------------------------------------------------------
    def _resume(self) -> dict | None:
        """Load the checkpoint run.resume asks for; returns the trackers' run ids to re-attach to."""
        found = checkpoint_state.load_resume(self.cfg.run.resume, self.checkpoints.directory, self.device)
        if found is None:
            return None
        where, saved = found
        note = checkpoint_state.restore(self.state, saved, self._kinds())
        self._saved_at = self.progress.step
        if self.rt.is_main:
            at = self.progress
            line = f"resumed from {where} at step {at.step} (epoch {at.epoch}, step {at.step_in_epoch} of the epoch)"
            write_line(line + (f"; note: {note}" if note else ""))
        return saved.get("loggers")

    def _kinds(self) -> dict:
        return checkpoint_state.kinds_of(self.identity, self.models, self.optimizers, self.schedulers)

    def _banner(self, total: int) -> None:
        precision = self.settings.precision
        if switch_value(self.settings.compile) is not False:
            precision += ", compiled"
        self.exp.print(
            banner(self.exp.experiment_name, self.rt, precision, self.plan, self.data.steps, total, self.run_dir)
        )
        if line := self.data.resume_line():
            self.exp.print(line)
