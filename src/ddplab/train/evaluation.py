"""Exact distributed evaluation: every sample once, metrics equal to the single-process values.

Each rank evaluates a contiguous, unpadded shard (data.eval_shard) on the bare networks; outputs gathered
in rank order (dataset order) reach `evaluation_metrics` on every rank."""

import itertools
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils.data import Dataset, IterableDataset

from ..distributed import collectives, fsdp
from ..errors import ConfigError
from .data import CheckedCollate, eval_loader, sized
from .returns import per_sample
from .sources import to_device


def evaluate_dataset(exp, dataset: Dataset, models: dict, precision, batch_size: int) -> dict[str, float]:
    """The metrics of `dataset` (a collective: every rank must call it)."""
    outputs = dataset_outputs(exp, dataset, models, precision, batch_size, exp.evaluation_step)
    return exp.evaluation_metrics(outputs) if outputs else {}


def evaluate_sets(exp, sets, models: dict, precision, batch_size: int) -> dict[str, float]:
    """The metrics of one dataset, or of each of a dict of them as '<name>/<metric>' (None: none)."""
    if not isinstance(sets, dict):
        sets = {} if sets is None else {"": sets}
    metrics = {}
    for name, dataset in sets.items():
        for key, value in evaluate_dataset(exp, dataset, models, precision, batch_size).items():
            metrics[f"{name}/{key}" if name else key] = value
    return metrics


def read_eval_sets(exp, only: str | None = None, needed: bool = False):
    """eval_dataset(): none, one, or {name: dataset}, each sized and not empty; `only`: just that one.
    `needed`: an evaluation of a checkpoint, where a missing eval set is an error."""
    what = f"{type(exp).__name__}.eval_dataset()"
    found = exp.eval_dataset()
    sets = found if isinstance(found, dict) else {"": found}
    if not sets:
        raise ConfigError(f"{what} returned an empty dict", "return at least one eval set")
    if only and only not in sets:
        if list(sets) == [""]:
            raise ConfigError(f"{what} has one eval set, unnamed, so there is no set {only!r}", "leave out --set")
        names = ", ".join(repr(name) for name in sets if name)
        raise ConfigError(
            f"{what} has no eval set {only!r} (it has {names})", "name one of its sets (ddplab eval --set NAME)"
        )
    for name, data in sets.items():
        if (data is not None or needed) and not isinstance(data, IterableDataset):
            sized(data, what + (f"[{name!r}]" if name else ""))
    return {only: sets[only]} if only else found


def check_monitors(metrics: dict[str, float], monitors: dict[str, str]) -> None:
    """A monitored metric (setting -> metric name) that the evaluation does not return would never
    rank a checkpoint or stop a run: refused in one line."""
    for key, monitor in monitors.items():
        if monitor and monitor not in metrics:
            returned = ", ".join(sorted(metrics)) or "none"
            raise ConfigError(
                f"{key}={monitor!r} is not a metric the evaluation returns (it returns {returned})",
                f"pass {key}=<one of those>",
            )


@torch.no_grad()
def dataset_outputs(
    exp, dataset: Dataset, models: dict, precision, batch_size: int, step, whole_batches: bool = False
) -> dict[str, torch.Tensor]:
    """`step`'s per-sample outputs (evaluation_step, or predict_step) for every sample of `dataset`, in
    dataset order, on every rank. `whole_batches`: shards of whole batches, so each batch holds the
    same samples at any world size and so gives the same numbers (`ddplab predict`)."""
    rt = exp.rt
    name = step.__name__
    stream = isinstance(dataset, IterableDataset)
    if stream:
        loader = StreamShard(dataset, batch_size, rt.rank, rt.world_size, exp.collate_fn)
    else:
        loader = eval_loader(
            dataset,
            batch_size,
            rt.rank,
            rt.world_size,
            exp.collate_fn,
            exp.cfg.trainer.num_workers,
            exp.device.type == "cuda",
            batch_size if whole_batches else 1,
        )
    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    with unwrapped(exp, models):
        for batch in loader:
            with precision.autocast():
                out = per_sample(step(to_device(batch, exp.device)), name)
            for key, value in out.items():
                parts[key].append(value.detach())
    outputs = gather_outputs({k: torch.cat(v) for k, v in parts.items()}, exp.device, name)
    rows = {k: len(v) for k, v in outputs.items()}
    samples = loader.n if stream else len(dataset)
    if any(n != samples for n in rows.values()):
        # the same on every rank: all raise
        raise ConfigError(
            f"{name} must return one row per sample: it gave {rows} rows for {samples} samples",
            "return per-sample values, e.g. F.mse_loss(..., reduction='none')",
        )
    if not stream:
        return outputs
    # rank-order rows back to stream order, once
    order = loader.order().to(exp.device)
    return {key: value[order] for key, value in outputs.items()}


class StreamShard:
    """An IterableDataset, read whole by every rank, which keeps batches rank, rank + W, ...; see order()."""

    def __init__(self, dataset: IterableDataset, batch_size: int, rank: int, world_size: int, collate_fn):
        self.dataset = dataset
        self.size = batch_size
        self.rank = rank
        self.world = world_size
        self.collate = collate_fn
        # samples in the stream, known once it is read
        self.n = 0

    def __iter__(self):
        stream = iter(self.dataset)
        self.n = 0
        collate = CheckedCollate(self.collate)
        for b, batch in enumerate(iter(lambda: list(itertools.islice(stream, self.size)), [])):
            self.n += len(batch)
            if b % self.world == self.rank:
                yield collate(batch)

    def order(self) -> torch.Tensor:
        """The permutation from rank-order rows (each rank's batches, rank after rank) to stream order."""
        batches = -(-self.n // self.size)
        starts = [b * self.size for r in range(self.world) for b in range(r, batches, self.world)]
        return torch.argsort(torch.cat([torch.arange(s, min(s + self.size, self.n)) for s in starts]))


def gather_outputs(local: dict[str, torch.Tensor], device: torch.device, name: str) -> dict[str, torch.Tensor]:
    """Concatenate every rank's outputs in rank order, i.e. dataset order. A rank whose shard
    is empty learns the output names, dtypes and shapes from rank 0."""
    layout = collectives.broadcast_object({k: (v.dtype, tuple(v.shape[1:])) for k, v in local.items()})
    differs = bool(local) and {k: (v.dtype, tuple(v.shape[1:])) for k, v in local.items()} != layout
    if collectives.max(torch.tensor(float(differs), device=device)).item():
        # every rank raises, none hangs
        raise ConfigError(
            f"{name} returned other keys, dtypes or shapes on some ranks than on rank 0",
            "return the same keys with the same dtype and per-sample shape on every rank",
        )
    empty = {k: torch.empty((0, *tail), dtype=dtype, device=device) for k, (dtype, tail) in layout.items()}
    return {k: collectives.gather_concat(local.get(k, empty[k])) for k in sorted(layout)}


@contextmanager
def unwrapped(exp, models: dict):
    """Evaluate on the bare networks: DDP's forward may broadcast buffers, a collective that
    would hang when ranks have different numbers of eval batches (FSDP's gathers its units: they are
    gathered once, before)."""
    wrapped = {name: getattr(exp, name) for name in models}
    try:
        for name, model in models.items():
            setattr(exp, name, model)
            model.eval()
        # sharded networks (dist.strategy=fsdp) whole for the evaluation, on every rank
        with fsdp.gathered(list(models.values())):
            yield
    finally:
        for name, model in wrapped.items():
            setattr(exp, name, model)
            model.train()
