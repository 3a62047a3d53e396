"""The last evaluation, a small record a run keeps in its checkpoints (entry "eval_metrics").

It saves and loads itself (`state_dict` / `load_state_dict`), like every other entry of the
training state (checkpoint/state.py)."""


class LastEvaluation:
    """The metrics of the latest evaluation and the step they belong to."""

    def __init__(self):
        self.metrics: dict[str, float] = {}
        # -1: no evaluation in this process yet (a resumed run has the checkpoint's metrics, not their step)
        self.step = -1

    def record(self, metrics: dict[str, float], step: int) -> None:
        self.metrics = metrics
        self.step = step

    def state_dict(self) -> dict[str, float]:
        return dict(self.metrics)

    def load_state_dict(self, saved: dict[str, float] | None) -> None:
        self.metrics = dict(saved or {})
