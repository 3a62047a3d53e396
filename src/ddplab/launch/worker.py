"""Run a plan inside this process, as one rank of the job, and exit honestly.

A user mistake (`DdplabError`) is one line with the rank; a bug keeps its traceback and is recorded
for torch's elastic agent, so the launcher shows the failing rank's own error first. A worker with a
process group leaves by `os._exit(code)`: gloo can abort at interpreter exit (docs/decisions.md)."""

import os
import sys
import traceback

from .. import environment

# before torch: the agent starts workers with `python -m`
environment.working_folder_last()

import ctypes
import io
import runpy
import signal

import torch.distributed as dist

from ..distributed import hangs, runtime
from ..distributed.cluster import detect
from ..distributed.console import label_rank_output, print_rank
from ..errors import PEER_LOST_EXIT_CODE, USER_ERROR_EXIT_CODE, DdplabError, PeerFailed
from ..tools import outputs
from ..train.sources import ask_for_worker_deaths, loader_worker_died
from . import fork_server, stops
from .notebook import leave_returned
from .plan import RunPlan


def run_plan(plan: RunPlan) -> int:
    """Run the plan on this rank (train, evaluate a checkpoint, call a function or run a script)
    and return the exit code it deserves."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    _die_with_launcher(plan.launcher_pid)
    if plan.launcher_pid is not None:
        # ranks share the launcher's terminal: whole lines, each labelled
        me = detect(os.environ)
        label_rank_output(me.rank, me.world_size, me.local_rank, plan.shown_ranks)
    _say_restarted()
    stops.forget_note(plan)
    stops.expect_failures(plan)
    # ddplab's launcher reports a failing rank's message itself, once
    quiet = plan.launcher_pid is not None
    try:
        code = _run(plan)
        hangs.finish()
        return code
    except DdplabError as e:
        # a plain one: the launcher's sign of a user error
        stops.note_failure()
        handler.record_exception(DdplabError(str(e)))
        if not quiet:
            print_rank(f"ddplab: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except SystemExit as e:
        # as the interpreter reads it: None is 0, a number itself, a message 1
        message = e.code is not None and not isinstance(e.code, int)
        if message:
            print(e.code, file=sys.stderr)
        code = 1 if message else e.code or 0
        if code:
            stops.note_failure()
        return code
    except KeyboardInterrupt:
        print_rank("ddplab: interrupted", file=sys.stderr)
        return 130
    except PeerFailed:
        # the failed worker's error is the one the launcher names
        return PEER_LOST_EXIT_CODE
    except BaseException as e:
        stops.note_failure()
        return _failed(e, handler, quiet)
    finally:
        # leaving, failed or not: the agent's SIGTERM no longer cuts the teardown short (train/signals.py)
        stops.stand_down()
        runtime.current().close()
        if dist.is_available() and dist.is_initialized():
            # a script made its own group
            dist.destroy_process_group()


def run_forked(environment: fork_server.LaunchersEnvironment) -> None:
    """How the launcher starts each worker from its fork server (fork_server.py): the same life as
    `python -m ddplab.launch.worker`'s, leaving at once with its exit code, finished or failed. The
    launcher's environment was made this process's as ENVIRONMENT was unpickled."""
    fork_server.become_worker()
    unbuffered_output()
    # what a worker started by itself sees, not the launcher's command line
    sys.argv = [__file__]
    code = run_plan(RunPlan.from_env())
    if code == 0 and not fork_server.handed_in_return_value():
        sys.stdout.flush()
        sys.stderr.flush()
        return
    exit_now(code)


def _failed(e: BaseException, handler, quiet: bool) -> int:
    """A failure that is not a user error: a diagnosed hang or dead DataLoader worker (one line), a
    lost peer (a consequence, whose cause the launcher names), or a bug (its traceback, recorded for
    the agent). Returns the rank's exit code."""
    ask_for_worker_deaths()
    diagnosis = loader_worker_died(e) or _diagnose_collective(e)
    if diagnosis is not None:
        handler.record_exception(diagnosis)
        if not quiet:
            print_rank(f"ddplab: error: {diagnosis}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    if hangs.is_peer_lost(e):
        if quiet:
            return PEER_LOST_EXIT_CODE
        print_rank("ddplab: lost contact with another rank (it failed or was stopped; see its error)", file=sys.stderr)
        return 1
    print_rank(f"ddplab: {type(e).__name__} in the experiment; traceback:", file=sys.stderr)
    traceback.print_exc()
    handler.record_exception(e)
    return 1


def _say_restarted() -> None:
    """Rank 0 of workers that torch's elastic agent restarted after a failure says so, once."""
    restarts = environment.restart_count()
    # after a regrouping the launcher has said why (launch/elastic.py)
    regrouped = os.environ.get(environment.REGROUPED)
    if restarts and not regrouped and os.environ.get(environment.RANK, "0") == "0":
        most = os.environ.get(environment.MAX_RESTARTS, "?")
        print(f"ddplab: the workers were restarted after a failure (restart {restarts} of at most {most})", flush=True)


def exit_now(code: int) -> None:
    """Leave without interpreter shutdown, after flushing what we printed (see module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(plan: RunPlan) -> int:
    from omegaconf import OmegaConf

    from ..config import dist_overrides
    from ..experiment import Experiment

    # the experiment's or script's own destroy_process_group must not hang it (torch 2.13's gloo)
    runtime.mend_destroy_process_group()

    if plan.entry is None:
        # the script's own ddplab.init() joins with the dist.* settings of its command line
        runtime.script_settings = dist_overrides(plan.args)
        runtime.meet_in_the_launchers_store()
        hangs.watch_own_groups()
        try:
            _run_script(plan.script, plan.args)
        finally:
            runtime.script_settings = None
        return 0
    obj, cfg = plan.load()
    # torn down in run_plan, after errors are reported with the rank
    runtime.init(OmegaConf.to_object(cfg.dist), group_of_one=False)
    is_experiment = isinstance(obj, type) and issubclass(obj, Experiment)
    if plan.command in ("eval", "predict") and not is_experiment:
        raise DdplabError(
            f"ddplab {plan.command} needs an Experiment class, and {obj!r} is not one", "pass NAME or file.py:Class"
        )
    if plan.command == "eval":
        metrics = obj(cfg).evaluate_checkpoint(plan.checkpoint, plan.eval_set)
        if runtime.current().is_main:
            outputs.write_eval(metrics, plan.checkpoint, plan.out)
    elif plan.command == "predict":
        predictions = obj(cfg).predict_checkpoint(plan.checkpoint, plan.input)
        if runtime.current().is_main:
            outputs.write_predictions(predictions, plan.out)
    elif is_experiment:
        exp = obj(cfg)
        exp.fit()
        if exp.trainer.preempted:
            return stops.leave_note(plan, exp.trainer.stopped_by, exp.step, exp.run_dir, exp.trainer.not_uploaded)
        stops.leave_note(plan, None, exp.step, exp.run_dir)
    else:
        returned = obj(cfg)
        if runtime.current().is_main:
            # for the session that started the run (ddplab.run), when one did
            leave_returned(returned)
    return 0


def _run_script(script: str, argv: list[str]) -> None:
    """A plain file or module runs as `__main__` with its arguments in sys.argv, as under torchrun."""
    sys.argv = [script, *argv]
    if script.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_module(script, run_name="__main__", alter_sys=True)


def _diagnose_collective(e: BaseException) -> DdplabError | None:
    """A failed collective as one line naming it and what every rank was doing (see hangs.py)."""
    rt = runtime.current()
    return hangs.explain(e, rt.world_size, rt.timeout_s)


def _die_with_launcher(launcher_pid: int | None) -> None:
    """Under ddplab's launcher, end this worker when the launcher dies, even by SIGKILL: an orphaned
    worker would otherwise wait in a collective forever, holding its GPU and port."""
    if not launcher_pid or not sys.platform.startswith("linux"):
        return
    try:
        # PR_SET_PDEATHSIG
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))
    except OSError:
        return
    parent = os.getppid()
    # a worker forked from the launcher's fork server (fork_server.py) is the launcher's grandchild:
    # the server ends when the launcher does, and its end ends this worker
    if launcher_pid not in (parent, fork_server.parent_of(parent)):
        # the launcher died before the line above took effect
        os._exit(1)


def unbuffered_output() -> None:
    """What `python -u` gives a worker started as its own process: prints reach the terminal as
    they are made, not when a buffer fills (or never, for a worker that is killed)."""
    sys.stdout, sys.stderr = (_unbuffered(stream) for stream in (sys.stdout, sys.stderr))


def _unbuffered(stream):
    stream.flush()
    # the stream lives as long as the process
    raw = open(stream.fileno(), "wb", buffering=0, closefd=False)  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True)


if __name__ == "__main__":
    # how ddplab's launcher starts each worker
    exit_now(run_plan(RunPlan.from_env()))
