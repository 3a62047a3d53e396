"""Plant each realistic bug of docs/testing.md again, one at a time, and run the tests said to catch
it: `python scripts/planted.py` (all) or `python scripts/planted.py ema pruned` (by name).

Each bug is planted in a copy of the repository (the working tree is never touched) as one change of
source text, which must be found exactly once, so a bug whose code has moved is reported as such
rather than silently not planted. The copy's src/ comes first on PYTHONPATH, so the processes the
tests start run the bug too. A bug is caught when at least one of its tests fails; the script exits
1 if any bug goes uncaught or can no longer be planted.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Bug:
    name: str
    file: str  # under src/ddplab
    old: str
    new: str
    tests: list[str]  # pytest arguments


BUGS = [
    Bug(
        "nan-flag",
        "train/intervals.py",
        "nonfinite = self.nonfinite.flag()\n",
        "nonfinite = None\n",
        ["tests/train/test_step_effects.py::test_nan_is_caught_by_the_periodic_check_alone"],
    ),
    Bug(
        "bf16-off",
        "train/precision.py",
        "return NO_CONTEXT if fp32 else torch.autocast(",
        "return NO_CONTEXT if True else torch.autocast(",
        ["tests/train/test_step_effects.py::test_precision_is_the_dtype_the_forward_runs_in"],
    ),
    Bug(
        "clip-off",
        "train/step.py",
        "if parts.grad_clip:",
        "if False:",
        ["tests/train/test_step_effects.py::test_gradient_clipping_bounds_the_update_sgd_makes"],
    ),
    Bug(
        "epoch-order",
        "train/data.py",
        "generator.manual_seed((seed * 1_000_003 + epoch) % 2**63)",
        "generator.manual_seed((seed * 1_000_003) % 2**63)",
        [
            "tests/train/test_data_order.py::test_no_two_seeds_or_epochs_share_an_order",
            "tests/train/test_step_effects.py::test_every_epoch_sees_every_sample_once_in_a_new_order",
        ],
    ),
    Bug(
        "async-live-tensors",
        "checkpoint/store.py",
        'lambda t: t.detach().to("cpu", copy=True)',
        "lambda t: t.detach()",
        ["tests/checkpoint/test_checkpoints.py::test_an_async_save_holds_the_values_of_when_it_was_called"],
    ),
    Bug(
        "rank-zero-only-everywhere",
        "distributed/console.py",
        "return _only_where(fn, lambda rt: rt.is_main)",
        "return _only_where(fn, lambda rt: True)",
        ["tests/launch/test_launch_processes.py::test_srun_and_mpirun_environments"],
    ),
    Bug(
        "resume-never-overwrites",
        "train/rundir.py",
        'if resume == "never" and used and not environment.restart_count():',
        "if False:",
        ["tests/checkpoint/test_checkpoints.py", "-k", "resume_never"],
    ),
    Bug(
        "buffers-not-passed",
        "distributed/wrapping.py",
        "**{BUFFER_SYNC: cfg.broadcast_buffers and buffers_in_forward},",
        "**{BUFFER_SYNC: buffers_in_forward},",
        ["tests/distributed/test_wrapping.py::test_wrapped_network_keeps_its_attributes_and_methods"],
    ),
    Bug(
        "early-stop-min-delta-sign",
        "train/early_stop.py",
        "sign * (value - self.best) > self.settings.min_delta",
        "sign * (value - self.best) > -self.settings.min_delta",
        [
            "tests/train/test_step_effects.py::test_early_stopping_is_decided_once_for_every_rank_and_a_rerun_does_not_train_on"
        ],
    ),
    Bug(
        "ema-decay-reversed",
        "train/ema.py",
        "list(views.values()), 1.0 - self.decay)",
        "list(views.values()), self.decay)",
        ["tests/train/test_ema.py"],
    ),
    Bug(
        "numpy-stream-not-restored",
        "seeding.py",
        '"numpy": lambda saved: np.random.set_state(numpy_generator_state(saved)),',
        '"numpy": lambda saved: None,',
        ["tests/checkpoint/test_restores.py", "-k", "everything_restored"],
    ),
    Bug(
        "every-rank-restores-rank-0s-streams",
        "checkpoint/state.py",
        "seeding.restore(saved[self.rank])",
        "seeding.restore(saved[0])",
        ["tests/checkpoint/test_checkpoints.py::test_resume_mid_epoch_is_bitwise_identical"],
    ),
    Bug(
        "straggler-slot-of-rank-0",
        "train/intervals.py",
        "slots[self.rank * len(FIELDS) : (self.rank + 1) * len(FIELDS)] = own",
        "slots[0 : len(FIELDS)] = own",
        ["tests/train/test_stragglers.py::test_a_rank_whose_dataset_is_slow_is_named_as_waiting_for_data"],
    ),
    Bug(
        "pruned-verdict-numpy",
        "train/pruning.py",
        "return bool(self._trial.should_prune())",
        "return self._trial.should_prune()",
        ["tests/launch/test_sweep_parts.py", "-k", "pruner_name"],
    ),
    Bug(
        "trial-outlives-sweep",
        "launch/trials.py",
        "proc = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)",
        "proc = subprocess.Popen(command, env=env)",
        ["tests/launch/test_sweeps.py", "-k", "killed_or_stopped"],
    ),
    Bug(
        "pruning-ignored",
        "train/early_stop.py",
        'verdict["pruned"] = self.trial is not None and self.trial.should_prune(metrics, step)',
        'verdict["pruned"] = False',
        ["tests/launch/test_sweeps.py", "-k", "prunes_on_every_rank"],
    ),
    Bug(
        "mlflow-id-not-kept",
        "train/logs.py",
        'return {"wandb_id": self.wandb_id, "mlflow_id": self.mlflow_id}',
        'return {"wandb_id": self.wandb_id}',
        ["tests/train/test_mlflow.py", "-k", "killed_and_resumed"],
    ),
    Bug(
        "early-stopped-trial-pruned",
        "launch/trials.py",
        'if code == 0 and summary.get("status") == "pruned":',
        'if code == 0 and summary.get("status") >= "pruned":',
        ["tests/launch/test_trial_runs.py::test_a_trial_that_finishes_tells_the_study_its_best_value"],
    ),
    Bug(
        "killed-trial-counted",
        "launch/trials.py",
        'if code == 0 and summary.get("best"):',
        'if code <= 0 and summary.get("best"):',
        ["tests/launch/test_trial_runs.py::test_a_trial_that_fails_or_never_evaluates_is_one_line_and_not_counted"],
    ),
    Bug(
        "profiler-starts-early",
        "train/profiling.py",
        "if self._profiler is None and step == self.start - self.warmup:",
        "if self._profiler is None or step == self.start - self.warmup:",
        ["tests/train/test_profiling_parts.py::test_the_trace_holds_exactly_the_windows_steps_by_their_run_numbers"],
    ),
    Bug(
        "oom-piece-weight",
        "train/oom.py",
        "parts.precision.backward(loss * (share / accumulate))",
        "parts.precision.backward(loss * (share * accumulate))",
        ["tests/train/test_oom_parts.py::test_with_several_micro_batches_a_step_with_backoff_trains_as_the_plain_step"],
    ),
    Bug(
        "shared-module-left-unsynchronized",
        "distributed/gradients.py",
        "            average(self.params, self.mean)",
        "            pass",
        ["tests/train/test_shared_modules.py::test_a_shared_module_trains_on_two_ranks_as_in_one_process"],
    ),
    Bug(
        "str-setting-read-as-yaml-guesses",
        "config_reading.py",
        "        return None if raw in NULLS else raw",
        "        return None",
        ["tests/test_config_reading.py::test_a_str_setting_keeps_the_text_typed_on_the_command_line_and_in_a_file"],
    ),
    Bug(
        "notebook-settings-lose-their-defaults",
        "launch/notebook.py",
        "            if obj is dataclasses.MISSING:",
        "            if obj is None and False:",
        [
            "tests/launch/test_notebook.py::"
            "test_a_sessions_own_settings_travel_with_defaults_and_a_second_launch_uses_the_class_as_it_is_now"
        ],
    ),
    Bug(
        "bucket-history-overwritten",
        "checkpoint/mirror.py",
        "        for name in RECORD:\n            local = os.path.join(self.local, name)",
        "        for name in RECORD[:2]:\n            local = os.path.join(self.local, name)",
        [
            "tests/checkpoint/test_object_storage.py::test_a_run_resumes_from_its_bucket_on_a_machine_that_never_saw_it_bitwise"
        ],
    ),
    Bug(
        "second-job-takes-a-held-run",
        "checkpoint/lease.py",
        "if newest is not None and not self._may_take(*newest, say):",
        "if newest is not None and not self._may_take(*newest, say) and False:",
        ["tests/checkpoint/test_lease.py::test_a_job_that_renews_its_hold_refuses_the_next_in_one_line"],
    ),
    Bug(
        "live-launcher-dies-on-sigterm",
        "launch/replicas.py",
        "mine = threading.current_thread() is threading.main_thread()",
        "mine = False",
        [
            "tests/distributed/test_live.py::test_a_stop_signal_to_one_replica_or_to_the_launcher_saves_every_replica_and_the_command_continues"
        ],
    ),
    Bug(
        "bucket-retention-ignores-mode",
        "checkpoint/mirror.py",
        "kept(list_checkpoints(self.checkpoints), keep_last, keep_best, mode)",
        'kept(list_checkpoints(self.checkpoints), keep_last, keep_best, "max")',
        [
            "tests/checkpoint/test_object_storage.py::test_the_buckets_retention_keeps_the_best_by_the_monitors_mode_as_the_local_folder_does"
        ],
    ),
    Bug(
        "local-copy-of-a-bucket-checkpoint-unverified",
        "checkpoint/store.py",
        "        if _digest(data) == expected:\n            return io.BytesIO(data)",
        "        if True:\n            return io.BytesIO(data)",
        [
            "tests/checkpoint/test_object_storage.py::test_a_reader_sees_only_committed_whole_checkpoints_and_falls_back_from_a_damaged_one"
        ],
    ),
    Bug(
        "fsdp-bf16-reduces-in-bf16",
        "distributed/fsdp.py",
        "param_dtype=torch.bfloat16, reduce_dtype=torch.float32",
        "param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16",
        ["tests/distributed/test_fsdp.py::test_under_bf16_the_gradients_are_averaged_over_ranks_in_fp32"],
    ),
    Bug(
        "gradient-buckets-mix-dtypes",
        "distributed/gradients.py",
        "p.grad.dtype == bucket[0].dtype and size < BUCKET_BYTES",
        "p.grad.dtype != bucket[0].dtype and size < BUCKET_BYTES",
        [
            "tests/distributed/test_gradients.py::test_gradients_are_summed_in_buckets_of_one_dtype_up_to_the_bucket_size"
        ],
    ),
    Bug(
        "powersgd-factors-of-another-rank",
        "distributed/powersgd.py",
        'if saved["matrix_approximation_rank"] == state.matrix_approximation_rank:',
        'if saved["matrix_approximation_rank"] >= state.matrix_approximation_rank:',
        ["tests/distributed/test_powersgd_parts.py::test_factors_of_another_matrix_rank_are_not_restored"],
    ),
    Bug(
        "powersgd-errors-of-rank-0",
        "distributed/powersgd.py",
        "mine = saved[self.rank] if same_ranks else saved[0]",
        "mine = saved[0]",
        [
            "tests/distributed/test_powersgd_parts.py::"
            "test_each_rank_takes_back_its_own_errors_and_a_larger_world_starts_them_from_zero"
        ],
    ),
    Bug(
        "powersgd-q-read-untransposed",
        "distributed/powersgd.py",
        "q.copy_(torch.bmm(p.transpose(1, 2), matrix).transpose(1, 2))",
        "q.copy_(torch.bmm(p.transpose(1, 2), matrix).reshape(q.shape))",
        [
            "tests/distributed/test_powersgd_parts.py::"
            "test_on_gloo_every_bucket_is_finished_before_ddp_gets_it_and_computed_as_torchs_hook_does"
        ],
    ),
    Bug(
        "powersgd-factors-in-bucket-order",
        "distributed/powersgd.py",
        "by_shape.setdefault((n, m), []).append(k)",
        "by_shape.setdefault(0, []).append(k)",
        [
            "tests/distributed/test_powersgd_parts.py::"
            "test_on_gloo_every_bucket_is_finished_before_ddp_gets_it_and_computed_as_torchs_hook_does"
        ],
    ),
    Bug(
        "loader-worker-reset-not-waited-for",
        "train/sources.py",
        "e = _dead_worker(wait_s) or e",
        "e = _dead_worker(0) or e",
        [
            "tests/test_bad_input.py::"
            "test_a_reset_connection_while_a_loader_worker_dies_is_named_once_torch_sees_the_worker_dead"
        ],
    ),
    Bug(
        "group-destroyed-holding-the-gil",
        "distributed/runtime.py",
        "        time.sleep(GLOO_DRAIN_S)\n",
        "",
        [
            "tests/launch/test_torchrun_scripts.py::"
            "test_a_script_that_destroys_its_group_then_frees_its_model_or_makes_it_again_ends_every_time"
        ],
    ),
    Bug(
        "default-group-made-again-under-its-old-name",
        "distributed/runtime.py",
        "            c10d._world.group_count = count\n",
        "            pass\n",
        [
            "tests/launch/test_torchrun_scripts.py::"
            "test_a_script_that_destroys_its_group_then_frees_its_model_or_makes_it_again_ends_every_time"
        ],
    ),
    Bug(
        "the-loss-read-on-the-host-every-step",
        "train/step.py",
        "records.interval.keep_loss(loss.detach())",
        "records.interval.keep_loss(torch.tensor(loss.item(), device=loss.device))",
        ["tests/train/test_log_interval.py::test_a_log_interval_costs_one_host_sync_and_a_step_none"],
    ),
    Bug(
        "lost-contact-named-as-an-error-printed-above",
        "launch/worker.py",
        "            return PEER_LOST_EXIT_CODE\n",
        "            return 1\n",
        ["tests/launch/test_two_nodes.py::test_a_node_that_goes_down_is_named_by_the_node_left_as_the_cause_elsewhere"],
    ),
    Bug(
        "the-workers-records-left-in-the-temporary-folder",
        "launch/launcher.py",
        '    elif records:\n        argv += ["--log-dir", records]\n',
        "",
        [
            "tests/launch/test_launch_processes.py::"
            "test_launcher_starts_two_workers_even_when_the_port_found_for_them_is_taken"
        ],
    ),
    Bug(
        "a-killed-launchs-folder-left-for-good",
        "launch/scratch.py",
        "    remove_abandoned()\n",
        "",
        ["tests/launch/test_scratch.py"],
    ),
    Bug(
        "the-agents-loggers-set-before-its-modules-set-theirs",
        "launch/launcher.py",
        "    import torch.distributed.run  # noqa: F401\n",
        "",
        ["tests/launch/test_elastic.py::test_a_node_leaves_and_joins_again_and_the_batches_are_the_uninterrupted_ones"],
    ),
    Bug(
        "sharded-state-on-every-rank",
        "distributed/sharding.py",
        "return optimizer.state_dict() if optimizer.rank == 0 else {}",
        "return optimizer.state_dict() if optimizer.rank >= 0 else {}",
        [
            "tests/distributed/test_scaling.py::test_sharded_optimizer_holds_half_the_state_and_a_killed_run_resumes_bitwise"
        ],
    ),
    Bug(
        "mlflow-batches-dropped",
        "train/trackers.py",
        "metrics=metrics[start : start + _METRICS_PER_CALL]",
        "metrics=metrics[start : start | _METRICS_PER_CALL]",
        [
            "tests/train/test_mlflow_parts.py::test_a_run_is_an_mlflow_run_of_its_experiment_with_every_setting_and_its_metrics"
        ],
    ),
    Bug(
        "ties-untied",
        "checkpoint/export.py",
        "        if view in kept and value.numel():",
        "        if False:",
        ["tests/checkpoint/test_export.py::test_a_tied_tensor_is_written_once_and_every_other_view_is_a_copy"],
    ),
    Bug(
        "aliases-not-restored",
        "checkpoint/export.py",
        "    return {**tensors, **{alias: tensors[kept] for alias, kept in aliases.items()}}",
        "    return tensors",
        ["tests/checkpoint/test_export.py::test_a_tied_tensor_is_written_once_and_every_other_view_is_a_copy"],
    ),
    Bug(
        "shared-module-reduced-twice",
        "train/components.py",
        "    if shared:\n",
        "    if False:\n",
        [
            "tests/train/test_model_families.py::test_a_killed_run_resumes_bit_for_bit_and_every_rank_holds_the_same_state[SharedEmbedding]"
        ],
    ),
    Bug(
        "tuple-loss-first-element",
        "train/returns.py",
        "        loss = scalars[0] if len(scalars) == 1 else None",
        "        loss = out[0]",
        ["tests/train/test_returns.py::test_the_loss_is_found_where_each_kind_of_output_keeps_it"],
    ),
    Bug(
        "end-failure-not-recorded",
        "train/ending.py",
        '        with open(os.path.join(self.run_dir, RECORD), "w") as f:\n',
        '        with open(os.devnull, "w") as f:\n',
        [
            "tests/train/test_run_end.py::test_a_failed_end_is_one_line_kept_listed_as_such_and_the_same_command_finishes_it"
        ],
    ),
    Bug(
        "no-group-of-one",
        "distributed/runtime.py",
        '    elif group_of_one and cluster.source != "single" and not dist.is_initialized():',
        "    elif False:",
        ["tests/launch/test_torchrun_scripts.py::test_a_torchrun_script_runs_under_ddplab_as_under_torchrun[1]"],
    ),
    Bug(
        "wall-time-from-first-start",
        "train/summary.py",
        "        logged = [t for t in times if start <= t < end]",
        "        logged = [t for t in times if start <= t] if start == starts[0] else []",
        ["tests/train/test_run_end.py::test_wall_time_sums_each_attempt_to_its_last_line_and_counts_the_attempts"],
    ),
    Bug(
        "marker-first",
        "checkpoint/mirror.py",
        """        for part in (STATE, META):
            self.store.put_file(os.path.join(folder, part), "checkpoints", name, part)
        self.store.put_file(os.path.join(folder, COMMITTED), "checkpoints", name, COMMITTED)""",
        """        self.store.put_file(os.path.join(folder, COMMITTED), "checkpoints", name, COMMITTED)
        for part in (STATE, META):
            self.store.put_file(os.path.join(folder, part), "checkpoints", name, part)""",
        [
            "tests/checkpoint/test_object_storage.py::"
            "test_an_upload_cut_short_after_any_of_its_objects_leaves_no_checkpoint_in_the_bucket"
        ],
    ),
    Bug(
        "bucket-checksum-unchecked",
        "checkpoint/store.py",
        "    if _digest(data) != expected:",
        "    if False:",
        [
            "tests/checkpoint/test_object_storage.py::"
            "test_a_reader_sees_only_committed_whole_checkpoints_and_falls_back_from_a_damaged_one"
        ],
    ),
    Bug(
        "no-catch-up",
        "checkpoint/mirror.py",
        "if local and (not remote or local[-1].step > remote[-1].step):",
        "if False:",
        [
            "tests/checkpoint/test_object_storage.py::"
            "test_a_store_that_stops_answering_mid_save_costs_no_step_and_no_checkpoint"
        ],
    ),
    Bug(
        "stock-torchft-hook",
        "distributed/live.py",
        "            _comm_hook = staticmethod(recovering_comm_hook)\n",
        "            pass\n",
        [
            "tests/distributed/test_live.py::"
            "test_a_replica_killed_inside_the_backward_all_reduce_costs_its_peer_one_step_again"
        ],
    ),
    Bug(
        "replica-shares-unweighted",
        "train/live.py",
        "            weight = samples * size / self.global_batch\n",
        "            weight = None\n",
        [
            "tests/distributed/test_live.py::"
            "test_three_replicas_one_killed_between_steps_the_others_go_on_and_shares_stay_exact"
        ],
    ),
    Bug(
        "uncommitted-step-applied",
        "train/live.py",
        "            if self.replica.commit():\n",
        "            if self.replica.commit() or True:\n",
        [
            "tests/distributed/test_live.py::"
            "test_a_replica_killed_inside_the_backward_all_reduce_costs_its_peer_one_step_again"
        ],
    ),
    Bug(
        "replica-heartbeats-while-it-starts",
        "distributed/live.py",
        "        self.manager = None\n",
        "        self.manager = None\n        self.join()\n",
        [
            "tests/distributed/test_live_parts.py::"
            "test_a_replica_is_heard_by_the_lighthouse_from_its_first_quorum_not_while_it_starts"
        ],
    ),
    Bug(
        "replacement-trains-after-the-run-finished",
        "train/live.py",
        "        if peers := self.replica.finished_peers():\n",
        "        if peers := []:\n",
        [
            "tests/distributed/test_live.py::"
            "test_a_replacement_that_comes_after_its_peer_finished_ends_without_a_run_of_its_own"
        ],
    ),
    Bug(
        "replaced-after-the-run-finished",
        "launch/replicas.py",
        "or used[replica] >= replacements or finished:",
        "or used[replica] >= replacements:",
        [
            "tests/distributed/test_live_parts.py::test_a_replica_that_fails_after_a_peer_finished_the_run_is_not_replaced"
        ],
    ),
    Bug(
        "help-imports-torch",
        "launch/launcher.py",
        "from .. import environment\n",
        "from .. import environment\nfrom ..distributed import runtime  # noqa: F401\n",
        ["tests/launch/test_launch_options.py::test_the_command_lines_help_answers_without_importing_torch"],
    ),
    Bug(
        "fork-server-dies-with-the-group",
        "launch/fork_server.py",
        "previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)",
        "previous = signal.pthread_sigmask(signal.SIG_BLOCK, [])",
        [
            "tests/launch/test_fork_server.py::test_a_stop_signal_sent_to_the_whole_job_saves_a_checkpoint_where_it_stopped"
        ],
    ),
    Bug(
        "forked-workers-outlive-their-launcher",
        "launch/fork_server.py",
        "    _let_go_of_the_server()\n",
        "",
        [
            "tests/launch/test_fork_server.py::test_a_launcher_killed_by_sigkill_takes_the_server_and_its_workers_with_it"
        ],
    ),
    Bug(
        "forked-worker-keeps-the-servers-start-method",
        "launch/fork_server.py",
        "    multiprocessing.set_start_method(None, force=True)\n",
        "",
        [
            "tests/launch/test_fork_server.py::test_the_workers_fork_from_one_server_kept_for_the_launchers_next_launch_in_the_same_environment"
        ],
    ),
    Bug(
        "forked-worker-in-the-servers-environment",
        "launch/fork_server.py",
        '        os.environ.clear()\n        os.environ.update(state["environ"])\n',
        "        pass\n",
        [
            "tests/launch/test_fork_server.py::test_a_worker_starts_from_the_launchers_environment_as_it_is_when_the_worker_starts"
        ],
    ),
    Bug(
        "finished-forked-worker-lingers",
        "launch/worker.py",
        "    if code == 0 and not fork_server.handed_in_return_value():\n",
        "    if code == 0:\n",
        ["tests/distributed/test_hangs.py::test_inside_an_experiment_a_rank_that_had_already_finished"],
    ),
    Bug(
        "forked-worker-keeps-the-launchers-ignored-sigint",
        "launch/fork_server.py",
        "    signal.signal(signal.SIGINT, signal.default_int_handler)\n",
        "",
        [
            "tests/launch/test_fork_server.py::test_a_job_started_in_the_background_still_stops_at_sigint_to_its_launcher"
        ],
    ),
    Bug(
        "preemption-signal-passed-to-the-servers-helpers",
        "launch/stops.py",
        "if (parent == os.getpid() and pid not in helpers) or (server and parent == server):",
        "if parent == os.getpid():",
        [
            "tests/checkpoint/test_checkpoints.py::test_a_signal_to_the_launcher_stops_the_job_and_the_printed_command_continues_it"
        ],
    ),
    Bug(
        "forked-worker-sees-the-launchers-command-line",
        "launch/worker.py",
        "    sys.argv = [__file__]\n",
        "",
        ["tests/test_show_config_and_plan.py::test_workers_get_the_plan_resolved_once"],
    ),
    Bug(
        "only-the-first-failure-named",
        "launch/failures.py",
        "root_cause(_with_peers_records(e.failures))",
        "root_cause(e.failures)",
        [
            "tests/launch/test_launch_processes.py::test_a_user_error_stays_one_line_when_its_rank_is_stopped_while_cleaning_up"
        ],
    ),
    Bug(
        "default-bucket-by-value",
        "distributed/wrapping.py",
        "    return cfg.bucket_cap_mb\n",
        "    return cfg.bucket_cap_mb or DDP_BUCKET_CAP_MB\n",
        ["tests/distributed/test_wrapping.py::test_the_first_bucket_is_sent_while_the_backward_runs_on"],
    ),
    Bug(
        "ranks-meet-at-the-port-the-agent-found",
        "launch/launcher.py",
        "    os.environ[environment.STORE_PORT] = str(port)\n",
        "",
        [
            "tests/launch/test_launch_processes.py::"
            "test_launcher_starts_two_workers_even_when_the_port_found_for_them_is_taken"
        ],
    ),
    Bug(
        "stop-signals-given-back-before-the-teardown",
        "train/loop.py",
        "        try:\n            self.data.close(failure)\n",
        "        self.signals.close()\n        try:\n            self.data.close(failure)\n",
        [
            "tests/train/test_mlflow.py::test_a_killed_and_resumed_run_is_one_mlflow_run_with_every_step_once_per_log_line"
        ],
    ),
    Bug(
        "a-scripts-ranks-meet-at-the-port-the-agent-found",
        "launch/worker.py",
        "        runtime.meet_in_the_launchers_store()\n",
        "",
        ["tests/launch/test_launch_processes.py::test_plain_script_runs_under_the_launcher_with_its_arguments"],
    ),
    Bug(
        "a-kept-servers-workers-print-to-its-first-launchs-output",
        "launch/fork_server.py",
        '"output": _output_handed_over()}',
        '"output": {}}',
        [
            "tests/launch/test_fork_server.py::test_the_workers_fork_from_one_server_kept_for_the_launchers_next_launch_in_the_same_environment"
        ],
    ),
    Bug(
        "a-server-kept-for-another-environment",
        "launch/fork_server.py",
        "if _kept is not None and _kept.started_with != wanted:",
        "if False:",
        [
            "tests/launch/test_fork_server.py::test_the_workers_fork_from_one_server_kept_for_the_launchers_next_launch_in_the_same_environment"
        ],
    ),
    Bug(
        "a-forked-child-stops-its-parents-kept-server",
        "launch/fork_server.py",
        "    if _kept is None or _kept.owner != os.getpid():",
        "    if _kept is None:",
        [
            "tests/launch/test_fork_server.py::test_a_process_that_launches_twice_keeps_one_server_which_ends_with_it_not_with_a_child"
        ],
    ),
    Bug(
        "a-kept-servers-folder-left-after-the-process",
        "launch/fork_server.py",
        "            atexit.register(_let_go)\n",
        "            pass\n",
        [
            "tests/launch/test_fork_server.py::test_a_process_that_launches_twice_keeps_one_server_which_ends_with_it_not_with_a_child"
        ],
    ),
]


def plant(bug: Bug, work: Path) -> str | None:
    """Put `bug` into the copy; None, or why it cannot be planted any more."""
    path = work / "src" / "ddplab" / bug.file
    text = path.read_text()
    if text.count(bug.old) != 1:
        return f"its code is not in {bug.file} exactly once any more ({text.count(bug.old)} times)"
    path.write_text(text.replace(bug.old, bug.new))
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="the bugs to plant (default: all)")
    args = parser.parse_args()
    chosen = [bug for bug in BUGS if not args.names or bug.name in args.names]
    failed = False
    for bug in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "repo"
            shutil.copytree(
                REPO, work, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", ".mutation")
            )
            problem = plant(bug, work)
            if problem is None:
                env = {**os.environ, "PYTHONPATH": str(work / "src")}
                run = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *bug.tests],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                problem = None if run.returncode == 1 else f"not caught (pytest exit code {run.returncode})"
        failed |= problem is not None
        print(f"{bug.name}: {problem or 'caught'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
