"""Run a plan inside this process, as one rank of the job, and exit honestly.

A user mistake (`DdplabError`) is one line with the rank; a bug keeps its traceback and is recorded
for torch's elastic agent, so the launcher shows the failing rank's own error first. A worker with a
process group leaves by `os._exit(code)`: gloo can abort at interpreter exit (docs/decisions.md)."""

import os, sys, traceback

from .. import environment

environment.working_folder_last()  # before torch: the agent starts workers with `python -m`

import contextlib, csv, ctypes, json, runpy, signal  # noqa: E402 (a json.py in the working folder must not hide json)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ..console import label_rank_output, print_rank
from ..distributed import hangs, runtime
from ..distributed.cluster import detect
from ..errors import USER_ERROR_EXIT_CODE, DdplabError
from . import stops
from .plan import RunPlan


def run_plan(plan: RunPlan) -> int:
    """Run the plan on this rank (train, evaluate a checkpoint, call a function or run a script)
    and return the exit code it deserves."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    _die_with_launcher(plan.launcher_pid)
    if plan.launcher_pid is not None:  # ranks share the launcher's terminal: whole lines, each labelled
        c = detect(os.environ)
        label_rank_output(c.rank, c.world_size, c.local_rank, plan.shown_ranks)
    if (restarts := environment.restart_count()) and os.environ.get(environment.RANK, "0") == "0":
        print(f"ddplab: the workers were restarted after a failure (restart {restarts} of at most "
              f"{os.environ.get(environment.MAX_RESTARTS, '?')})", flush=True)
    quiet = plan.launcher_pid is not None  # ddplab's launcher reports a failing rank's message itself, once
    try:
        code = _run(plan)
        hangs.finish()
        return code
    except DdplabError as e:
        handler.record_exception(DdplabError(str(e)))  # a plain one: the launcher's sign of a user error
        if not quiet:
            print_rank(f"ddplab: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except SystemExit as e:  # as the interpreter reads it: None is 0, a number itself, a message 1
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print_rank("ddplab: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # a bug: keep the traceback, and record it for the agent
        diagnosis = _diagnose_collective(e)
        if diagnosis is not None:
            handler.record_exception(diagnosis)
            if not quiet:
                print_rank(f"ddplab: error: {diagnosis}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        if hangs.is_peer_lost(e):  # a consequence of another rank's failure, not the cause
            if not quiet:
                print_rank("ddplab: lost contact with another rank (it failed or was stopped; see its error)",
                           file=sys.stderr)
        else:
            print_rank(f"ddplab: {type(e).__name__} in the experiment; traceback:", file=sys.stderr)
            traceback.print_exc()
            handler.record_exception(e)
        return 1
    finally:
        runtime.current().close()
        if dist.is_available() and dist.is_initialized():  # a script made its own group
            dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Leave without interpreter shutdown, after flushing what we printed (see module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(plan: RunPlan) -> int:
    from omegaconf import OmegaConf

    from ..experiment import Experiment

    if plan.entry is None:
        _run_script(plan.script, plan.args)
        return 0
    obj, cfg = plan.load()
    runtime.init(OmegaConf.to_object(cfg.dist))  # torn down in run_plan, after errors are reported with the rank
    is_experiment = isinstance(obj, type) and issubclass(obj, Experiment)
    if plan.command in ("eval", "predict") and not is_experiment:
        raise DdplabError(f"ddplab {plan.command} needs an Experiment class, and {obj!r} is not one",
                          "pass NAME or file.py:Class")
    if plan.command == "eval":
        _write_eval(obj(cfg).evaluate_checkpoint(plan.checkpoint, plan.eval_set), plan.checkpoint, plan.out)
    elif plan.command == "predict":
        _write_predictions(obj(cfg).predict_checkpoint(plan.checkpoint, plan.input), plan.out)
    elif is_experiment:
        exp = obj(cfg)
        exp.fit()
        if exp.trainer.preempted:
            return stops.leave_note(plan, exp.trainer.stopped_by, exp.step, exp.run_dir)
    else:
        obj(cfg)
    return 0


def _run_script(script: str, argv: list[str]) -> None:
    """A plain file or module runs as `__main__` with its arguments in sys.argv, as under torchrun."""
    sys.argv = [script, *argv]
    if script.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    else:
        runpy.run_module(script, run_name="__main__", alter_sys=True)


def _write_eval(metrics: dict, checkpoint: str, out: str | None) -> None:
    """Rank 0 prints the metrics as JSON and writes them to `out` (default: next to the checkpoint)."""
    if runtime.current().is_main:
        path = out or _default_eval_path(checkpoint)
        _write_file(path, "the evaluation metrics", lambda f: json.dump(metrics, f, indent=1))
        print(json.dumps(metrics), flush=True)
        print(f"ddplab: evaluation metrics written to {path}", file=sys.stderr, flush=True)


def _write_predictions(outputs: dict, path: str) -> None:
    """Rank 0 writes one row per input row, in input order: CSV (an output of several values per row
    is columns NAME_0, NAME_1, ...) or JSON lines. Floats keep the digits that tell them apart."""
    if not runtime.current().is_main:
        return
    table = {k: [[x if isinstance(x, int) or v.dtype == torch.float64 else float(f"{x:.9g}") for x in row]
                 for row in v.reshape(len(v), -1).tolist()] for k, v in outputs.items()}  # key -> rows of values
    n = len(next(iter(table.values())))
    if path.endswith(".jsonl"):
        lines = [json.dumps({k: col[i][0] if len(col[i]) == 1 else col[i] for k, col in table.items()}) + "\n"
                 for i in range(n)]
        _write_file(path, "the predictions", lambda f: f.writelines(lines))
    else:
        header = [k if len(col[0]) == 1 else f"{k}_{j}" for k, col in table.items() for j in range(len(col[0]))]
        rows = [header, *([x for col in table.values() for x in col[i]] for i in range(n))]
        _write_file(path, "the predictions", lambda f: csv.writer(f).writerows(rows))
    print(f"ddplab: {n} predictions written to {path}", file=sys.stderr, flush=True)


def _write_file(path: str, what: str, write) -> None:
    """Whole or not at all: written beside `path`, then renamed onto it."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.tmp", "w", newline="") as f:
            write(f)
        os.replace(f"{path}.tmp", path)
    except OSError as e:  # a folder given as --out, a read-only run folder
        with contextlib.suppress(OSError):
            os.remove(f"{path}.tmp")
        raise DdplabError(f"cannot write {what} to {path} ({e.strerror})", "pass --out FILE in a writable "
                          "folder") from None


def _default_eval_path(checkpoint: str) -> str:
    """`<run>/results/eval-step-00000040.json` for a checkpoint of a run directory."""
    from ..checkpoint.store import resolve_checkpoint

    step_dir = os.path.abspath(resolve_checkpoint(checkpoint))
    step_dir = os.path.dirname(step_dir) if os.path.isfile(step_dir) else step_dir
    run_dir = os.path.dirname(os.path.dirname(step_dir))
    return os.path.join(run_dir, "results", f"eval-{os.path.basename(step_dir)}.json")


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
                              "(work done on one rank only must not contain any); in a script without DDP, "
                              "dist.debug=detail checks each collective as it is called")


def _die_with_launcher(launcher_pid: int | None) -> None:
    """Under ddplab's launcher, end this worker when the launcher dies, even by SIGKILL: an orphaned
    worker would otherwise wait in a collective forever, holding its GPU and port."""
    if not launcher_pid or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != launcher_pid:  # the launcher died before the line above took effect
        os._exit(1)


if __name__ == "__main__":  # how ddplab's launcher starts each worker
    exit_now(run_plan(RunPlan.from_env()))
