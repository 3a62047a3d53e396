"""Data order that is global, resumable in O(1), and the same at any world size.

Training: epoch e's order is a permutation drawn from (seed, e); step s takes the global batch
`order[s*G:(s+1)*G]` and rank r of W its contiguous G/W, cut into `accumulate` micro-batches. The
whole state is (epoch, step_in_epoch): a resume, on any world size, jumps to its step and sees the
same global batches. Evaluation: contiguous, unpadded shards, gathered in rank order = dataset order."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ..errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is cut: G samples per step = W ranks x A micro-batches x m samples."""

    global_batch: int
    world_size: int
    accumulate: int
    # the accumulation was chosen for this world size (trainer.accumulate=auto)
    chosen: bool = False

    def __post_init__(self):
        # both are >= 1 (config.check_values)
        if self.global_batch % (self.world_size * self.accumulate):
            raise ConfigError(
                f"trainer.global_batch_size={self.global_batch} does not divide into {self.world_size} "
                f"ranks x {self.accumulate} micro-batches (trainer.accumulate)",
                f"use a multiple of {self.world_size * self.accumulate} or change trainer.accumulate",
            )

    @property
    def micro_batch(self):
        return self.global_batch // (self.world_size * self.accumulate)

    @property
    def per_rank(self):
        return self.global_batch // self.world_size


def plan_batches(global_batch: int, world_size: int, accumulate: str | int, micro_limit: int | None) -> BatchPlan:
    """The batch plan for this world size: `accumulate` as set, or with trainer.accumulate=auto the
    fewest micro-batches per step that keep each rank's micro-batch within trainer.micro_batch_size.
    The global batch is the same at every world size. A plan that cannot be made is refused in one
    line whose fixes each work alone, the other settings as they are: the nearest global batch, an
    accumulation, the world sizes that can keep this global batch."""
    plan = _plan(global_batch, world_size, accumulate, micro_limit)
    if plan is not None:
        return plan
    fixes = []
    if nearest := _nearest_global_batch(global_batch, world_size, accumulate, micro_limit):
        fixes.append(f"trainer.global_batch_size={nearest}")
    if str(accumulate) != "auto" and (fits := _fewest_micro_batches(global_batch, world_size, micro_limit)):
        fixes.append(f"trainer.accumulate={fits}")
    fix = "use " + " or ".join(fixes)
    working = [w for w in range(1, min(global_batch, 64) + 1) if _plan(global_batch, w, accumulate, micro_limit)]
    if working:
        fix += f", or run on one of these world sizes: {_shown(working)}"
    raise ConfigError(_refusal(global_batch, world_size, accumulate, micro_limit), fix)


def _plan(global_batch: int, world_size: int, accumulate: str | int, micro_limit: int | None) -> BatchPlan | None:
    if global_batch < world_size or global_batch % world_size:
        return None
    if str(accumulate) == "auto":
        fits = _fewest_micro_batches(global_batch, world_size, micro_limit)
        return BatchPlan(global_batch, world_size, fits, chosen=True) if fits else None
    accumulate = int(accumulate)
    micro_batch, rest = divmod(global_batch, world_size * accumulate)
    if rest or (micro_limit is not None and micro_batch > micro_limit):
        return None
    return BatchPlan(global_batch, world_size, accumulate)


def _refusal(global_batch: int, world_size: int, accumulate: str | int, micro_limit: int | None) -> str:
    """Why no plan: the first of the rules the settings break."""
    if global_batch < world_size:
        return (
            f"trainer.global_batch_size={global_batch} is smaller than the world size ({world_size} ranks): "
            "some rank would get no sample"
        )
    auto = str(accumulate) == "auto"
    if global_batch % (world_size * (1 if auto else int(accumulate))):
        return f"trainer.global_batch_size={global_batch} does not divide into {world_size} ranks" + (
            "" if auto else f" x {accumulate} micro-batches (trainer.accumulate)"
        )
    # auto always finds one sample a micro-batch once the ranks divide the global batch
    return (
        f"trainer.accumulate={accumulate} gives each rank micro-batches of "
        f"{global_batch // (world_size * int(accumulate))} samples, more than trainer.micro_batch_size={micro_limit}"
    )


def _nearest_global_batch(global_batch: int, world_size: int, accumulate: str | int, micro_limit: int | None):
    """The global batch nearest above (else below) this one that this world size and accumulation
    can keep: W x A x m with 1 <= m <= the limit (auto: any multiple of W, one sample a micro-batch)."""
    step = world_size * (1 if str(accumulate) == "auto" else int(accumulate))
    most = None if str(accumulate) == "auto" else micro_limit
    multiple = max(1, -(-global_batch // step))
    if most is not None and multiple > most:
        multiple = most
    nearest = step * multiple
    return nearest if nearest != global_batch else None


def _fewest_micro_batches(global_batch: int, world_size: int, micro_limit: int | None) -> int | None:
    """The smallest accumulation A with G = W x A x m and m <= the limit (None: no such A)."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    for accumulate in range(1, per_rank + 1):
        if per_rank % accumulate == 0 and (micro_limit is None or per_rank // accumulate <= micro_limit):
            return accumulate
    return None


def _shown(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:12])) + (", ..." if len(sizes) > 12 else "")


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of epoch `epoch`: a function of (seed, epoch) only."""
    generator = torch.Generator()
    # within the 64 bits a generator takes, whatever the seed (one from `date +%s%N` too); the
    # same value as before for every seed below 2**43
    generator.manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(n, generator=generator)


def sized(dataset, what: str) -> int:
    """The number of samples of what `what` returned, or one line naming that method when it has
    no len() (DistributedSampler-style sharding and exact evaluation need one) or no sample."""
    if not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"{what} returned {'None' if dataset is None else type(dataset).__name__}, which has no len()",
            "return a Dataset with __len__ and __getitem__ (TensorDataset(x, y)), or an IterableDataset",
        )
    if len(dataset) == 0:
        raise ConfigError(f"{what} is empty (0 samples)", "check the data path and any filtering of the data")
    return len(dataset)


def steps_per_epoch(n: int, global_batch: int) -> int:
    """Whole global batches per epoch; the remainder is dropped so every step sees G samples."""
    if n < global_batch:
        raise ConfigError(
            f"the training set has {n} samples, fewer than one global batch (trainer.global_batch_size={global_batch})",
            "lower trainer.global_batch_size or use more data",
        )
    return n // global_batch


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of indices) from `start_step` to the end of the epoch."""

    # steps whose indices become Python ints in one call
    STEPS_PER_CHUNK = 64

    def __init__(self, n: int, plan: BatchPlan, rank: int, seed: int, epoch: int, start_step: int = 0):
        self.n = n
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        return (steps_per_epoch(self.n, self.plan.global_batch) - self.start_step) * self.plan.accumulate

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's share of each step, turned into lists a chunk of steps at a time: slicing
        the order tensor and calling tolist() for every micro-batch cost about 9 us a step in
        the training loop, a visible part of a millisecond step."""
        plan = self.plan
        steps = steps_per_epoch(self.n, plan.global_batch)
        order = epoch_order(self.n, self.seed, self.epoch)
        by_step = order[: steps * plan.global_batch].view(steps, plan.world_size, plan.per_rank)
        mine = by_step[self.start_step :, self.rank]
        micro = plan.micro_batch
        for chunk in mine.split(self.STEPS_PER_CHUNK):
            for indices in chunk.tolist():
                yield from (indices[a * micro : (a + 1) * micro] for a in range(plan.accumulate))


def eval_shard(n: int, rank: int, world_size: int, unit: int = 1) -> range:
    """Rank `rank`'s contiguous, unpadded share of n samples, in whole units of `unit` samples but
    the last (numbers of units differ by at most one)."""
    base, extra = divmod(-(-n // unit), world_size)
    start = (rank * base + min(rank, extra)) * unit
    return range(min(start, n), min(start + (base + (rank < extra)) * unit, n))


class CollateError(ConfigError):
    """One line. Raised in a DataLoader worker, it comes back made from the worker's traceback: its last line."""

    def __init__(self, text: str):
        super().__init__(text.rstrip().splitlines()[-1].split(f"{type(self).__name__}: ")[-1])


class CheckedCollate:
    """collate_fn, its contract checked on every micro-batch: a batch, never None; default_collate failing
    on samples it cannot stack is one line with the fix (the user's own that raises is a bug: traceback)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, samples: list):
        try:
            batch = self.fn(samples)
        except Exception as e:
            if self.fn is not default_collate:
                raise
            raise CollateError(
                f"default_collate cannot make one batch of {len(samples)} samples ({type(e).__name__}: "
                f"{str(e).partition(chr(10))[0]}); give the experiment a collate_fn that pads them to "
                "one shape: collate_fn = staticmethod(fn)"
            ) from None
        if batch is None:
            raise CollateError(
                f"collate_fn {getattr(self.fn, '__qualname__', self.fn)} returned None for "
                f"{len(samples)} samples; return the batch, e.g. default_collate(samples)"
            )
        return batch


def train_loader(
    dataset: Dataset,
    plan: BatchPlan,
    rank: int,
    seed: int,
    epoch: int,
    start_step: int,
    collate_fn: Callable,
    num_workers: int,
    pin_memory: bool,
) -> DataLoader:
    sampler = GlobalBatchSampler(len(dataset), plan, rank, seed, epoch, start_step)
    # A worker's python, numpy and torch seeds come from torch, from this generator: reproducible.
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=CheckedCollate(collate_fn),
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=_generator(seed, rank, epoch, start_step),
    )


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    collate_fn: Callable,
    num_workers: int,
    pin_memory: bool,
    unit: int = 1,
) -> DataLoader:
    shard = eval_shard(len(dataset), rank, world_size, unit)
    # Its own generator: creating a loader iterator draws a seed, and evaluation must not consume
    # the training's random stream (or an extra evaluation would change the training after it).
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=shard,
        collate_fn=CheckedCollate(collate_fn),
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=False,
        generator=_generator(rank, world_size),
    )


def _generator(*parts: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(hash(parts) % 2**62)
    return g
