"""Workers forked from a server that imported torch and ddplab once, instead of each importing them.

A worker started as `python -m ddplab.launch.worker` spends about 3 s of CPU importing torch and
ddplab before it runs a line of the experiment: on a machine with fewer cores than ranks, or in a job
that restarts its workers, that is most of the start. torch's elastic agent can start its workers
from Python's fork server instead (start method "forkserver", a function as entry point:
worker.run_forked): the server imports what every worker imports, once per launch, and each worker,
restarted ones too, is a fork of it.

A worker started by itself gets some things for free that a forked one is given here: the launcher's
environment as it is when the worker starts (`LaunchersEnvironment`), Python's default start method,
the defaults of the signals torch's agent handles, and death with the launcher (`become_worker`); an
exit as soon as it finished (`handed_in_return_value`). The launcher keeps the server alive through
stop signals sent to the whole job (`serving`) and passes its own on to the workers, not to Python's
helper processes (`helpers`, launch/stops.py). Where the launcher's `__main__` would be run again in
each worker (a user's unguarded script), the server cannot start, or `DDPLAB_FORK_SERVER=0`, each
worker starts as its own process (`usable`, `serving`)."""

import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver, resource_tracker

from .. import environment

# what every worker imports before its experiment's own modules: the worker, the training loop, the
# config, and torch's compiler front end (torch.optim imports it as the first optimizer is built).
# An ImportError in the server is left for the worker to raise.
PRELOAD = ["ddplab.launch.worker", "ddplab.experiment", "ddplab.train.loop", "omegaconf", "torch._dynamo"]


# the signals that stop a job (and end a process that does not handle them)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}
# a Unix socket's path holds at most 107 bytes, and the server's is "listener-" and 8 characters more
_SOCKET_FOLDER_MOST = 107 - len("/listener-12345678")


class LaunchersEnvironment:
    """The launcher's environment, taken when the agent starts a worker (its pickling) and made the
    worker's before the agent sets the rank's variables (its unpickling, in the worker)."""

    def __getstate__(self) -> dict:
        return dict(os.environ)

    def __setstate__(self, env: dict) -> None:
        os.environ.clear()
        os.environ.update(env)


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


@contextmanager
def serving(folder: str) -> Iterator[bool]:
    """Start the server for one launch where it is usable, and yield whether it runs. Each launch's server has the
    environment the launch started with (torch reads some variables as it is imported), and ends with
    the launch. Its socket goes in the launch's FOLDER, which goes with the launch even when the
    launcher is killed; where that path is too long for a socket, or the server cannot start, the
    workers start as their own processes."""
    # private, as the fork server's _stop below: both since Python 3.8
    config = getattr(multiprocessing.current_process(), "_config", None)
    before = None if config is None else config.get("tempdir")
    if not usable() or config is None or len(before or folder) > _SOCKET_FOLDER_MOST:
        yield False
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    config["tempdir"] = before or folder
    try:
        _start_resource_tracker()
        with _signals_held():
            forkserver.ensure_running()
        running = True
    except OSError:
        running = False
    try:
        yield running
    finally:
        stop = getattr(forkserver._forkserver, "_stop", None)
        if running and stop is not None:
            stop()
        config["tempdir"] = before


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


@contextmanager
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
