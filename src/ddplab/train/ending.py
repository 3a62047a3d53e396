"""The end of a run, after its last step and checkpoint: the experiment's on_fit_end, the export of
final/, the summary. A failure here must not pass for a killed run.

Training is over and its last checkpoint committed when this part starts, so resuming cannot help:
what helps is to fix the part that failed and run the same command again. That command resumes at
the last step, trains nothing (the run is at its length), and does this part again. So a failure
here is one line that names the part and says so, and `RUN/end_failed.json` records it for
`ddplab runs` ("failed at the end (on_fit_end)", never "killed (resumable)") until a later attempt
gets through; rank 0 removes the record as that attempt starts its end."""

import contextlib
import json
import os
import sys
import traceback

import torch.distributed as dist

from ..distributed import hangs
from ..errors import DdplabError
from .rundir import read_json

RECORD = "end_failed.json"


class EndOfRunError(DdplabError):
    """on_fit_end or the export failed after training finished."""


class RunEnd:
    """The end of one attempt of a run: its parts, each named when it fails."""

    def __init__(self, run_dir: str, step: int, saved_at: int, rank: int):
        self.run_dir = run_dir
        self.step = step
        self.saved_at = saved_at
        self.rank = rank
        if rank == 0:
            # before any rank starts this end (a collective follows): a failure now is this attempt's
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(run_dir, RECORD))

    @contextlib.contextmanager
    def part(self, name: str):
        """Run the block as the part `name`; its failure becomes one line naming the part and what to do,
        recorded for the run. The user's own code (on_fit_end) keeps its traceback above that line."""
        try:
            yield
        except DdplabError as e:
            self._fail(name, e.cause, e.fix)
        except Exception as e:
            if isinstance(e, dist.DistError) or hangs.is_peer_lost(e):
                # a collective that failed: the hang diagnosis names it (launch/worker.py)
                raise
            if name == "on_fit_end":
                traceback.print_exc()
                sys.stderr.flush()
            self._fail(name, f"{type(e).__name__}: {e}".strip().splitlines()[0], None)

    def _fail(self, part: str, cause: str, fix: str | None) -> None:
        with open(os.path.join(self.run_dir, RECORD), "w") as f:
            json.dump({"part": part, "rank": self.rank, "step": self.step, "error": cause}, f)
        kept = (
            f"the checkpoint of step {self.step} is complete"
            if self.saved_at == self.step
            else "with checkpoint.at_end=false a rerun resumes from the last checkpoint"
        )
        what = "the export of final/" if part == "export" else part
        raise EndOfRunError(
            f"{what} failed on rank {self.rank} after training finished at step {self.step} ({cause}); {kept}",
            f"{fix + ', then run' if fix else 'fix it and run'} the same command again: it trains no further and "
            f"redoes only the end of the run",
        ) from None


def failed_part(run_dir: str) -> str | None:
    """The part whose failure the run's last attempt recorded (on_fit_end, export), or None."""
    return read_json(os.path.join(run_dir, RECORD)).get("part")
