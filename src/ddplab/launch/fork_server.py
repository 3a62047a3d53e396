"""Workers forked from a server that imported torch and ddplab once, instead of each importing them.

A worker started as `python -m ddplab.launch.worker` spends about 3 s of CPU importing torch and
ddplab before it runs a line of the experiment: on a machine with fewer cores than ranks, or in a job
that restarts its workers, that is most of the start. torch's elastic agent can start its workers
from Python's fork server instead (start method "forkserver", a function as entry point:
worker.run_forked): the server imports what every worker imports, once, and each worker, restarted
ones too, is a fork of it. A process that launches again (a script, a test suite) keeps its server
for the next launch while nothing the imports read has changed (`ready`).

A worker started by itself gets some things for free that a forked one is given here: the launcher's
environment and output as they are when the worker starts (`LaunchersEnvironment`),
Python's default start method, the defaults of the signals torch's agent handles, and death with the
launcher (`become_worker`); an exit as soon as it finished (`handed_in_return_value`). The launcher
keeps the server alive through stop signals sent to the whole job (`_signals_held`) and passes its
own on to the workers, not to Python's helper processes (`helpers`, launch/stops.py). Where the
launcher's `__main__` would be run again in each worker (a user's unguarded script), the server
cannot start, or `DDPLAB_FORK_SERVER=0`, each worker starts as its own process (`usable`, `ready`)."""

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import context, forkserver, resource_tracker

from .. import environment
from .scratch import make_scratch, remove_scratch

# what every worker imports before its experiment's own modules: the worker, the training loop, the
# config, and torch's compiler front end (torch.optim imports it as the first optimizer is built).
# An ImportError in the server is left for the worker to raise.
PRELOAD = ["ddplab.launch.worker", "ddplab.experiment", "ddplab.train.loop", "omegaconf", "torch._dynamo"]


# the signals that stop a job (and end a process that does not handle them)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}
# a Unix socket's path holds at most 107 bytes, and the server's is "listener-" and 8 characters more
_SOCKET_FOLDER_MOST = 107 - len("/listener-12345678")
# the name of the scratch folder (launch/scratch.py) that holds a server's socket
SCRATCH_PREFIX = "ddplab-forks-"


class LaunchersEnvironment:
    """The launcher's environment, taken when the agent starts a worker (its pickling) and made the
    worker's before the agent sets the rank's variables (its unpickling, in the worker): its
    variables, and where its output goes (descriptors 1 and 2, handed over with the worker's start:
    a server kept from an earlier launch still has that launch's). Its working folder and `sys.path`
    Python hands over itself, with every process it starts."""

    def __getstate__(self) -> dict:
        return {"environ": dict(os.environ), "output": _output_handed_over()}

    def __setstate__(self, state: dict) -> None:
        os.environ.clear()
        os.environ.update(state["environ"])
        for fd, handed in state["output"].items():
            received = handed.detach()
            os.dup2(received, fd)
            os.close(received)


def _output_handed_over() -> dict:
    """Descriptors 1 and 2 of the launcher, sent along with the worker being started (Python's
    fork server passes the descriptors a pickled object asks for); none outside such a start."""
    # private: the start under way, and its list of descriptors to send (since Python 3.4)
    popen = getattr(context, "get_spawning_popen", lambda: None)()
    if popen is None or not hasattr(popen, "duplicate_for_child"):
        return {}
    handed = {}
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.fstat(fd)
            handed[fd] = popen.DupFd(popen.duplicate_for_child(fd))
    return handed


def usable() -> bool:
    """Whether the workers can fork from the server: not where the user turned it off, and not where
    Python would run the launcher's main module again in each worker (a user's unguarded script)."""
    if os.environ.get(environment.FORK_SERVER, "1") == "0":
        return False
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        # `python -m pkg` runs pkg.__main__, which Python does not import again
        return name.endswith("__main__")
    path = getattr(main, "__file__", None)
    # a notebook or an interactive session has no file; ddplab's command line is the `ddplab` script
    return path is None or os.path.basename(path) == "ddplab"


def ready() -> bool:
    """Whether this launch's workers can fork from a server, started now or kept from an earlier
    launch of this process (a script or a test suite that launches more than once pays for the
    server's imports once; `ddplab run` and `ddplab.run` launch once per process). Where the
    socket's path would be too long, or the server cannot start, the workers start as their own
    processes."""
    # private, as the fork server's _stop below: both since Python 3.8
    config = getattr(multiprocessing.current_process(), "_config", None)
    if not usable() or config is None:
        return False
    kept = _server_for(_what_imports_read())
    if kept is None:
        return False
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    before = config.get("tempdir")
    config["tempdir"] = kept.folder
    try:
        _start_resource_tracker()
        with _signals_held():
            # starts one where none runs (or the kept one died), else returns at once
            forkserver.ensure_running()
        return True
    except OSError:
        _let_go()
        return False
    finally:
        config["tempdir"] = before


@dataclass
class _KeptServer:
    """The server this process started: what its imports may have read, and the scratch folder its
    socket lies in (launch/scratch.py: removed at exit, or by a later launch once this process died)."""

    started_with: tuple
    folder: str
    held: int
    # the process that started it: a child forked from that process (os.fork) inherits this record,
    # and its exit must neither stop the server nor remove the folder
    owner: int


# the server kept for this process's next launch; stopped at exit
_kept: _KeptServer | None = None
_stopped_at_exit = False


def _server_for(wanted: tuple) -> _KeptServer | None:
    """The kept server where its imports read what this launch's would (torch reads some variables
    as it is imported); else a new one's place, the old one stopped. None where the socket's path
    is too long, a server that cannot be stopped has other imports, or the server is a parent's."""
    global _kept, _stopped_at_exit
    if _kept is not None and _kept.owner != os.getpid():
        # a child forked from the process that keeps a server (os.fork) and now launches itself:
        # Python's fork server record still names the parent's server, which only the parent can
        # wait for; this child's workers start as their own processes
        return None
    if _kept is not None and _kept.started_with != wanted:
        if getattr(forkserver._forkserver, "_stop", None) is None:
            return None
        _let_go()
    if _kept is None:
        folder, held = make_scratch(SCRATCH_PREFIX)
        if len(folder) > _SOCKET_FOLDER_MOST:
            remove_scratch(folder, held)
            return None
        _kept = _KeptServer(wanted, folder, held, os.getpid())
        if not _stopped_at_exit:
            atexit.register(_let_go)
            _stopped_at_exit = True
    return _kept


# set by torch's elastic_launch at every launch, read by its agent as it runs: without it here, a
# process's second launch would find the environment changed by its first
_SET_BY_LAUNCHES = (environment.SIGNALS_TO_HANDLE,)


def _what_imports_read() -> tuple:
    """What the server's imports may have read: a server started with other values is not reused.
    ddplab's own variables (each launch's plan, its store's port) are read as its code runs, never as
    its modules are imported, and a worker has the launch's own (LaunchersEnvironment). `sys.path` is
    not among them: the modules the server imports, the launcher imported already from where they
    are, and Python gives each worker the launcher's `sys.path` as it is at the worker's start."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    variables = sorted(
        (k, v) for k, v in os.environ.items() if not k.startswith(environment.OWN_PREFIX) and k not in _SET_BY_LAUNCHES
    )
    return sys.executable, main, tuple(variables)


def _let_go() -> None:
    """Stop the kept server and remove its scratch folder (at exit, or for a server with other imports)."""
    global _kept
    if _kept is None or _kept.owner != os.getpid():
        # (in a child forked from the process that keeps it, the server and folder are not its own)
        _kept = None
        return
    stop = getattr(forkserver._forkserver, "_stop", None)
    # (a server that already ended cannot be waited for again)
    with contextlib.suppress(OSError):
        if stop is not None:
            stop()
    remove_scratch(_kept.folder, _kept.held)
    _kept = None


def _start_resource_tracker() -> None:
    """Python's process that removes the semaphores torch's agent makes for the forked workers, started
    here before the server (as the server would, it unblocks SIGTERM once it started). Where the launcher
    is killed by SIGKILL it removes them, and says nothing of it: that the launcher died is the news."""
    before = os.environ.get(environment.PYTHON_WARNINGS)
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    os.environ[environment.PYTHON_WARNINGS] = f"{before},{quiet}" if before else quiet
    try:
        resource_tracker.ensure_running()
    finally:
        if before is None:
            os.environ.pop(environment.PYTHON_WARNINGS)
        else:
            os.environ[environment.PYTHON_WARNINGS] = before


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """The server starts with the signals a job is stopped by blocked, and keeps them so: sent to
    the launch's whole process group (a notebook's interrupt, Slurm's scancel and --signal), they
    would end the server, and every worker with it before it could save (worker.py). Blocked, not
    ignored, for as long as the server starts: one that comes for the launcher meanwhile waits."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def helpers() -> tuple[int | None, set[int]]:
    """The fork server's process (None where none runs), and Python's helper processes of this
    launcher (the server, its resource tracker), which a signal meant for the workers must not reach:
    the tracker dies of SIGUSR1."""
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return server, {pid for pid in (server, tracker) if pid}


def parent_of(pid: int) -> int | None:
    """A process's parent, from /proc (None once it is gone): a forked worker's is the server, whose
    parent is the launcher."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the fields after the command's closing parenthesis: state, then the parent's pid
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def become_worker() -> None:
    """In a forked worker, before anything else: what a worker started by itself has, this one gets."""
    # Python made the server's start method this process's default; a DataLoader's workers, and any
    # process the experiment starts, start as they would in a worker started by itself
    multiprocessing.set_start_method(None, force=True)
    _signals_as_a_worker_started_by_itself()
    _let_go_of_the_server()


def _signals_as_a_worker_started_by_itself() -> None:
    """The server holds the stop signals back (they are this worker's to take), and it keeps what the
    launcher had when it started the server: a job started in the background by a shell (`cmd &`)
    ignores SIGINT and SIGQUIT. A worker the agent starts as its own process has the defaults for
    the signals the agent itself handles, and so does this one."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def _let_go_of_the_server() -> None:
    """Python hands each forked process the write end of the pipe whose closing ends the server, so
    that the server lives while any of them does. A worker must end with the launcher instead (it
    dies with its parent, the server: worker.py), so it closes its copy: the launcher's is then the
    last, and a launcher killed by SIGKILL takes the server and every worker with it."""
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


def handed_in_return_value() -> bool:
    """Torch's agent reads each finished worker's return value from a queue its wrapper `_wrap` fills
    after the function returns, and that wrapper then waits for every other worker to finish: a
    finished rank would stay, holding its connections (its peers would wait for a collective until
    the timeout, not fail at once) and its GPU memory. The value (None) goes in the same queue here,
    and the worker exits as one started by itself would; where the queue is not found (another torch)
    the worker returns and waits."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_wrap" and "ret_val_" in frame.f_locals):
        frame = frame.f_back
    if frame is None:
        return False
    # a SimpleQueue writes to its pipe as put() runs: nothing is left to send when the process ends
    frame.f_locals["ret_val_"].put(None)
    return True
