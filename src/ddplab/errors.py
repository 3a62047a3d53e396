"""User-facing errors. A `DdplabError` is a mistake the user can fix (bad config, a busy port, a missing
file): one line, cause then fix, exit 2, no traceback to bury that sentence. Anything else is a bug and
keeps its traceback."""

USER_ERROR_EXIT_CODE = 2
# A worker of ddplab's launcher whose collective failed only because another rank's connection closed
# or reset: it prints nothing (the cause is elsewhere) and exits with this code (sysexits' EX_TEMPFAIL),
# so the launcher can tell "lost contact" from a failure of its own when no rank recorded one.
PEER_LOST_EXIT_CODE = 75
# how torch's error file starts for one (type name, then message)
USER_ERROR_RECORD = "DdplabError: "


class PeerFailed(BaseException):
    """Another worker of this job failed, and torch's agent is ending the others: raised in a worker
    by that SIGTERM (train/signals.py), wherever it was, instead of a save at the next step that
    could only wait for the lost peer. A BaseException, as KeyboardInterrupt is: the experiment's
    own `except Exception` must not keep a worker of an ended job running."""


class DdplabError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""

    def __init__(self, cause: str, fix: str | None = None):
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}; {fix}" if fix else cause)

    def _render_traceback_(self) -> list[str]:
        """How IPython shows it in a notebook: the one line, as the command line prints it."""
        return [f"ddplab: error: {self}"]


class ConfigError(DdplabError):
    """A config key or value that cannot be used."""


class LaunchError(DdplabError):
    """The processes could not be started or could not find each other."""


class PortInUse(LaunchError):
    """A rendezvous port that another process already holds."""

    def __init__(self, port: int, setting: str):
        super().__init__(
            f"port {port} is already in use on this machine",
            f"pass another {setting} (the same on every rank), or leave it unset so ddplab picks a free one",
        )
