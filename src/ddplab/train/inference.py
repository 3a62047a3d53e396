"""`ddplab eval` and `ddplab predict`: a checkpoint's networks, evaluated or run over new data.

Nothing is trained: the experiment's build() makes the bare networks (no DDP, no compile), the
checkpoint's weights are loaded, and every rank takes part in the exact evaluation or prediction,
whatever the number of ranks. The files they write are tools/outputs.py's."""

from torch.utils.data import IterableDataset

from .capability import weights_for
from .data import plan_batches, sized
from .evaluation import dataset_outputs


def evaluate_checkpoint(trainer, path: str, only: str | None = None) -> dict[str, float]:
    """The metrics of every eval set (or the one named `only`) on the weights of checkpoint `path`."""
    trainer.load_for_inference(path)
    trainer.read_eval_sets(only, needed=True)
    return trainer.compute_evaluation()


def predict_checkpoint(trainer, path: str, source: str) -> dict:
    """predict_step's outputs for every sample of predict_dataset(source), in order, on every rank."""
    exp = trainer.exp
    saved = trainer.load_for_inference(path)
    dataset = exp.predict_dataset(source)
    if not isinstance(dataset, IterableDataset):
        sized(dataset, f"{type(exp).__name__}.predict_dataset({source!r})")
    # the micro-batch the run trained with, whatever -n is now: the same batches give the same numbers
    sampler = saved["sampler"]
    settings = trainer.settings
    # the plan in force when it was saved (older checkpoints: the one the settings give for that run)
    accumulate = sampler.get("accumulate")
    if accumulate is None:
        plan = plan_batches(
            sampler["global_batch"], saved["world_size"], settings.accumulate, settings.micro_batch_size
        )
        accumulate = plan.accumulate
    trained = sampler["global_batch"] // (saved["world_size"] * accumulate)
    batch_size = settings.eval_batch_size or max(1, trained)
    parts = trainer.parts
    with weights_for(trainer.capabilities, "evaluate"):
        return dataset_outputs(
            exp, dataset, parts.models, parts.precision, batch_size, exp.predict_step, whole_batches=True
        )
