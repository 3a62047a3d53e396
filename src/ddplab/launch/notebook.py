"""`ddplab.run(MyExperiment, n=2, overrides=[...])`: an experiment defined in a notebook cell (or
any Python session) trained on several processes of this machine, its output in the cell, its
result back in the session.

How the class reaches the workers: it is pickled *by value* with cloudpickle (the class, its
methods, and the notebook's own functions and classes it uses), written to a file, and named as the
target of an ordinary `ddplab run FILE.pkl:Name -n N` started as a child process. So the workers
are the ones every ddplab job has (torch's elastic agent, restarts, stop signals, checkpoints), the
session itself never joins a process group, and the same call can be made again in the same kernel.
Modules the class imports travel by name: the workers start in the session's folder, with its
`sys.path`, and import them there. What cloudpickle cannot pickle (an open file, a lock, a
connection held at module level) is refused in one line before anything starts; make it in
`build()` instead. Fork (Lightning's `ddp_notebook`) was not chosen: a child forked from a kernel
whose torch already ran OpenMP threads may hang in its first parallel kernel."""

import codecs
import dataclasses
import io
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import environment
from ..entries import PAYLOAD_SUFFIX
from ..errors import DdplabError, LaunchError

# seconds a stopped run has to save its checkpoint and leave before it is killed
STOP_GRACE_S = 60.0


@dataclass
class RunResult:
    """What a run from a session gives back."""

    # the run's folder: checkpoints, metrics.jsonl, summary.json, final/ (None for a function)
    run_dir: str | None
    # the last evaluation's metrics (empty without an evaluation)
    metrics: dict[str, float] = field(default_factory=dict)
    # a function's return value on rank 0
    returned: Any = None


def run(
    target: type | Callable,
    n: int = 1,
    overrides: Sequence[str] = (),
    config: str | None = None,
    launch: Sequence[str] = (),
) -> RunResult:
    """Train `target` (an Experiment subclass, or a function taking the config) on `n` processes of
    this machine, as `ddplab run` would: `overrides` are its key=value settings, `config` a YAML
    file of them (a run's config.yaml resumes that run), `launch` other launch flags
    (`["--max-restarts", "1"]`). Each rank's output streams into the cell; interrupting the cell
    stops the run (it saves a checkpoint, as for SIGTERM) and ends every worker."""
    try:
        import cloudpickle
    except ImportError:
        raise DdplabError(
            "ddplab.run sends the experiment to its processes with cloudpickle, which is not installed",
            "pip install 'ddplab[notebook]' (or cloudpickle)",
        ) from None

    from ..config import Config, load_config, split_overrides
    from ..train.rundir import new_run_name
    from .targets import runnable

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DdplabError(f"n={n!r}: the number of processes must be a whole number of at least 1", "pass n=2, say")
    name = getattr(target, "__name__", type(target).__name__)
    runnable(target, name)
    # one setting given as a string is a list of one, not of its characters; launch flags as a string
    # are split as a shell would ("--max-restarts 1")
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    launch = shlex.split(launch) if isinstance(launch, str) else list(launch)
    _check_one_count(n, launch)
    settings, extra = split_overrides(overrides)
    if extra:
        raise DdplabError(f"unexpected overrides {extra}", "give settings as 'key=value', e.g. 'trainer.max_steps=100'")
    # the settings' mistakes here, in one line, before any process starts
    cfg = load_config(getattr(target, "config_class", Config), settings, config)
    if "run" in cfg and cfg.run.name is None:
        # named here, so the session knows the folder the run writes
        cfg.run.name = new_run_name()
        settings.append(f"run.name={cfg.run.name}")
    folder = tempfile.mkdtemp(prefix="ddplab-run-")
    try:
        payload = os.path.join(folder, "target" + PAYLOAD_SUFFIX)
        _write_payload(target, name, payload, cloudpickle)
        returned = os.path.join(folder, "returned.pkl")
        cmd = [sys.executable, "-m", "ddplab", "run", f"{payload}:{name}", "-n", str(n), *launch, *settings]
        cmd += ["--config", os.path.abspath(config)] if config else []
        _stream(cmd, _worker_env(returned), name)
        return RunResult(*_outcome(target, cfg), returned=_load(returned))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# the launcher's flags that say how many processes a node starts
PROCESS_COUNT = ("-n", "--nproc-per-node", "--nproc_per_node")


def _check_one_count(n: int, launch: list[str]) -> None:
    """`n` is the number of processes: a count in `launch` too would silently win over it."""
    for i, flag in enumerate(launch):
        name, _, value = flag.partition("=")
        if name in PROCESS_COUNT:
            value = value or (launch[i + 1] if i + 1 < len(launch) else "")
            raise DdplabError(
                f"n={n} and launch's {name} {value} both give the number of processes",
                f"give it once, as n: ddplab.run(..., n={value or n}) without {name} in launch",
            )


def _write_payload(target, name: str, path: str, cloudpickle) -> None:
    try:
        data = _dumps(target, cloudpickle)
    except Exception as e:
        raise DdplabError(
            f"{name} cannot be sent to the worker processes: cloudpickle cannot pickle it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            "keep what cannot be pickled (open files, locks, connections) out of the class and the notebook names "
            "it uses; make it in build() instead",
        ) from None
    with open(path, "wb") as f:
        f.write(data)


def _dumps(target, cloudpickle) -> bytes:
    """`target` pickled by value, keeping `dataclasses.MISSING` the one object dataclasses compare
    with `is`. cloudpickle 3.1 copies it into every field of a dataclass it pickles by value (its
    issue 424), so a settings dataclass defined in a notebook or script (a ddplab.Config subclass)
    came back with every default 'missing' and failed in OmegaConf before training."""

    class Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if obj is dataclasses.MISSING:
                return _missing, ()
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer).dump(target)
    return buffer.getvalue()


def _missing():
    """dataclasses.MISSING itself, where an unpickled field refers to it (found by name: _dumps)."""
    return dataclasses.MISSING


def _worker_env(returned: str) -> dict[str, str]:
    """The session's environment, its import path (modules the class imports by name), where rank 0
    leaves a function's return value, and the session's name for its classes (a run trained in the
    session itself is the same experiment's)."""
    from ..train.rundir import main_module_name

    paths = [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
    known = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([*paths, *filter(None, known.split(os.pathsep))])),
        environment.RETURNED: returned,
        environment.SESSION_MAIN: main_module_name(),
    }


def _stream(cmd: list[str], env: dict[str, str], name: str) -> None:
    """Run the launcher, its output copied into this session's as it comes (carriage returns too,
    so the progress bar redraws in place); a KeyboardInterrupt stops the run and ends its workers."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    # the last "ddplab: error: ..." line the run printed, held back from the copy: the session's error
    said = LastError()
    readers = [
        threading.Thread(target=_copy, args=(proc.stdout, sys.stdout, None), daemon=True),
        threading.Thread(target=_copy, args=(proc.stderr, sys.stderr, said), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        for reader in readers:
            reader.join(timeout=5)
        raise
    for reader in readers:
        reader.join(timeout=5)
    if code:
        if said.line is None:
            raise LaunchError(f"the run of {name} failed (exit code {code})", "its output above says why")
        raise LaunchError(said.line.removeprefix(ERROR_LINE).rstrip())
    # a run that ended well raises nothing: an error line held back belongs in its output
    _release(said, sys.stderr)


ERROR_LINE = "ddplab: error: "


class LastError:
    """The last "ddplab: error:" line a run printed, and whether it was copied into the output."""

    def __init__(self):
        self.line: str | None = None
        self.shown = True


def _copy(pipe, out, said: LastError | None) -> None:
    """Copy a pipe's text as it comes. With `said`, its last "ddplab: error:" line is kept there and
    held back while nothing follows it: the session raises it, and a cell would show it twice if it
    were copied too (anything after it, a line or a bar, copies it first, in order). Only the line
    being written is held, and only while it may still become such a line: a progress bar redraws
    with carriage returns, never ending a line, and is copied as it comes."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    line, holding = "", said is not None
    while chunk := os.read(pipe.fileno(), 65536):
        if said is None:
            out.write(decoder.decode(chunk))
            out.flush()
            continue
        # a line ends with \n, \r\n, or \r (a progress bar's redraw)
        for piece in re.split(r"(\r\n|[\r\n])", decoder.decode(chunk)):
            if not piece:
                continue
            if piece not in ("\r\n", "\r", "\n"):
                line += piece
                if holding and (line.startswith(ERROR_LINE) or ERROR_LINE.startswith(line)):
                    continue
                _release(said, out)
                out.write(line if holding else piece)
                holding = False
            elif holding and line.startswith(ERROR_LINE):
                _release(said, out)
                said.line, said.shown = line, False
                line = ""
            else:
                _release(said, out)
                out.write((line if holding else "") + piece)
                line, holding = "", True
        out.flush()
    if said is not None and line.startswith(ERROR_LINE):
        _release(said, out)
        said.line, said.shown = line, False
    elif said is not None and line and holding:
        _release(said, out)
        out.write(line)
    out.flush()


def _release(said: LastError, out) -> None:
    """Copy the held error line: something came after it."""
    if not said.shown:
        out.write(said.line + "\n")
        said.shown = True


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the launcher and its workers (they save and stop, exit 143), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def _outcome(target, cfg) -> tuple[str | None, dict[str, float]]:
    """The run folder and its last evaluation, as summary.json records them."""
    from ..experiment import experiment_folder
    from ..train.rundir import read_json

    if not isinstance(target, type) or "run" not in cfg:
        return None, {}
    run_dir = os.path.abspath(os.path.join(cfg.run.dir, experiment_folder(target), cfg.run.name))
    return run_dir, read_json(os.path.join(run_dir, "summary.json")).get("last_eval") or {}


def _load(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def leave_returned(value: Any) -> None:
    """In rank 0 of a run from a session: a function's return value, for the session."""
    if path := os.environ.get(environment.RETURNED):
        import cloudpickle

        with open(path, "wb") as f:
            cloudpickle.dump(value, f)


def session_call(args: list[str]) -> str:
    """The ddplab.run call that continues a run from the launcher's arguments ('run' PAYLOAD:Name -n N
    [launch flags] key=value... [--config PATH]), as the session would write it."""
    name = args[1].rpartition(":")[2]
    n = args[args.index("-n") + 1] if "-n" in args else "1"
    overrides = [a for a in args[2:] if "=" in a and not a.startswith("-")]
    config = f", config={args[args.index('--config') + 1]!r}" if "--config" in args else ""
    return f"ddplab.run({name}, n={n}, overrides={overrides!r}{config})"
