"""A launch's own folder in the temporary folder: removed when the launch ends, and by a later launch
when the one that made it was killed (SIGKILL, the out-of-memory killer) and could not remove it.

Each folder holds a lock (`flock`) for as long as the process that made it lives; the kernel lets go
of it when that process dies, however it dies. A launch that starts removes this user's folders of
ddplab's kinds whose lock it can take: nobody holds them any more. A folder without the lock file is
left alone (it is being made, or was made by another program)."""

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

from ..train.rundir import is_locked

# the name a run folder's lock has (train/rundir.py), whose check is used here
HELD = ".lock"
# a launch's (records, stop note), a one-process run's (stop note), live replicas' meeting place, the
# socket of a launcher's fork server (launch/fork_server.py)
PREFIXES = ("ddplab-launch-", "ddplab-stop-", "ddplab-replicas-", "ddplab-forks-")


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[str]:
    """A fresh folder named PREFIX* in the temporary folder, held while the block runs, removed after it."""
    folder, held = make_scratch(prefix)
    try:
        yield folder
    finally:
        remove_scratch(folder, held)


def make_scratch(prefix: str) -> tuple[str, int]:
    """A fresh folder named PREFIX* in the temporary folder, and the descriptor that holds it until
    remove_scratch(): for a folder that outlives a block (a kept fork server's)."""
    assert prefix in PREFIXES, prefix
    remove_abandoned()
    folder = tempfile.mkdtemp(prefix=prefix)
    # locked before it takes the name others look for; not inherited by the workers: a folder is
    # in use exactly while its launch lives
    held = os.open(os.path.join(folder, HELD + ".new"), os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    os.rename(os.path.join(folder, HELD + ".new"), os.path.join(folder, HELD))
    return folder, held


def remove_scratch(folder: str, held: int) -> None:
    os.close(held)
    shutil.rmtree(folder, ignore_errors=True)


def remove_abandoned() -> list[str]:
    """Remove this user's scratch folders whose maker died without removing them; returns their paths."""
    root = tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(PREFIXES) and _abandoned(entry):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def _abandoned(entry: os.DirEntry) -> bool:
    try:
        mine = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
    except OSError:
        return False
    return mine and os.path.isfile(os.path.join(entry.path, HELD)) and not is_locked(entry.path)
