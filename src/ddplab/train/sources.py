"""Where each epoch's batches come from: a Dataset (data.py's order), an IterableDataset, or an own loader.

Every rank reads an IterableDataset whole (as Accelerate's IterableDatasetShard) and keeps its share of each
global batch: the stream's batches at any world size. An own loader (`train_loader()`) yields this rank's
micro-batches. Neither has a known length, so before each step the ranks agree that each has a whole step
(one small all_gather). A resume restores the source's state_dict(), else reads and drops what was trained on."""

import collections
import collections.abc
import itertools
import multiprocessing.resource_sharer
import re
import signal
import sys
import threading
import time

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.data import IterableDataset

from ..distributed import collectives, runtime
from ..errors import ConfigError, DdplabError
from .data import CheckedCollate, epoch_order, eval_shard, sized, steps_per_epoch, train_loader


def has_state(source) -> bool:
    """The state_dict() / load_state_dict() protocol (torchdata's StatefulDataLoader, HF IterableDataset)."""
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))


def stop_loader_workers(iterator) -> None:
    """Stop a DataLoader iterator's worker processes now (a no-op for any other iterator).

    Left to the garbage collector, as after a fit() that raised (its traceback keeps the iterator),
    torch's shutdown runs inside a collection that has already closed the queue its stop message
    goes through: each worker then waits out its 5 s poll, holding its memory until then. Lightning
    stops its loaders' workers the same way (`_shutdown_workers`)."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if callable(stop):
        stop()


def to_device(batch, device: torch.device):
    """Tensors in nested lists/tuples/dicts/namedtuples to the device (non-blocking from pinned memory).
    A mapping that is not a dict (a tokenizer's BatchEncoding, a UserDict) arrives as a dict of its
    items, whose tensors torch's tree walk would otherwise leave where they are."""
    if isinstance(batch, collections.abc.Mapping) and not isinstance(batch, dict):
        batch = dict(batch.items())
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


def loader_worker_died(e: BaseException, wait_s: float = 2.0) -> DdplabError | None:
    """A DataLoader worker process that died (the kernel's out-of-memory killer, most often): torch
    raises it from its SIGCHLD handler, wherever this rank was, as an unlabelled traceback.

    A worker killed while it hands a batch over reaches this rank first as a reset connection, a moment
    before the kernel lets torch see the worker dead; torch's own check is then asked again for up to
    wait_s seconds."""
    if isinstance(e, (ConnectionError, EOFError)) and _raised_in(e.__traceback__, torch.utils.data.dataloader.__file__):
        e = _dead_worker(wait_s) or e
    # "(pid 12) is killed by signal: Killed." or "(pid(s) 12, 13) exited unexpectedly"
    found = re.search(
        r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: |exited unexpectedly)(.*)", str(e)
    )
    if not isinstance(e, RuntimeError) or found is None:
        return None
    how = found.group(2).strip().rstrip(".") or "exited unexpectedly"
    return DdplabError(
        f"a DataLoader worker process of rank {runtime.current().rank} (pid {found.group(1).strip()}) died ({how})",
        "the kernel's out-of-memory killer is the usual cause: lower trainer.num_workers or the batch size, or "
        "look at what the dataset's __getitem__ does to its process",
    )


def _may_be_a_dead_worker(e: BaseException | None) -> bool:
    """What loader_worker_died reads: torch's error for a dead worker, or the reset that may precede it."""
    return isinstance(e, (ConnectionError, EOFError)) or (isinstance(e, RuntimeError) and "DataLoader worker" in str(e))


def _dead_worker(wait_s: float) -> RuntimeError | None:
    """torch's error for this process's first dead DataLoader worker, once the kernel reports one."""
    from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails

    deadline = time.monotonic() + wait_s
    while True:
        try:
            _error_if_any_worker_fails()
        except RuntimeError as dead:
            return dead
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def ask_for_worker_deaths() -> None:
    """torch's SIGCHLD handler raises a dead DataLoader worker's error wherever the main thread is, also
    in the middle of reporting an earlier error, as a second traceback. A failing rank calls this first
    and asks instead (loader_worker_died): the default action keeps dead workers waitable for that."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def quiet_fd_sharing_thread() -> None:
    """A DataLoader worker killed while a batch's shared memory passes between it and this process
    leaves the other side's fd-sharing thread (multiprocessing.resource_sharer) with a lost connection,
    which that thread reports through sys.excepthook: a traceback above the one line that names the
    dead worker. Only that thread's lost connections are dropped; every other report is shown as
    before. Installed before the loader starts its workers, the forked workers inherit it."""
    shown = sys.excepthook
    if getattr(shown, "ddplab_quiet", False):
        return

    def hook(kind, error, traceback) -> None:
        lost = issubclass(kind, (ConnectionError, EOFError))
        if lost and traceback is not None and traceback.tb_frame.f_code is _FD_SHARING_LOOP:
            return
        shown(kind, error, traceback)

    hook.ddplab_quiet = True
    sys.excepthook = hook


# the fd-sharing thread's loop, which catches each connection's error and hands it to sys.excepthook
_FD_SHARING_LOOP = multiprocessing.resource_sharer._ResourceSharer._serve.__code__


def _raised_in(traceback, filename: str) -> bool:
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == filename:
            return True
        traceback = traceback.tb_next
    return False


class TrainData:
    """The training data of one run: its kind, steps per epoch (None: unknown), batches, and resume state."""

    def __init__(self, exp, plan, progress, num_workers: int, quorum: bool = False):
        self.exp = exp
        # dist.fault_tolerance=live: each step's global batch is shared by the replicas of its quorum
        self.quorum = quorum
        self.plan = plan
        self.progress = progress
        self.num_workers = num_workers
        if num_workers:
            quiet_fd_sharing_thread()
        # a resume restored the source's own position: the next epoch() skips nothing
        self.restored = False
        self.resume_note: str | None = None
        self.loader = exp.train_loader()
        self.dataset = exp.train_dataset() if self.loader is None else None
        name = type(exp).__name__
        if self.loader is not None:
            self.kind = "own"
            self.what = f"{name}.train_loader()"
            self.source = self.loader
        elif isinstance(self.dataset, IterableDataset):
            self.kind = "stream"
            self.what = f"{name}.train_dataset()"
            self.source = self.dataset
        else:
            self.kind = "map"
            self.what = f"{name}.train_dataset()"
            self.source = self.dataset
        self.steps = None
        if self.kind == "map":
            self.steps = steps_per_epoch(sized(self.dataset, self.what), plan.global_batch)
        if quorum and self.kind != "map":
            given = "a stream" if self.kind == "stream" else "a loader"
            raise ConfigError(
                f"dist.fault_tolerance=live shares each step's global batch among the replicas that are there, "
                f"which needs samples by index, and {self.what} gives {given}",
                "return a map-style Dataset (with __len__ and __getitem__) from train_dataset()",
            )
        self.stream = None
        if self.kind == "stream":
            self.stream = RankStream(self.dataset, plan, exp.rt.rank, exp.collate_fn)
        # the epoch in progress's DataLoader iterator (its worker processes), stopped by close()
        self.loader_iterator = None

    def first_batch(self):
        """A first micro-batch, on the device, to shape lazily made parameters with (components.py):
        the dataset's first samples, or the first batch of a fresh iterator of a stream or loader."""
        size = self.plan.micro_batch
        if self.kind == "map":
            batch = self.exp.collate_fn([self.dataset[i] for i in range(min(size, len(self.dataset)))])
        elif self.kind == "stream":
            batch = self.exp.collate_fn(list(itertools.islice(iter(self.dataset), size)))
        else:
            batch = next(iter(self.loader))
        return to_device(batch, self.exp.device)

    def epoch(self, epoch: int, start_step: int):
        """The batches of `epoch` from its step `start_step`: `has_step()` before each step, then next()."""
        exp = self.exp
        if self.quorum:
            return QuorumBatches(
                self.dataset, self.plan, exp.cfg.seed, epoch, exp.collate_fn, exp.device, self.progress
            )
        if self.kind == "map":
            feed = CountedSteps(
                train_loader(
                    self.dataset,
                    self.plan,
                    exp.rt.rank,
                    exp.cfg.seed,
                    epoch,
                    start_step,
                    exp.collate_fn,
                    self.num_workers,
                    exp.device.type == "cuda",
                ),
                self.steps,
                exp.device,
            )
            self.loader_iterator = feed.it
            return feed
        # what a resume must read and drop: nothing when the source's own state was restored
        skip = 0 if self.restored else start_step
        self.restored = False
        if self.kind == "stream":
            return AgreedSteps(
                self.stream.epoch(epoch, skip), self.plan.accumulate, exp.device, self.what, lambda: self.stream.read
            )
        if callable(set_epoch := getattr(getattr(self.loader, "sampler", None), "set_epoch", None)):
            # a DistributedSampler's shuffle follows the epoch
            set_epoch(epoch)
        self.loader_iterator = iter(self.loader)
        # replayed, not trained on
        batches = itertools.islice(self.loader_iterator, skip * self.plan.accumulate, None)
        return AgreedSteps(batches, self.plan.accumulate, exp.device, self.what)

    def close(self, failure: BaseException | None = None) -> None:
        """Stop the loader's worker processes when training ends, whether it ended or raised; not
        when the FAILURE may be a worker's death, which torch's records of the workers still name
        (`loader_worker_died`, after this): the process is ending then anyway."""
        if self.loader_iterator is None or _may_be_a_dead_worker(failure):
            return
        stop_loader_workers(self.loader_iterator)
        if getattr(self.loader, "_iterator", None) is self.loader_iterator:
            # a loader with persistent_workers keeps its iterator: the next iter() starts fresh workers
            self.loader._iterator = None
        self.loader_iterator = None

    def state_dict(self) -> list:
        """Every rank's state_dict() of the source, for the checkpoint (a collective)."""
        mine = None
        if self.kind != "map" and has_state(self.source):
            mine = self.source.state_dict()
        return collectives.gather_object(mine)

    def load_state_dict(self, saved: list | None) -> None:
        """Continue mid-epoch from the checkpoint's states (after progress is restored); when the
        epoch must start over instead, `resume_note` says why."""
        if self.kind == "map" or not self.progress.step_in_epoch:
            return
        saved = saved or []
        # an own loader is each rank's; a stream is read whole by every rank (rank 0's state serves)
        if self.kind == "own":
            rank = self.exp.rt.rank
            world = self.exp.rt.world_size
        else:
            rank = 0
            world = len(saved)
        if len(saved) != world:
            self.progress.step_in_epoch = 0
            self.resume_note = (
                f"train_loader() belongs to {len(saved)} ranks and this run has {world}: the epoch starts over"
            )
            return
        self.restored = bool(saved) and saved[rank] is not None and has_state(self.source)
        if self.restored:
            self.source.load_state_dict(saved[rank])

    def resume_line(self) -> str | None:
        """Which resume this run's data gets, said once when training starts (none to say for a Dataset)."""
        workers = (
            " (trainer.num_workers does not apply: the stream is read in the training process)"
            if (self.kind == "stream" and self.num_workers)
            else ""
        )
        if self.kind == "map" or has_state(self.source):
            return None if self.kind == "map" else f"{self.what}: a resume mid-epoch restores its state_dict(){workers}"
        unit = "micro-batches" if self.kind == "own" else "samples of the stream"
        return f"{self.what} has no state_dict(): a resume mid-epoch reads and drops the {unit} trained on{workers}"


class RankStream:
    """This rank's micro-batches of an IterableDataset (see the module's docstring), collated here."""

    def __init__(self, dataset, plan, rank: int, collate_fn):
        self.dataset = dataset
        self.plan = plan
        self.rank = rank
        self.collate = CheckedCollate(collate_fn)
        # samples of the stream read this epoch, the same on every rank
        self.read = 0

    def epoch(self, epoch: int, skip_steps: int):
        if callable(getattr(self.dataset, "set_epoch", None)):
            # HF datasets and webdataset pipelines reshuffle by epoch
            self.dataset.set_epoch(epoch)
        plan = self.plan
        stream = iter(self.dataset)
        # replayed, not trained on
        collections.deque(itertools.islice(stream, skip_steps * plan.global_batch), maxlen=0)
        micro = plan.micro_batch
        mine = slice(self.rank * plan.per_rank, (self.rank + 1) * plan.per_rank)
        self.read = 0
        while len(chunk := list(itertools.islice(stream, plan.global_batch))) == plan.global_batch:
            self.read += plan.global_batch
            for a in range(plan.accumulate):
                yield self.collate(chunk[mine][a * micro : (a + 1) * micro])
        self.read += len(chunk)


class CountedSteps:
    """A Dataset's batches: steps per epoch known, no rank needs to ask the others. On CUDA the next
    micro-batch is copied (from pinned memory) on a side stream while this one computes."""

    def __init__(self, loader, steps: int, device: torch.device):
        self.it = iter(loader)
        self.steps = steps
        self.exhausted = False
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = self._copy() if self.stream else None

    def has_step(self, step_in_epoch: int) -> bool:
        self.exhausted = step_in_epoch >= self.steps
        return not self.exhausted

    def __next__(self):
        if self.stream is None:
            # on the CPU a batch is where it must be
            return next(self.it)
        batch = self.ahead
        current = torch.cuda.current_stream(self.device)
        if batch is None:
            raise StopIteration
        # its copy is done before the step reads it
        current.wait_stream(self.stream)
        # freed once this stream is done
        tree_map_only(torch.Tensor, lambda t: t.record_stream(current), batch)
        self.ahead = self._copy()
        return batch

    def _copy(self):
        if (batch := next(self.it, None)) is None:
            # the end (a collate never gives None: data.py)
            return None
        with torch.cuda.stream(self.stream):
            return to_device(batch, self.device)


class AgreedSteps:
    """Micro-batches a whole optimizer step at a time, with the ranks' agreement that each has one."""

    def __init__(self, source, accumulate: int, device: torch.device, what: str, read=lambda: 0):
        self.it = iter(source)
        self.accumulate = accumulate
        self.device = device
        self.what = what
        self.read = read
        self.pending = []
        self.exhausted = False

    def has_step(self, step_in_epoch: int) -> bool:
        """Take the next step's micro-batches; True when every rank has a whole step (all must call it)."""
        self.pending = list(itertools.islice(self.it, self.accumulate))
        have = len(self.pending) == self.accumulate
        views = collectives.gather_nested(torch.tensor([int(have), self.read()], device=self.device)).tolist()
        if len({read for _, read in views}) > 1:
            # an IterableDataset that is not the same stream on every rank
            raise ConfigError(
                f"{self.what} gave the ranks different streams (samples read: {[r for _, r in views]})",
                "yield the same samples on every rank (ddplab splits them), or return a stream that "
                "splits itself from train_loader()",
            )
        self.exhausted = not all(h for h, _ in views)
        if step_in_epoch == 0 and self.exhausted:
            empty = [r for r, (h, _) in enumerate(views) if not h]
            raise ConfigError(
                f"{self.what} yielded less than one step ({self.accumulate} micro-batch(es) of "
                f"trainer.accumulate) on rank(s) {empty} of {len(views)}",
                "give every rank data, e.g. a DistributedSampler or whole shard files per rank",
            )
        return not self.exhausted

    def __next__(self):
        return to_device(self.pending.pop(0), self.device) if self.device.type != "cpu" else self.pending.pop(0)


class QuorumBatches:
    """A Dataset's batches under dist.fault_tolerance=live: step s's global batch, the same samples as
    at any world size, shared by the replicas of that step's quorum, each taking its contiguous share
    (shares differ by at most one sample) cut into at most `accumulate` micro-batches. A lost replica's
    samples are never skipped: its share goes to the others. The samples are read in this process."""

    def __init__(self, dataset, plan, seed: int, epoch: int, collate_fn, device: torch.device, progress):
        self.dataset = dataset
        self.plan = plan
        self.seed = seed
        self.epoch = epoch
        self.collate = CheckedCollate(collate_fn)
        self.device = device
        self.progress = progress
        self.steps = steps_per_epoch(len(dataset), plan.global_batch)
        self.order = epoch_order(len(dataset), seed, epoch)
        self.exhausted = False

    def has_step(self, step_in_epoch: int) -> bool:
        # a replica that healed into a later epoch leaves this one without ending it (the peer did)
        if self.progress.epoch != self.epoch:
            return False
        self.exhausted = step_in_epoch >= self.steps
        return not self.exhausted

    def share(self, rank: int, size: int, accumulate: int) -> tuple[collections.abc.Iterator, list[int]]:
        """This replica's micro-batches of the current step (read as they are taken), and their sizes."""
        progress = self.progress
        if progress.epoch != self.epoch:
            # healed from a peer into its epoch
            self.epoch = progress.epoch
            self.order = epoch_order(len(self.dataset), self.seed, self.epoch)
        g = self.plan.global_batch
        mine = eval_shard(g, rank, size)
        start = progress.step_in_epoch * g
        indices = self.order[start + mine.start : start + mine.stop]
        pieces = [p.tolist() for p in torch.tensor_split(indices, min(accumulate, max(len(indices), 1)))]
        batches = (to_device(self.collate([self.dataset[i] for i in piece]), self.device) for piece in pieces)
        return batches, [len(piece) for piece in pieces]
