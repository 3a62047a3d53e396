"""The seam for training's optional capabilities: what the loop calls, when, and in which order.

A capability (the weights' moving average, out-of-memory backoff, early stopping with a sweep's
pruning, the profiler) is one class in one module: built from the settings it reads, handed the
trainer's parts it uses, keeping its own state in checkpoints under its `state_key`, and called by
the loop at the points below. The trainer holds them in one ordered list (`Trainer.capabilities`,
built in one method); the loop calls a hook on each of them in that order. Every hook does nothing
unless the capability overrides it, so a capability writes only the hooks it needs.

The points, in the order a step meets them (train/loop.py):

    before_training(step)      once, after a resume, before the first step
    step                       a capability may take the optimizer step in place of step.optimizer_step
    after_update()             right after the optimizer's update, every step
    after_evaluation(m, step)  every rank, after each evaluation, with its (global) metrics
    before_save()              every rank, before each checkpoint is written
    after_step(step)           once the step's log, evaluation, checkpoint and heartbeat are done
    stop_reason()              asked before each step: a reason ends training (summary.json's status)
    after_training(step)       once, when training has ended by itself (not by a signal or a failure)

Lightning's callbacks and torchtitan's components are the models: the order is the list's, nothing
registers itself."""

from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any


class Capability:
    # the entry a checkpoint keeps its state_dict() under; None: it keeps nothing
    state_key: str | None = None
    # its state belongs with the weights: `ddplab eval`/`predict` and a best checkpoint's weights load it too
    of_weights: bool = False
    # an optimizer step that replaces step.optimizer_step, called as step(parts, records, batches, accumulate)
    step: Callable | None = None

    def before_training(self, step: int) -> None:
        """Once, when training starts at `step` (after a resume: the checkpoint's step)."""

    def after_update(self) -> None:
        """Right after the optimizer's update, every step, before the step's log and evaluation."""

    def after_evaluation(self, metrics: dict[str, float], step: int) -> None:
        """Every rank, after each evaluation: `metrics` are the global ones, the same on every rank."""

    def before_save(self) -> None:
        """Every rank, before each checkpoint is written (a collective may run here)."""

    def after_step(self, step: int) -> None:
        """Once step `step`'s log, evaluation, checkpoint and heartbeat are done."""

    def stop_reason(self) -> str | None:
        """Why training stops before the next step ("stopped early"; summary.json's status), or None.
        The same on every rank: whatever decides it must be agreed."""
        return None

    def after_training(self, step: int) -> None:
        """Once, when training has ended at `step` by itself (its last step, or a stop_reason), before
        the last evaluation, checkpoint and export; not after a signal's stop or a failure."""

    def closing_line(self, step: int) -> str | None:
        """The line rank 0 prints when this capability stopped the run at `step`."""
        return None

    def weights(self, purpose: str):
        """A context in which the networks hold the weights used to `purpose` ("evaluate", "export")."""
        return nullcontext()

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, saved: Any) -> None:
        """`saved` is None when the checkpoint has no entry (a run without this capability)."""


@contextmanager
def weights_for(capabilities: list[Capability], purpose: str):
    """Every capability's weights for `purpose`, entered in the list's order and left in reverse."""
    with ExitStack() as stack:
        for capability in capabilities:
            stack.enter_context(capability.weights(purpose))
        yield


def stop_reason(capabilities: list[Capability]) -> str | None:
    """The first capability's reason to stop training, or None."""
    return next((reason for c in capabilities if (reason := c.stop_reason()) is not None), None)
