"""Where each epoch's batches come from: a Dataset (data.py's order), an IterableDataset, or an own loader.

Every rank reads an IterableDataset whole (as Accelerate's IterableDatasetShard) and keeps its share of each
global batch: the stream's batches at any world size. An own loader (`train_loader()`) yields this rank's
micro-batches. Neither has a known length, so before each step the ranks agree that each has a whole step
(one small all_gather). A resume restores the source's state_dict(), else reads and drops what was trained on."""

import collections, itertools

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.data import IterableDataset

from ..distributed import collectives
from ..errors import ConfigError
from .data import CheckedCollate, sized, steps_per_epoch, train_loader


def has_state(source) -> bool:
    """The state_dict() / load_state_dict() protocol (torchdata's StatefulDataLoader, HF IterableDataset)."""
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))


def to_device(batch, device: torch.device):
    """Tensors in nested lists/tuples/dicts/namedtuples to the device (non-blocking from pinned memory)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


class TrainData:
    """The training data of one run: its kind, steps per epoch (None: unknown), batches, and resume state."""

    def __init__(self, exp, plan):
        self.exp, self.plan, self.restored, name, self.loader = exp, plan, False, type(exp).__name__, exp.train_loader()
        self.dataset = exp.train_dataset() if self.loader is None else None
        self.kind = "own" if self.loader is not None else "stream" if isinstance(self.dataset, IterableDataset) else "map"
        self.what = f"{name}.train_loader()" if self.kind == "own" else f"{name}.train_dataset()"
        self.steps = steps_per_epoch(sized(self.dataset, self.what), plan.global_batch) if self.kind == "map" else None
        self.stream = RankStream(self.dataset, plan, exp.rt.rank, exp.collate_fn) if self.kind == "stream" else None
        self.source = self.loader if self.kind == "own" else self.dataset

    def epoch(self, epoch: int, start_step: int):
        """The batches of `epoch` from its step `start_step`: `has_step()` before each step, then next()."""
        rt, s, exp = self.exp.rt, self.exp.trainer.settings, self.exp
        if self.kind == "map":
            return CountedSteps(train_loader(self.dataset, self.plan, rt.rank, exp.cfg.seed, epoch, start_step,
                                             exp.collate_fn, s.num_workers, exp.device.type == "cuda"), self.steps,
                                exp.device)
        skip, self.restored = 0 if self.restored else start_step, False
        if self.kind == "stream":
            return AgreedSteps(self.stream.epoch(epoch, skip), self.plan.accumulate, exp.device, self.what,
                               lambda: self.stream.read)
        if callable(set_epoch := getattr(getattr(self.loader, "sampler", None), "set_epoch", None)):
            set_epoch(epoch)  # a DistributedSampler's shuffle follows the epoch
        batches = itertools.islice(self.loader, skip * self.plan.accumulate, None)  # replayed, not trained on
        return AgreedSteps(batches, self.plan.accumulate, exp.device, self.what)

    def state(self) -> list:
        """Every rank's state_dict() of the source, for the checkpoint (a collective)."""
        mine = self.source.state_dict() if self.kind != "map" and has_state(self.source) else None
        return collectives.gather_object(mine)

    def restore(self, saved: list | None, progress) -> str | None:
        """Continue mid-epoch from the checkpoint's states; returns a note when the epoch must start over."""
        if self.kind == "map" or not progress.step_in_epoch:
            return None
        saved = saved or []
        rank, world = (self.exp.rt.rank, self.exp.rt.world_size) if self.kind == "own" else (0, len(saved))
        if len(saved) != world:
            progress.step_in_epoch = 0
            return f"train_loader() belongs to {len(saved)} ranks and this run has {world}: the epoch starts over"
        self.restored = bool(saved) and saved[rank] is not None and has_state(self.source)
        if self.restored:
            self.source.load_state_dict(saved[rank])
        return None

    def resume_line(self) -> str | None:
        """Which resume this run's data gets, said once when training starts (none to say for a Dataset)."""
        workers = " (trainer.num_workers does not apply: the stream is read in the training process)" if (
            self.kind == "stream" and self.exp.trainer.settings.num_workers) else ""
        if self.kind == "map" or has_state(self.source):
            return None if self.kind == "map" else f"{self.what}: a resume mid-epoch restores its state_dict(){workers}"
        unit = "micro-batches" if self.kind == "own" else "samples of the stream"
        return f"{self.what} has no state_dict(): a resume mid-epoch reads and drops the {unit} trained on{workers}"


class RankStream:
    """This rank's micro-batches of an IterableDataset (see the module's docstring), collated here."""

    def __init__(self, dataset, plan, rank: int, collate_fn):
        self.dataset, self.plan, self.rank, self.collate = dataset, plan, rank, CheckedCollate(collate_fn)
        self.read = 0  # samples of the stream read this epoch, the same on every rank

    def epoch(self, epoch: int, skip_steps: int):
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # HF datasets and webdataset pipelines reshuffle by epoch
        p, stream = self.plan, iter(self.dataset)
        collections.deque(itertools.islice(stream, skip_steps * p.global_batch), maxlen=0)  # replayed, not trained on
        m, mine, self.read = p.micro_batch, slice(self.rank * p.per_rank, (self.rank + 1) * p.per_rank), 0
        while len(chunk := list(itertools.islice(stream, p.global_batch))) == p.global_batch:
            self.read += p.global_batch
            yield from (self.collate(chunk[mine][a * m : (a + 1) * m]) for a in range(p.accumulate))
        self.read += len(chunk)


class CountedSteps:
    """A Dataset's batches: steps per epoch known, no rank needs to ask the others. On CUDA the next
    micro-batch is copied (from pinned memory) on a side stream while this one computes."""

    def __init__(self, loader, steps: int, device: torch.device):
        self.it, self.steps, self.exhausted, self.device = iter(loader), steps, False, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = self._copy() if self.stream else None

    def has_step(self, step_in_epoch: int) -> bool:
        self.exhausted = step_in_epoch >= self.steps
        return not self.exhausted

    def __next__(self):
        if self.stream is None:
            return next(self.it)  # on the CPU a batch is where it must be
        batch, current = self.ahead, torch.cuda.current_stream(self.device)
        if batch is None:
            raise StopIteration
        current.wait_stream(self.stream)  # its copy is done before the step reads it
        tree_map_only(torch.Tensor, lambda t: t.record_stream(current), batch)  # freed once this stream is done
        self.ahead = self._copy()
        return batch

    def _copy(self):
        if (batch := next(self.it, None)) is None:  # the end (a collate never gives None: data.py)
            return None
        with torch.cuda.stream(self.stream):
            return to_device(batch, self.device)


class AgreedSteps:
    """Micro-batches a whole optimizer step at a time, with the ranks' agreement that each has one."""

    def __init__(self, source, accumulate: int, device: torch.device, what: str, read=lambda: 0):
        self.it, self.accumulate, self.device, self.what, self.read = iter(source), accumulate, device, what, read
        self.pending, self.exhausted = [], False

    def has_step(self, step_in_epoch: int) -> bool:
        """Take the next step's micro-batches; True when every rank has a whole step (all must call it)."""
        self.pending = list(itertools.islice(self.it, self.accumulate))
        have = len(self.pending) == self.accumulate
        views = collectives.gather_nested(torch.tensor([int(have), self.read()], device=self.device)).tolist()
        if len({read for _, read in views}) > 1:  # an IterableDataset that is not the same stream on every rank
            raise ConfigError(f"{self.what} gave the ranks different streams (samples read: {[r for _, r in views]})",
                              "yield the same samples on every rank (ddplab splits them), or return a stream that "
                              "splits itself from train_loader()")
        self.exhausted = not all(h for h, _ in views)
        if step_in_epoch == 0 and self.exhausted:
            empty = [r for r, (h, _) in enumerate(views) if not h]
            raise ConfigError(f"{self.what} yielded less than one step ({self.accumulate} micro-batch(es) of "
                              f"trainer.accumulate) on rank(s) {empty} of {len(views)}",
                              "give every rank data, e.g. a DistributedSampler or whole shard files per rank")
        return not self.exhausted

    def __next__(self):
        return to_device(self.pending.pop(0), self.device) if self.device.type != "cpu" else self.pending.pop(0)
