"""What a checkpoint of a training run holds: each named state object, in the order a resume loads
it (checkpoint/state.py saves and restores them; each one restores itself, or says why it cannot)."""

from ..checkpoint import state as checkpoint_state
from ..distributed.powersgd import PowerSGDStates
from .capability import Capability
from .components import TrainingParts
from .progress import TrainProgress
from .records import LastEvaluation


def checkpointed(
    parts: TrainingParts,
    capabilities: list[Capability],
    progress: TrainProgress,
    evaluation: LastEvaluation,
    data,
    plan,
    exp,
) -> dict[str, checkpoint_state.Stateful]:
    """The state objects of a training run, by name: `parts` (what build() made), the capabilities'
    own entries, the position (`progress`, `data`: train/sources.py's TrainData; `plan`, the batch plan),
    the last evaluation and the experiment's own state."""
    rank, world_size, seed = exp.rt.rank, exp.rt.world_size, int(exp.cfg.seed)
    state = {"models": checkpoint_state.Networks(parts.models)}
    state["optimizers"] = checkpoint_state.Optimizers(parts.optimizers, parts.schedulers)
    state["schedulers"] = checkpoint_state.StateList("scheduler", parts.schedulers)
    state["scaler"] = parts.precision
    state["comm_hooks"] = PowerSGDStates(parts.hook_states, rank, world_size)
    state["sampler"] = checkpoint_state.DataOrder(progress, seed, plan)
    state["progress"] = progress
    state["eval_metrics"] = evaluation
    # after progress: a mid-epoch resume of data without a length continues from progress's step
    state["data"] = data
    # the experiment's own, saved per rank under experiment.<name>
    for name, obj in exp.checkpoint_state().items():
        state[f"experiment.{name}"] = checkpoint_state.PerRank(obj, rank, world_size)
    # after the networks: an average a checkpoint lacks starts from the loaded weights
    for capability in capabilities:
        if capability.state_key is not None:
            state[capability.state_key] = capability
    # last: nothing after it may draw a random number
    state["rng"] = checkpoint_state.RandomStreams(seed, rank, world_size, progress)
    return state
