"""What a checkpoint holds, and how a training run is put back exactly as it was.

The training state is a mapping of named objects, each with `state_dict()` and `load_state_dict()`
(torchtitan hands its checkpointer the same): the networks, their moving average, the optimizers,
schedulers and grad scaler, where the data order stands, progress, the last evaluation, the
early-stop record, the data source's own position and every rank's random streams. `capture` saves
each under its name; `restore` loads them back in the mapping's order. A new kind of state is one
more entry where the trainer builds the mapping (train/loop.py), nothing here.

Only tensors, numbers, strings, lists and dicts are saved, so a checkpoint loads with
`torch.load(weights_only=True)`. Beside the entries a checkpoint records its layout (`format`), the
versions that wrote it, the resolved config, the world size and which classes it was trained by."""

from typing import Any, Protocol

import torch
from torch.nn.parameter import is_lazy

from .. import __version__, seeding
from ..distributed import collectives, fsdp, sharding
from ..distributed.wrapping import unwrap
from ..errors import DdplabError
from . import sharded
from .objects import StorageError
from .store import CheckpointManager, load_latest_valid, load_state, resolve_checkpoint

# The layout of a checkpoint. 1: every entry at the top level under its own name (ddplab 0.1.0 on).
# A layout this ddplab cannot read is refused in one line that names the version that wrote it.
FORMAT = 1
NEW_RUN = "start a new run (another run.name)"


class Stateful(Protocol):
    """Anything a checkpoint can hold: torch's optimizers and schedulers, and ddplab's own records."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, saved: Any) -> Any: ...


def capture(state: dict[str, Stateful], about: dict[str, Any]) -> dict[str, Any]:
    """Every entry's state under its name, and `about` (config, world size, kinds, loggers).
    A collective: the random streams and the data position are gathered from every rank."""
    saved = {name: obj.state_dict() for name, obj in state.items()}
    versions = {"ddplab": __version__, "torch": str(torch.__version__)}
    return {**saved, **about, "format": FORMAT, "versions": versions}


def restore(state: dict[str, Stateful], saved: dict[str, Any], kinds: dict[str, Any]) -> str | None:
    """Load every entry of `state` from `saved`, in order, after checking that this run can continue
    that one (its layout, and the experiment and optimizers that trained it). Returns a note for the
    user when something could not be restored exactly (another world size), else None."""
    _check_format(saved)
    _check_kinds(saved.get("kinds", {}), kinds)
    saved = sharded.fill(_upgrade(saved), state, "the checkpoint")
    notes = []
    for name, obj in state.items():
        obj.load_state_dict(saved.get(name))
        if note := getattr(obj, "resume_note", None):
            notes.append(note)
    return "; ".join(notes) or None


def load_resume(mode: str, checkpoints: CheckpointManager, device: torch.device) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint run.resume asks for, as (where, its state): `auto` the newest readable one of
    the run (none yet: None), `never` None, else the path given. A run in object storage resumes
    from the bucket, on every rank, after rank 0 has uploaded a newer local one (mirror.Uploads);
    a checkpoint this machine wrote is read from its local copy."""
    if mode == "never":
        return None
    if mode == "auto":
        if checkpoints.remote:
            _catch_up(checkpoints)
        cache = checkpoints.directory if checkpoints.remote else None
        found = load_latest_valid(checkpoints.remote or checkpoints.directory, map_location=device, cache=cache)
        return None if found is None else (found[0].path, found[1])
    return mode, load_state(resolve_checkpoint(mode), map_location=device)


def _catch_up(checkpoints: CheckpointManager) -> None:
    problem = None
    if checkpoints.uploads is not None:
        try:
            checkpoints.uploads.catch_up(checkpoints.list())
        except StorageError as e:
            problem = (e.cause, e.fix)
    # every rank waits for rank 0's upload, and learns of its failure
    problem = collectives.broadcast_object(problem)
    if problem is not None:
        raise StorageError(*problem)


def _check_format(saved: dict[str, Any]) -> None:
    layout = saved.get("format", 1)
    if not isinstance(layout, int) or layout > FORMAT:
        wrote = saved.get("versions", {}).get("ddplab", "an unknown version")
        raise DdplabError(
            f"the checkpoint was written by ddplab {wrote} in layout {layout}, which ddplab {__version__} "
            f"cannot read (it reads layouts up to {FORMAT})",
            f"resume it with ddplab {wrote}, or {NEW_RUN}",
        )


def _check_kinds(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Only this experiment, with these networks, optimizers and schedulers, can continue a run."""
    for key, current in now.items():
        trained_by = saved.get(key, current)
        if trained_by != current:
            raise DdplabError(
                f"the checkpoint was trained by {key} {trained_by}, this run has {current}",
                "resume from a checkpoint of this experiment and optimizers, or start a new run",
            )


def _upgrade(saved: dict[str, Any]) -> dict[str, Any]:
    """Fill in what older writers of layout 1 left out: progress without samples_seen (every step
    took one global batch)."""
    progress = dict(saved["progress"])
    progress.setdefault("samples_seen", progress["step"] * saved["sampler"]["global_batch"])
    return {**saved, "progress": progress}


def kinds_of(identity: str, models: dict, optimizers: list, schedulers: list) -> dict[str, Any]:
    """What trained a run: the experiment's identity and the class of each network, optimizer and
    scheduler. A checkpoint records it; a resume by anything else is refused."""
    return {
        "experiment": identity,
        "models": [fsdp.user_class(m).__name__ for m in models.values()],
        "optimizers": [sharding.kind(o) for o in optimizers],
        "schedulers": [type(s).__name__ for s in schedulers],
    }


class Networks:
    """The networks by attribute name, unwrapped: their checkpoints keep the plain parameter names."""

    def __init__(self, models: dict[str, torch.nn.Module], source: str = "the checkpoint"):
        self.models = models
        self.source = source

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: model.state_dict() for name, model in self.models.items()}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        load_networks(self.models, saved or {}, self.source)


class StateList:
    """The optimizers, or the schedulers, of a run: as many saved as there are now, loaded in order."""

    def __init__(self, kind: str, objects: list):
        self.kind = kind
        self.objects = objects

    def state_dict(self) -> list:
        return [obj.state_dict() for obj in self.objects]

    def load_state_dict(self, saved: list | None) -> None:
        _load_list(self.kind, self.objects, saved or [])


class Optimizers(StateList):
    """The optimizers; a resume keeps the hyperparameters the run was trained with. torch's
    load_state_dict would silently put the checkpoint's learning rate (and momentum, weight decay,
    ...) back over the ones this run's build() set, while config.yaml said otherwise: refused."""

    # how an optimizer runs, not what it computes
    IMPLEMENTATION = ("params", "foreach", "fused", "differentiable", "capturable")

    def __init__(self, optimizers: list, schedulers: list):
        super().__init__("optimizer", optimizers)
        self.scheduled = {id(getattr(s, "optimizer", None)) for s in schedulers}

    def state_dict(self) -> list:
        # a collective: a sharded optimizer's state is gathered from every rank
        return [sharding.full_state(opt) for opt in self.objects]

    def load_state_dict(self, saved: list | None) -> None:
        for opt, state in zip(self.objects, saved or [], strict=False):
            for now, was in zip(opt.param_groups, state.get("param_groups", []), strict=False):
                self._check(opt, now, was)
        super().load_state_dict(saved)

    def _check(self, opt, now: dict, was: dict) -> None:
        # a scheduler moves lr as it goes: its starting value (initial_lr) is what build() chose
        skip = ("lr",) if id(opt) in self.scheduled else ("initial_lr",)
        for key, value in now.items():
            if key in self.IMPLEMENTATION or key in skip or key not in was or _same(was[key], value):
                continue
            raise DdplabError(
                f"the checkpoint's {type(opt).__name__} trained with {key}={was[key]}, and this run's build() "
                f"sets {key}={value}: resuming would train with the checkpoint's while the config says otherwise",
                f"resume with the settings the run was trained with, or {NEW_RUN} from its weights",
            )


def _same(was, now) -> bool:
    if isinstance(now, torch.Tensor) or isinstance(was, torch.Tensor):
        return torch.equal(torch.as_tensor(was), torch.as_tensor(now))
    if isinstance(now, (tuple, list)):
        return list(was) == list(now)
    return was == now


class DataOrder:
    """The seed and global batch the data order was drawn with, and where it stands. Both must be
    the same to continue a run: the batches of every later step follow from them. The batch plan
    (how the global batch was cut) is kept too: it may change with the world size, and `ddplab
    predict` uses the micro-batch the run trained with."""

    def __init__(self, progress, seed: int, plan):
        self.progress = progress
        self.seed = seed
        self.plan = plan
        self.resume_note: str | None = None

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.progress.epoch,
            "step_in_epoch": self.progress.step_in_epoch,
            "seed": self.seed,
            "global_batch": self.plan.global_batch,
            "accumulate": self.plan.accumulate,
            "micro_batch": self.plan.micro_batch,
        }

    def load_state_dict(self, saved: dict[str, int]) -> None:
        for key, was, now in (
            ("trainer.global_batch_size", saved["global_batch"], self.plan.global_batch),
            ("seed", saved["seed"], self.seed),
        ):
            if was != now:
                raise DdplabError(
                    f"the checkpoint was trained with {key}={was}, this run asks for {now}",
                    f"resume with {key}={was}, or {NEW_RUN}",
                )
        plan = self.plan
        cut = (saved.get("micro_batch", plan.micro_batch), saved.get("accumulate", plan.accumulate))
        if cut != (plan.micro_batch, plan.accumulate):
            self.resume_note = (
                f"the global batch of {plan.global_batch} was cut into micro-batches of {saved['micro_batch']} x "
                f"{saved['accumulate']}, now {plan.micro_batch} x {plan.accumulate} per rank: the same global batches"
            )


class PerRank:
    """An object of the experiment's own, saved from every rank (a collective) and restored on each:
    on another world size rank r takes the state of saved rank r % (ranks saved), and says so."""

    def __init__(self, obj: Stateful, rank: int, world_size: int):
        self.obj = obj
        self.rank = rank
        self.world_size = world_size
        self.resume_note: str | None = None

    def state_dict(self) -> list:
        return collectives.gather_object(self.obj.state_dict())

    def load_state_dict(self, saved: list | None) -> None:
        if not saved:
            return
        if len(saved) != self.world_size:
            self.resume_note = (
                f"the experiment's own state was saved by {len(saved)} ranks and this run has {self.world_size}: "
                f"rank r continues from saved rank r % {len(saved)}"
            )
        self.obj.load_state_dict(saved[self.rank % len(saved)])


class RandomStreams:
    """Every rank's random state (Python, numpy, torch, CUDA). Saved from all ranks, so each rank
    continues its own stream; on another world size each rank is re-seeded from the step."""

    def __init__(self, seed: int, rank: int, world_size: int, progress):
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.progress = progress
        self.resume_note: str | None = None

    def state_dict(self) -> list[dict[str, Any]]:
        return collectives.gather_object(seeding.capture())

    def load_state_dict(self, saved: list[dict[str, Any]]) -> None:
        if len(saved) == self.world_size:
            seeding.restore(saved[self.rank])
            return
        seeding.seed_rank(self.seed, self.rank, self.progress.step)
        self.resume_note = (
            f"the checkpoint was written by {len(saved)} ranks and this run has {self.world_size}: the data "
            "order continues exactly, random streams (dropout, augmentation) are re-seeded per rank"
        )


def load_networks(models: dict[str, torch.nn.Module], saved: dict[str, Any], source: str = "the checkpoint") -> None:
    """Load each network's saved tensors, by name; an error names what is missing or does not fit."""
    missing = sorted(set(models) - set(saved))
    if missing:
        raise DdplabError(
            f"{source} has no network named {missing} (it has {sorted(saved)})",
            f"load a checkpoint of this experiment, or {NEW_RUN}",
        )
    for name, model in models.items():
        load_matching(unwrap(model), saved[name], name)


def load_matching(model: torch.nn.Module, saved: dict[str, torch.Tensor], name: str = "model") -> None:
    """load_state_dict with an error that names the mismatched keys and shapes."""
    own = model.state_dict()
    missing = [key for key in own if key not in saved]
    unexpected = [key for key in saved if key not in own]
    shapes = [
        f"{key}: checkpoint {tuple(saved[key].shape)} vs model {tuple(own[key].shape)}"
        for key in own
        # a lazily made parameter (nn.LazyLinear) takes the saved shape as it loads
        if key in saved and not is_lazy(own[key]) and tuple(saved[key].shape) != tuple(own[key].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {missing[:4]}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:4]}")
    if shapes:
        problems.append(f"shape mismatch {shapes[:3]}")
    if problems:
        raise DdplabError(
            f"the checkpoint does not fit network '{name}': " + "; ".join(problems),
            "load a checkpoint of the same model and model.* settings",
        )
    model.load_state_dict(saved)


def _load_list(kind: str, objects: list, saved: list) -> None:
    if len(objects) != len(saved):
        raise DdplabError(
            f"the checkpoint has {len(saved)} {kind}(s), this experiment {len(objects)}",
            "resume from a checkpoint of this experiment",
        )
    for obj, state in zip(objects, saved, strict=True):
        obj.load_state_dict(state)
