"""The training loop behind `Experiment.fit()`: set up, then { step, log, evaluate, save } until done.

`fit` and `train_step` are the whole story on one screen; each part lives beside it: the step
(step.py), the log interval and heartbeat (intervals.py), the batches (sources.py, data.py),
evaluation (evaluation.py), what a checkpoint holds (checkpointed.py), and the optional capabilities
(capability.py: the weights' average, out-of-memory backoff, early stopping, the profiler), which the
loop calls at fixed points in the order of one list, `Trainer.capabilities`."""

import os

import torch
from omegaconf import OmegaConf

from .. import seeding
from ..checkpoint import sharded
from ..checkpoint import state as checkpoint_state
from ..checkpoint.export import export_final
from ..checkpoint.mirror import NotUploaded
from ..checkpoint.store import CheckpointManager, load_state, resolve_checkpoint
from ..config_rules import switch_value
from ..distributed import collectives, fsdp, hangs
from ..distributed.wrapping import RankBuffers, compile_network, sync_buffers, wrap
from ..errors import ConfigError
from . import components, ending
from .capability import Capability, stop_reason, weights_for
from .checkpointed import checkpointed
from .components import TrainingParts
from .data import BatchPlan, plan_batches
from .early_stop import EarlyStop
from .ema import WeightAverage
from .evaluation import check_monitors, evaluate_sets, read_eval_sets
from .intervals import LogIntervals, LogOutput
from .live import LiveRecovery
from .logs import RunLog, banner, format_metrics, progress_bar, write_line
from .metrics import MetricTracker
from .nonfinite import NonFiniteGuard
from .oom import OomBackoff
from .precision import Precision
from .profiling import StepProfiler
from .progress import TrainProgress
from .pruning import SweepTrial
from .records import LastEvaluation
from .rundir import (
    checkpoint_manager,
    experiment_identity,
    prepare_run_dir,
    release_run_dir,
    run_info,
    run_url,
    write_run_record,
)
from .schedules import per_step, plateau_monitor, step_on_evaluation
from .signals import StopSignals
from .sources import TrainData
from .step import StepParts, StepRecords, optimizer_step
from .stragglers import StragglerWatch
from .summary import end_of_run, peak_memory


class Trainer:
    """One experiment's training run. Created with the experiment; `fit()` does the rest.

    Its whole shape is declared here: what it is given, what setup() builds (build() also for
    `ddplab eval` and `predict`), and what fit() holds while it trains. Nothing else sets them."""

    # given: the experiment, its settings (trainer's read once: an OmegaConf lookup costs
    # microseconds on every step) and its place in the job
    exp: object
    cfg: object
    settings: object
    rt: object
    device: torch.device
    # the run's records, from the start: the experiment may read them, inside build() too
    progress: TrainProgress
    metrics: MetricTracker
    evaluation: LastEvaluation
    # the metrics the settings name (by the setting that names each): every evaluation must return them
    monitors: dict[str, str]
    # built by setup(): the run folder (run.dir/<experiment>/<name>) and the experiment's identity
    run_dir: str | None
    identity: str
    # the batch plan, the training data (read when first asked: at setup, or earlier when build()
    # asks for the run's length), the eval sets, and the run's length (None: epochs are counted)
    plan: BatchPlan
    data: TrainData | None
    eval_set: object
    total: int | None
    # dist.fault_tolerance=live: this process as a replica (it wraps the networks and takes the step)
    live: LiveRecovery | None
    # what build() made, and the optional capabilities in the order the loop calls them
    parts: TrainingParts
    capabilities: list[Capability]
    # the run's non-finite check (every run has one: it rides the log interval's all_reduce)
    nonfinite: NonFiniteGuard
    # checkpoints: where they go, and the named state objects each one holds (checkpointed.py)
    checkpoints: CheckpointManager
    state: dict
    run_log: RunLog
    # during fit(): the bar, the stop signals, the log intervals, the step's parts and its function
    bar: object
    signals: StopSignals
    intervals: LogIntervals | None
    step_parts: StepParts
    step_records: StepRecords
    take_step: object
    # a signal (SIGTERM, SIGUSR1) stopped it, and which one; the step of the last checkpoint
    preempted: bool
    stopped_by: str | None
    _saved_at: int

    def __init__(self, exp):
        self.exp = exp
        self.cfg = exp.cfg
        self.settings = OmegaConf.to_object(self.cfg.trainer)
        self.rt = exp.rt
        self.device = exp.rt.device
        self.progress = TrainProgress()
        self.metrics = MetricTracker(self.device)
        self.evaluation = LastEvaluation()
        self.monitors = {
            "checkpoint.monitor": self.cfg.checkpoint.monitor,
            "trainer.early_stop.monitor": self.settings.early_stop.monitor,
        }
        self.run_dir = None
        self.run_log = None
        # lines said before the run's log opened (in build(), train_dataset()), for its log.txt
        self._unlogged: list[str] = []
        self.data = None
        self.live = None
        self.capabilities = []
        self.intervals = None
        self.preempted = False
        self.stopped_by = None
        # why the stop's checkpoint is not in the bucket, when run.dir is one and it could not go up
        self.not_uploaded: str | None = None
        self._saved_at = -1

    def fit(self) -> dict[str, float]:
        """Train to trainer.max_steps / trainer.max_epochs; returns the last evaluation's metrics."""
        try:
            self.setup()
            # a plateau scheduler needs a monitored metric: refused before training starts
            stepped = per_step(self.parts.schedulers, self.monitors)
        except BaseException:
            # a notebook that fixes the mistake and calls fit() again finds the folder free
            release_run_dir(self.run_dir)
            raise
        self._banner()
        self._begin_training(stepped)
        failure = None
        try:
            while self._more_steps():
                batches = self.data.epoch(self.progress.epoch, self.progress.step_in_epoch)
                while self._more_steps() and batches.has_step(self.progress.step_in_epoch):
                    stop_signal = self.train_step(batches)
                    if stop_signal:
                        break
                epoch_done = batches.exhausted or self.progress.step_in_epoch == self.data.steps
                if epoch_done and not self.preempted:
                    self._end_epoch()
            if not self.preempted:
                self._finish()
        except BaseException as e:
            failure = e
            raise
        finally:
            self._end_training(failure)
        return self.evaluation.metrics

    def train_step(self, batches) -> bool:
        """One optimizer step and what follows it (log, evaluate, save, agree with the other ranks);
        True when the ranks agreed to stop for a signal (a checkpoint is then saved)."""
        self.take_step(self.step_parts, self.step_records, batches, self.plan.accumulate)
        for capability in self.capabilities:
            capability.after_update()
        self.progress.advance(self.plan.global_batch)
        step = self.progress.step
        self.bar.update()
        self.intervals.after_step(step)
        if self.settings.eval_every and step % self.settings.eval_every == 0:
            self.evaluate()
        if self.settings.checkpoint_every and step % self.settings.checkpoint_every == 0:
            self.save_checkpoint()
        # the heartbeat: every rank learns whether a signal asks them all to stop
        stop = self.intervals.beat(step)
        for capability in self.capabilities:
            capability.after_step(step)
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
        # before build(): a replica's networks are wrapped for the replicas' quorum
        self.live = LiveRecovery.join(cfg.dist, self.device, self.plan.global_batch)
        self.build(wrap_models=True)
        # The datasets too are built from the run's seed alone, the same on every rank (a split
        # drawn from torch's global generator, as the tutorials do it, is one split for all).
        # None: data without a length and no trainer.max_steps, so epochs are counted instead
        steps = self.count_epoch_steps()
        self.total = self.settings.max_steps or (self.total_steps() if steps else None)
        self.read_eval_sets()
        # per-rank randomness (dropout) from here on; a replica's by its number
        seeding.seed_rank(cfg.seed, self.live.replica.replica_id if self.live else rt.rank)
        self.nonfinite = NonFiniteGuard(cfg.trainer.nonfinite, self.device, rt.rank, rt.world_size)
        self.capabilities = self._capabilities()
        self.checkpoints = checkpoint_manager(cfg, self.run_dir, rt.is_main)
        self.state = checkpointed(
            self.parts, self.capabilities, self.progress, self.evaluation, self.data, self.plan, self.exp
        )
        if self.live is not None:
            # what a healing peer copies from this replica: the whole checkpoint, as it would be saved
            self.live.attach(
                self.run_dir,
                lambda: checkpoint_state.capture(self.state, self._about()),
                self._heal,
                self.say,
            )
        tracker_ids = self._resume()
        self.run_log = RunLog(self.run_dir, cfg, rt.is_main, tracker_ids, earlier=self._unlogged)
        if rt.is_main:
            info = run_info(self.exp, self.identity, self.plan, self.data.steps, self.progress.step)
            write_run_record(self.run_dir, cfg, info)

    def build(self, wrap_models: bool) -> None:
        """Seed, then the experiment's build(): the same initial weights on every rank. Networks
        are wrapped for training (DDP, then torch.compile with trainer.compile), or left bare for
        `ddplab eval` and `ddplab predict`."""
        seeding.deterministic(self.cfg.trainer.deterministic)
        seeding.seed_everything(self.cfg.seed)
        precision = Precision(self.cfg.trainer.precision, self.device)
        self.exp.build()
        components.shape_lazy_parameters(self.exp, lambda: self.train_data().first_batch())
        wrapper = self._wrapper() if wrap_models else None
        models, optimizers, schedulers, shared = components.collect(self.exp, self.device, wrapper)
        hook_states = {}
        if wrap_models:
            optimizers, hook_states = components.apply_levers(self.exp, models, optimizers, schedulers)
            shared.mean = self.live.replica.mean if self.live else components.shared_mean(self.cfg.dist, self.rt)
        networks = [getattr(self.exp, name) for name in models]
        self.parts = TrainingParts(models, networks, optimizers, schedulers, precision, hook_states, shared)

    def _capabilities(self) -> list[Capability]:
        """The optional capabilities the settings ask for, in the order the loop calls their hooks."""
        settings, rt = self.settings, self.rt
        chosen = [
            # it takes the step: the replicas' quorum, commit or take again
            self.live,
            # first after the update, before anything reads the weights
            WeightAverage.from_settings(settings, self.parts.models),
            OomBackoff.from_settings(
                settings, self.plan.micro_batch, rt.world_size, self.device, self.cfg.dist.broadcast_buffers
            ),
            # with a sweep's pruning, in a trial of `ddplab sweep`
            EarlyStop(settings.early_stop, SweepTrial.from_env(), rt.is_main),
            StepProfiler.from_settings(settings, self.run_dir, rt.rank, self.device, self.total, self.say),
        ]
        return [capability for capability in chosen if capability is not None]

    def _wrapper(self):
        """The network as training calls it: wrapped for DDP, then compiled (trainer.compile)."""
        mode = switch_value(self.settings.compile)

        def wrap_network(network: torch.nn.Module) -> torch.nn.Module:
            if self.live is not None:
                return self.live.wrap(network)
            # trainer.oom_backoff copies the buffers after the step (train/oom.py)
            wrapped = wrap(
                network,
                self.cfg.dist,
                self.device,
                self.rt.distributed,
                not self.settings.oom_backoff,
                self.settings.precision,
            )
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
            quorum = self.live is not None
            self.data = TrainData(self.exp, self.plan, self.progress, self.settings.num_workers, quorum)
        return self.data

    def _more_steps(self) -> bool:
        if self.preempted or stop_reason(self.capabilities):
            return False
        if self.total is None:
            return self.progress.epoch < self.settings.max_epochs
        return self.progress.step < self.total

    # ---- evaluation and checkpoints (every rank calls these at the same step) -----------------
    def evaluate(self) -> dict[str, float]:
        # without an eval set there is nothing to order after the training lines: no flush, no sync
        if self.eval_set is not None:
            # the training lines up to this step come first
            self.flush_log()
        metrics = self.compute_evaluation()
        check_monitors(metrics, self.monitors)
        schedulers = self.parts.schedulers
        step_on_evaluation(schedulers, metrics, plateau_monitor(schedulers, self.monitors))
        step = self.progress.step
        self.evaluation.record(metrics, step)
        for capability in self.capabilities:
            capability.after_evaluation(metrics, step)
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
            sync_buffers(self.parts.networks)
        batch_size = self.settings.eval_batch_size or self.plan.micro_batch
        with weights_for(self.capabilities, "evaluate"):
            return evaluate_sets(self.exp, dataset, self.parts.models, self.parts.precision, batch_size)

    def read_eval_sets(self, only: str | None = None, needed: bool = False) -> None:
        """eval_dataset(): none, one, or {name: dataset} (`only`: that one)."""
        self.eval_set = read_eval_sets(self.exp, only, needed)

    def save_checkpoint(self) -> None:
        # hands the last losses to the non-finite check, too
        self.flush_log()
        # never save weights that a NaN loss has already reached
        self.nonfinite.check()
        for capability in self.capabilities:
            capability.before_save()
        # the monitored metric, when it was measured on these weights
        metric = None
        monitor = self.cfg.checkpoint.monitor
        if monitor and self.evaluation.step == self.progress.step:
            metric = self.evaluation.metrics.get(monitor)
        state = checkpoint_state.capture(self.state, self._about())
        self.checkpoints.save(state, self.progress.step, self.progress.epoch, metric)
        self._saved_at = self.progress.step

    def load_best_checkpoint(self) -> str | None:
        """Rank 0 chooses, after its last write is committed, and every rank loads that one: a rank
        that looked for itself could find an older best while rank 0 is still writing."""
        self.checkpoints.settle()
        best = self.checkpoints.best() if self.rt.is_main else None
        path = collectives.broadcast_object(self.checkpoints.shared(best[0].path) if best else None)
        if path is not None:
            self.load_weights(load_state(path, map_location=self.device, cache=self.checkpoints.directory))
        return path

    def load_for_inference(self, path: str) -> dict:
        """`ddplab eval` and `ddplab predict`: the bare networks with checkpoint `path`'s weights, on
        any number of ranks (the batch per rank is the global batch's share unless
        trainer.eval_batch_size says); returns what the checkpoint holds."""
        world = self.rt.world_size
        per_rank = max(1, self.settings.global_batch_size // world)
        self.plan = BatchPlan(per_rank * world, world, 1)
        self.build(wrap_models=False)
        # only what belongs with the weights: nothing trains
        self.capabilities = [c for c in [WeightAverage.from_settings(self.settings, self.parts.models)] if c]
        saved = load_state(resolve_checkpoint(path), map_location=self.device)
        self.load_weights(saved, f"checkpoint {path}")
        # the experiment may read the step its weights were trained to
        self.progress.step = saved.get("progress", {}).get("step", 0)
        return saved

    def load_weights(self, saved: dict, source: str = "the checkpoint") -> None:
        """The networks' weights, and what belongs with them (trainer.ema_decay's average; none
        saved: the weights themselves)."""
        weights = {"models": checkpoint_state.Networks(self.parts.models, source)}
        weights.update({c.state_key: c for c in self.capabilities if c.of_weights})
        # a sharded checkpoint's weights read into this run's networks, sharded or whole
        saved = sharded.fill(saved, weights, source)
        weights.pop("models").load_state_dict(saved.get("models"))
        for key, capability in weights.items():
            capability.load_state_dict(saved.get(key))

    def flush_log(self) -> None:
        """Every rank, at the same step: write every finished log line now."""
        if self.intervals is not None:
            self.intervals.flush(self.progress.step)

    # ---- the parts of fit() ------------------------------------------------------------------
    def _begin_training(self, stepped: list) -> None:
        """The progress bar, the stop signals, the log intervals and the step's parts (`stepped`: the
        schedulers that step with each optimizer step), for the loop that follows."""
        rt = self.rt
        settings = self.settings
        parts = self.parts
        show_bar = settings.progress and rt.is_local_main
        node = rt.node_rank if rt.cluster.num_nodes > 1 else None
        self.bar = progress_bar(self.total, self.progress.step, show_bar, node)
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
            networks=parts.networks,
            optimizers=parts.optimizers,
            schedulers=stepped,
            precision=parts.precision,
            grad_clip=settings.grad_clip,
            skip_nonfinite=settings.nonfinite == "skip",
            shared=parts.shared,
            rank_buffers=RankBuffers(parts.networks, self.device) if rt.distributed else None,
        )
        self.step_records = StepRecords(self.intervals, self.metrics, self.nonfinite, self.progress)
        # a capability may take the step (trainer.oom_backoff's)
        self.take_step = next((c.step for c in self.capabilities if c.step is not None), optimizer_step)
        for capability in self.capabilities:
            capability.before_training(self.progress.step)
        for network in parts.networks:
            # once here and again after each evaluation, not on every step
            network.train()

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
        for capability in self.capabilities:
            capability.after_training(self.progress.step)
        self.intervals.end(self.progress.step)
        self.flush_log()
        # not again when a resumed run has nothing left to train, nor after an early stop
        stopped = stop_reason(self.capabilities)
        evaluated = self.evaluation.step != self.progress.step and not stopped
        if evaluated:
            self.evaluate()
        for capability in self.capabilities:
            if line := capability.closing_line(self.progress.step):
                self.exp.print(line)
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
        whole = None
        if any(fsdp.is_sharded(network) for network in self.parts.networks):
            # sharded networks gathered by every rank, one tensor at a time, into rank 0's host memory
            with weights_for(self.capabilities, "export"):
                whole = {n: fsdp.full_weights(m, self.rt.is_main) for n, m in self.parts.models.items()}
        if self.rt.is_main:
            final = os.path.join(self.run_dir, "final")
            with end.part("export"), weights_for(self.capabilities, "export"):
                export_final(self.exp, self.parts.models, final, self.settings.ema_decay, whole)
                self.run_log.log_model(final)
            # the summary is the last thing on the screen: the bar must not draw itself after it
            self.bar.close()
            url = run_url(self.cfg, self.run_dir)
            facts = {"live": self.live.facts()} if self.live else None
            end_of_run(self.exp, self.run_dir, stop_reason(self.capabilities) or "finished", peaks, url, facts)
            # with run.dir in object storage: the last checkpoint, final/ and the summary are there
            self.checkpoints.settle(final=True)

    def _lr_and_epoch(self) -> tuple[float, float]:
        """What a log line says besides the metrics: the learning rate and the fractional epoch."""
        lr = self.parts.optimizers[0].param_groups[0]["lr"]
        epoch = self.progress.epoch + self.progress.step_in_epoch / (self.data.steps or float("inf"))
        return lr, epoch

    def _stop_for_signal(self) -> None:
        self.preempted = True
        self.flush_log()
        if self._saved_at != self.progress.step:
            self.save_checkpoint()
        try:
            self.checkpoints.settle()
        except NotUploaded as e:
            # the stop's checkpoint is on this disk (a store that does not answer): the stop goes on,
            # and says where it is
            self.not_uploaded = e.cause
        self.stopped_by = self.signals.agreed(self.device)
        # the launcher says how to continue (launch/stops.py): the signal may also be the elastic
        # agent's, regrouping the job for a node that joins (it continues by itself)
        where = f" (not in the bucket: {self.not_uploaded})" if self.not_uploaded else ""
        self.exp.print(
            f"stopped by {self.stopped_by} at step {self.progress.step}: checkpoint saved in {self.run_dir}{where}"
        )

    def _end_training(self, failure: BaseException | None) -> None:
        try:
            self.data.close(failure)
            self.intervals = None
            self.bar.close()
            self.checkpoints.wait()
            self.run_log.close()
            if self.live is not None:
                self.live.close()
            release_run_dir(self.run_dir)
        finally:
            # last: a SIGTERM meanwhile (torch's agent's, after another worker died) is noted, not
            # the end of this worker before its checkpoint is written and its trackers are closed
            self.signals.close()

    # ---- helpers ----------------------------------------------------------------------------
    def _resume(self) -> dict | None:
        """Load the checkpoint run.resume asks for; returns the trackers' run ids to re-attach to."""
        found = checkpoint_state.load_resume(self.cfg.run.resume, self.checkpoints, self.device)
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

    def _heal(self, saved: dict) -> None:
        """A peer's training state, copied by live recovery: all a checkpoint restores but the random
        streams, this replica's own, re-seeded from the step (as a resume on another world size does)."""
        checkpoint_state.restore({k: v for k, v in self.state.items() if k != "rng"}, saved, self._kinds())
        seeding.seed_rank(self.cfg.seed, self.live.replica.replica_id, self.progress.step)

    def _about(self) -> dict:
        """What a checkpoint says of the run besides its state."""
        return {
            "world_size": self.rt.world_size,
            "loggers": self.run_log.ids(),
            "kinds": self._kinds(),
            "config": OmegaConf.to_yaml(self.cfg, resolve=True),
        }

    def _kinds(self) -> dict:
        parts = self.parts
        return checkpoint_state.kinds_of(self.identity, parts.models, parts.optimizers, parts.schedulers)

    def say(self, line: str) -> None:
        """A line on rank 0's console and in the run's log.txt: from any method of the experiment,
        before the log opens (build(), the datasets: kept for it) and after it closed (the console's
        alone), and in `ddplab eval` and `predict`, which keep no log."""
        if self.run_log is not None and self.run_log.is_open:
            self.run_log.text(line)
            return
        if self.rt.is_main:
            write_line(line)
        if self.run_log is None:
            self._unlogged.append(line)

    def _banner(self) -> None:
        precision = self.settings.precision
        if switch_value(self.settings.compile) is not False:
            precision += ", compiled"
        self.exp.print(
            banner(self.exp.experiment_name, self.rt, precision, self.plan, self.data.steps, self.total, self.run_dir)
        )
        if line := self.data.resume_line():
            self.exp.print(line)
