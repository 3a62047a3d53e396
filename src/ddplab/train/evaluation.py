"""Exact distributed evaluation: every sample once, metrics equal to the single-process values.

Each rank evaluates a contiguous, unpadded shard of the set (data.eval_shard), on the bare
networks; the per-sample outputs of every rank are gathered in rank order, which is dataset
order, and the experiment's `evaluation_metrics` sees all of them on every rank."""

from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils.data import Dataset

from ..distributed import collectives
from ..errors import ConfigError
from .data import eval_loader
from .step import to_device


def evaluate_dataset(exp, dataset: Dataset, models: dict, precision, batch_size: int) -> dict[str, float]:
    """The metrics of `dataset` (a collective: every rank must call it)."""
    outputs = dataset_outputs(exp, dataset, models, precision, batch_size, exp.evaluation_step)
    return exp.evaluation_metrics(outputs) if outputs else {}


@torch.no_grad()
def dataset_outputs(exp, dataset: Dataset, models: dict, precision, batch_size: int, step,
                    whole_batches: bool = False) -> dict[str, torch.Tensor]:
    """`step`'s per-sample outputs (evaluation_step, or predict_step) for every sample of `dataset`, in
    dataset order, on every rank. `whole_batches`: shards of whole batches, so each batch holds the
    same samples at any world size and so gives the same numbers (`ddplab predict`)."""
    rt, settings, name = exp.rt, exp.cfg.trainer, step.__name__
    loader = eval_loader(dataset, batch_size, rt.rank, rt.world_size, exp.collate_fn, settings.num_workers,
                         exp.device.type == "cuda", batch_size if whole_batches else 1)
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    with unwrapped(exp, models):
        for batch in loader:
            with precision.autocast():
                out = step(to_device(batch, exp.device))
            if not (isinstance(out, dict) and out and all(torch.is_tensor(v) and v.ndim for v in out.values())):
                raise ConfigError(f"{name} returned {out!r:.90}, not a dict of per-sample tensors",
                                  "return e.g. {'loss': F.mse_loss(pred, y, reduction='none')}, one row per sample")
            for key, value in out.items():
                parts[key].append(value.detach())
    outputs = gather_outputs({k: torch.cat(v) for k, v in parts.items()}, exp.device, name)
    rows = {k: len(v) for k, v in outputs.items()}
    if any(n != len(dataset) for n in rows.values()):  # the same on every rank: all raise
        raise ConfigError(f"{name} must return one row per sample: it gave {rows} rows for {len(dataset)} "
                          "samples", "return per-sample values, e.g. F.mse_loss(..., reduction='none')")
    return outputs


def gather_outputs(local: dict[str, torch.Tensor], device: torch.device, name: str) -> dict[str, torch.Tensor]:
    """Concatenate every rank's outputs in rank order, i.e. dataset order. A rank whose shard
    is empty learns the output names, dtypes and shapes from rank 0."""
    layout = collectives.broadcast_object({k: (v.dtype, tuple(v.shape[1:])) for k, v in local.items()})
    differs = bool(local) and {k: (v.dtype, tuple(v.shape[1:])) for k, v in local.items()} != layout
    if collectives.max(torch.tensor(float(differs), device=device)).item():  # every rank raises, none hangs
        raise ConfigError(f"{name} returned other keys, dtypes or shapes on some ranks than on rank 0",
                          "return the same keys with the same dtype and per-sample shape on every rank")
    empty = {k: torch.empty((0, *tail), dtype=dtype, device=device) for k, (dtype, tail) in layout.items()}
    return {k: collectives.gather_concat(local.get(k, empty[k])) for k in sorted(layout)}


@contextmanager
def unwrapped(exp, models: dict):
    """Evaluate on the bare networks: DDP's forward may broadcast buffers, a collective that
    would hang when ranks have different numbers of eval batches."""
    wrapped = {name: getattr(exp, name) for name in models}
    try:
        for name, model in models.items():
            setattr(exp, name, model)
            model.eval()
        yield
    finally:
        for name, model in wrapped.items():
            setattr(exp, name, model)
            model.train()
