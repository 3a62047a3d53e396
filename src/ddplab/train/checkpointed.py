"""What a checkpoint of a training run holds: each named state object, in the order a resume loads
it (checkpoint/state.py saves and restores them; each one restores itself, or says why it cannot)."""

from ..checkpoint import state as checkpoint_state
from ..distributed.powersgd import PowerSGDStates


def checkpointed(loop) -> dict[str, checkpoint_state.Stateful]:
    """The state objects of a Trainer (train/loop.py) that has been set up, by name."""
    state = {"models": checkpoint_state.Networks(loop.models)}
    if loop.ema is not None:
        state["ema"] = loop.ema
    state["optimizers"] = checkpoint_state.Optimizers(loop.optimizers, loop.schedulers)
    state["schedulers"] = checkpoint_state.StateList("scheduler", loop.schedulers)
    state["scaler"] = loop.precision
    state["comm_hooks"] = PowerSGDStates(loop.hook_states, loop.rt.rank, loop.rt.world_size)
    state["sampler"] = checkpoint_state.DataOrder(loop.progress, int(loop.cfg.seed), loop.plan)
    if loop.backoff:
        state["oom_backoff"] = loop.backoff
    state["progress"] = loop.progress
    state["eval_metrics"] = loop.evaluation
    state["early_stop"] = loop.early_stop
    # after progress: a mid-epoch resume of data without a length continues from progress's step
    state["data"] = loop.data
    # the experiment's own, saved per rank under experiment.<name>
    for name, obj in loop.exp.checkpoint_state().items():
        state[f"experiment.{name}"] = checkpoint_state.PerRank(obj, loop.rt.rank, loop.rt.world_size)
    state["rng"] = checkpoint_state.RandomStreams(int(loop.cfg.seed), loop.rt.rank, loop.rt.world_size, loop.progress)
    return state
