"""A failed job in one line: the rank whose failure caused the others, and what it said.

torch's agent reports the workers that failed, each with its exit code and the error it recorded;
the first to fail is rarely the lowest rank, and the others fail because of it (they lose contact,
or the agent stops them). This names the cause."""

import contextlib
import os
import signal
import sys

from ..errors import PEER_LOST_EXIT_CODE, USER_ERROR_EXIT_CODE, USER_ERROR_RECORD


def report(e) -> int:
    """One line for the whole job: a user error's own message, where to find a bug's traceback, or, where
    the failing rank could print nothing (killed by SIGKILL, or it only lost contact), where to look."""
    rank, failure = root_cause(_with_peers_records(e.failures))
    message = _said(failure)
    if message.startswith(USER_ERROR_RECORD):
        # recorded by the worker, whatever its exit after that
        print(f"ddplab: error: {message[len(USER_ERROR_RECORD) :]} (rank {rank})", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    if failure.exitcode == PEER_LOST_EXIT_CODE:
        # every rank here that failed only lost a connection, and none recorded why: the cause printed
        # nothing on this node (a node that went down or off the network, a process killed from outside)
        said = (
            "lost contact with another rank (a connection closed or reset) and no rank here failed before it: "
            "the cause is on another node (see its output; a node that went down or lost its network prints "
            "nothing) or outside the job (a network fault, the out-of-memory killer: see dmesg)"
        )
    elif failure.exitcode == -signal.SIGKILL:
        said = (
            "was killed by signal SIGKILL first, which leaves a process no time to print anything: the "
            "out-of-memory killer (see dmesg) or a kill from outside the job"
        )
    elif failure.exitcode < 0:
        said = f"was killed by signal {failure.signal_name()} first; its own error is printed above."
    else:
        said = f"exited with code {failure.exitcode} first; its own error is printed above."
    print(f"ddplab: rank {rank} {said}", file=sys.stderr, flush=True)
    # the rank's own code; 1 for a signal or a lost contact
    return failure.exitcode if failure.exitcode > 0 and failure.exitcode != PEER_LOST_EXIT_CODE else 1


def _with_peers_records(failures: dict) -> dict:
    """The failures, with every rank of the same node and attempt that recorded an error. Workers forked
    from the fork server are reported one failure at a time (the first to exit, as torch's agent
    stops the others); the others' records lie beside its own: <attempt>/<local rank>/error.json.
    A rank that recorded an error exited with 1 (worker.py), or with the user-error code its record names."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    every = dict(failures)
    for rank, failure in failures.items():
        attempt = os.path.dirname(os.path.dirname(failure.error_file))
        with contextlib.suppress(OSError), os.scandir(attempt) as entries:
            for entry in entries:
                record = os.path.join(entry.path, "error.json")
                peer = rank - failure.local_rank + int(entry.name) if entry.name.isdigit() else None
                if peer is not None and peer not in every and os.path.isfile(record):
                    every[peer] = ProcessFailure(int(entry.name), pid=-1, exitcode=1, error_file=record)
    return every


def _said(failure) -> str:
    """What a failed rank recorded (torch keeps it with a call stack and a timestamp beside it)."""
    return failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)


def root_cause(failures: dict) -> tuple[int, object]:
    """The rank whose failure caused the others: the first to record an error, else one killed by a
    signal other than the SIGTERM the agent sends survivors, else one that failed otherwise than by
    losing contact (such a rank records nothing and exits PEER_LOST_EXIT_CODE). Records are ordered
    by their files' times, to the nanosecond: torch's own timestamps are whole seconds, and a
    consequence recorded in the same second (a DataLoader worker that died as the job was torn down)
    must not be named before its cause. The same error recorded by several ranks is named as the
    lowest rank's."""
    recorded = {r: f for r, f in failures.items() if os.path.isfile(f.error_file)}
    if recorded:
        first = min(recorded, key=lambda r: (os.stat(recorded[r].error_file).st_mtime_ns, r))
        rank = min(r for r, f in recorded.items() if _said(f) == _said(recorded[first]))
        return rank, recorded[rank]
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    own = {r: f for r, f in failures.items() if f.exitcode not in (PEER_LOST_EXIT_CODE, -signal.SIGTERM)}
    lost = {r: f for r, f in failures.items() if f.exitcode == PEER_LOST_EXIT_CODE}
    pool = killed or own or lost or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, pool[r].exitcode < 0, r))
    return rank, pool[rank]
