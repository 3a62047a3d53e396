"""Run a target inside this process, as one rank of the job, and exit honestly.

Every rank ends here: started by ddplab's launcher, by torchrun, srun, mpirun, or by hand.
Two things matter at the end of a worker's life:

* A user mistake (`DdplabError`) is printed as one line, prefixed with the rank; a bug keeps its
  traceback and is recorded for torch's elastic agent, so the launcher can show the failing
  rank's own error first.
* After a run over gloo, the interpreter sometimes aborts while shutting down (a gloo thread
  frees tensors Python already tore down), turning a successful run into exit code -6. So a
  worker that used a process group flushes its output and leaves with `os._exit(code)` right
  after destroying the group: the exit code is the run's, not the shutdown's.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from . import hangs, runtime
from .config import Config, load_config
from .console import print_rank
from .errors import USER_ERROR_EXIT_CODE, DdplabError
from .targets import resolve

LAUNCHER_ENV = "DDPLAB_LAUNCHER"
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def run_target(spec: str, overrides: list[str], extra_args: list[str], config_file: str | None = None,
               evaluate: tuple[str, str | None] | None = None) -> int:
    """Run TARGET on this rank (train it, or with `evaluate=(checkpoint, out)` evaluate a checkpoint)
    and return the exit code it deserves."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    _die_with_launcher()
    _announce_restart()
    try:
        target = resolve(spec)
        if target.is_script:
            target.run_script([*overrides, *extra_args])
        else:
            _run_callable(target.obj, overrides, extra_args, config_file, evaluate)
        hangs.finish()
        return 0
    except DdplabError as e:
        handler.record_exception(e)  # marks this rank as a root cause; ddplab's launcher prints it once
        if not _under_ddplab_launcher():
            print_rank(f"ddplab: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except SystemExit as e:
        return _exit_code(e.code)
    except KeyboardInterrupt:
        print_rank("ddplab: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # a bug: keep the traceback, and record it for the agent
        diagnosis = _diagnose_collective(e)
        if diagnosis is not None:
            handler.record_exception(diagnosis)
            if not _under_ddplab_launcher():
                print_rank(f"ddplab: error: {diagnosis}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        if _is_peer_lost(e):
            if not _under_ddplab_launcher():
                print_rank("ddplab: lost contact with another rank (it failed or was stopped; see its error)",
                           file=sys.stderr)
        else:
            print_rank(f"ddplab: {type(e).__name__} in the experiment; traceback:", file=sys.stderr)
            traceback.print_exc()
            handler.record_exception(e)
        return 1
    finally:
        _teardown()


def exit_now(code: int) -> None:
    """Leave without interpreter shutdown, after flushing what we printed (see module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_callable(obj, overrides: list[str], extra_args: list[str], config_file: str | None, evaluate) -> None:
    if extra_args:
        raise DdplabError(f"unexpected arguments {extra_args}", "give settings as key=value, e.g. trainer.max_steps=100")
    schema = getattr(obj, "config_class", Config)
    cfg = load_config(schema, overrides, config_file)
    runtime.init(_dist_part(cfg))  # torn down in run_target, after errors are reported with the rank
    from .experiment import Experiment

    is_experiment = isinstance(obj, type) and issubclass(obj, Experiment)
    if evaluate is not None:
        if not is_experiment:
            raise DdplabError(f"ddplab eval needs an Experiment class, and {obj!r} is not one", "pass NAME or file.py:Class")
        _write_eval(obj(cfg).evaluate_checkpoint(evaluate[0]), *evaluate)
    elif is_experiment:
        obj(cfg).fit()
    else:
        obj(cfg)


def _write_eval(metrics: dict, checkpoint: str, out: str | None) -> None:
    """Rank 0 prints the metrics as JSON and writes them to `out` (default: next to the checkpoint)."""
    import json

    if not runtime.current().is_main:
        return
    path = out or _default_eval_path(checkpoint)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    print(json.dumps(metrics), flush=True)
    print(f"ddplab: evaluation metrics written to {path}", file=sys.stderr, flush=True)


def _default_eval_path(checkpoint: str) -> str:
    """`<run>/results/eval-step-00000040.json` for a checkpoint of a run directory."""
    from .checkpoint import resolve_checkpoint

    step_dir = os.path.abspath(resolve_checkpoint(checkpoint))
    step_dir = os.path.dirname(step_dir) if os.path.isfile(step_dir) else step_dir
    run_dir = os.path.dirname(os.path.dirname(step_dir))
    return os.path.join(run_dir, "results", f"eval-{os.path.basename(step_dir)}.json")


def _dist_part(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg.dist)


def _teardown() -> None:
    runtime.current().close()
    if dist.is_available() and dist.is_initialized():  # a script made its own group
        dist.destroy_process_group()


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _diagnose_collective(e: BaseException) -> DdplabError | None:
    """For a collective that timed out or mismatched: print every rank's stack once and return
    the one-line error naming the collective and the ranks (see hangs.py)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rt = runtime.current()
    found = hangs.diagnose(e, rt.world_size, rt.timeout_s)
    if found is None:
        return None
    cause, stacks = found
    if stacks:
        print(f"ddplab: the Python stack of every rank when the collective failed:\n{stacks}", file=sys.stderr,
              flush=True)
    return DdplabError(cause, "every rank must call the same collectives in the same order with the same shapes "
                              "(work done on one rank only must not contain any); dist.debug=detail checks each "
                              "collective as it is called")


def _under_ddplab_launcher() -> bool:
    """ddplab's launcher reports the failing rank's message itself, once for the whole job."""
    return os.environ.get(LAUNCHER_ENV) == "1"


def _is_peer_lost(e: BaseException) -> bool:
    """A collective failed because another rank died: a consequence, not the cause."""
    return any(s in str(e) for s in _PEER_LOST)


def _die_with_launcher() -> None:
    """Under ddplab's launcher, end this worker when the launcher dies, even by SIGKILL: an orphaned
    worker would otherwise wait in a collective forever, holding its GPU and port."""
    agent = os.environ.get("DDPLAB_AGENT_PID")
    if not agent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(agent):  # the launcher died before the line above took effect
        os._exit(1)


def _announce_restart() -> None:
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts and os.environ.get("RANK", "0") == "0":
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        print(f"ddplab: the workers were restarted after a failure (restart {restarts} of at most {limit})", flush=True)
