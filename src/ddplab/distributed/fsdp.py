"""dist.strategy=fsdp: each network fully sharded (FSDP2, `torch.distributed.fsdp.fully_shard`).

Every rank keeps 1/W of each parameter, its gradient and its optimizer state; a unit's parameters are
all-gathered just before its forward (and again for its backward) and its gradients reduce-scattered
after. Which modules are units decides how much is whole at once:

- `dist.fsdp_units=auto`: FSDP1's size-based policy, bottom-up: a module becomes a unit when the
  parameters under it not yet in a unit number at least `dist.fsdp_min_params`; the root holds the rest.
- `dist.fsdp_units=Block,Embedding`: every module of those classes (torchtitan and Lightning shard
  each transformer block the same way).

Tied parameters (a language model's `lm_head.weight = wte.weight`) must stay in one unit: FSDP2 refuses
to manage a parameter from two. The auto policy never makes a unit of a module whose parameters are
also reached from outside it; classes named by hand that would split a tie are refused in one line.

The rest of ddplab sees plain modules whose parameters are DTensors: gradient clipping takes the norm
over the whole model (`total_norm`), evaluation gathers every unit once (`gathered`), checkpoints write
each rank's shards (checkpoint/sharded.py) and final/ gathers one tensor at a time (`full_weights`)."""

import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..config import DistConfig
from ..errors import ConfigError


def _loaded(module: str, name: str):
    """torch's `module.name` when something has imported the module, else None: importing FSDP and
    DTensor costs every process about half a second, so ddplab imports them only to shard, and
    nothing can be sharded or a DTensor before they are imported."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name) if loaded is not None else None


def is_dtensor(value) -> bool:
    cls = _loaded("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(value, cls)


def dtensors_possible() -> bool:
    """Whether any DTensor can exist in this process (its module has been imported)."""
    return _loaded("torch.distributed.tensor", "DTensor") is not None


def shard(model: nn.Module, cfg: DistConfig, device: torch.device, precision: str) -> nn.Module:
    """`model` fully sharded in place over the default process group: its units, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if any(is_dtensor(p) for p in model.parameters()):
        # a module it shares with a network sharded before it: its parameters are that one's now
        raise ConfigError(
            f"{type(model).__name__} shares parameters with another network of the experiment, and "
            "dist.strategy=fsdp shards each parameter in exactly one network",
            "put the networks that share parameters into one nn.Module, or use dist.strategy=ddp",
        )
    if cfg.fsdp_cpu_offload and device.type != "cuda":
        raise ConfigError(
            "dist.fsdp_cpu_offload=true moves sharded state from the GPU to the host, and this job trains on the CPU",
            "drop dist.fsdp_cpu_offload (a CPU run keeps everything on the host already)",
        )
    mixed = MixedPrecisionPolicy()
    if precision == "bf16":
        # the weights travel and compute in bf16; the gradients are summed in fp32
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy()
    for unit in choose_units(model, cfg.fsdp_units, cfg.fsdp_min_params):
        fully_shard(unit, mp_policy=mixed, offload_policy=offload)
    fully_shard(model, mp_policy=mixed, offload_policy=offload)
    return model


def parameter_places(model: nn.Module) -> list[tuple[torch.Tensor, nn.Module, str]]:
    """Each parameter with a module and attribute that hold it: where to find it again once
    fully_shard has put a sharded parameter in its place."""
    return [
        (param, module, name)
        for module in model.modules()
        for name, param in module._parameters.items()
        if param is not None
    ]


def replaced(places: list[tuple[torch.Tensor, nn.Module, str]]) -> dict[int, torch.Tensor]:
    """{id(old parameter): the parameter its place holds now}, for those fully_shard replaced."""
    return {id(old): module._parameters[name] for old, module, name in places if module._parameters[name] is not old}


def retarget(optimizers: list[torch.optim.Optimizer], moved: dict[int, torch.Tensor]) -> None:
    """build() made its optimizers over the networks' parameters before ddplab sharded them: each
    optimizer now steps the sharded parameters instead (it has no state yet to move)."""
    if not moved:
        return
    for opt in optimizers:
        if opt.state:
            raise ConfigError(
                f"{type(opt).__name__} has state before the first step, and dist.strategy=fsdp replaces the "
                "parameters it would belong to",
                "make the optimizer in build() without stepping it",
            )
        for group in opt.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]


def choose_units(model: nn.Module, units: str, min_params: int) -> list[nn.Module]:
    """The modules sharded as units of their own, children before their parents (FSDP2's order)."""
    crossing = _tied_across(model)
    if units == "auto":
        chosen: list[str] = []
        _size_based(model, "", min_params, crossing, chosen)
    else:
        chosen = _by_class(model, [name.strip() for name in units.split(",") if name.strip()], crossing)
    modules = dict(model.named_modules())
    return [modules[name] for name in chosen]


def _size_based(module: nn.Module, prefix: str, min_params: int, crossing, chosen: list[str]) -> int:
    """Parameters under `module` not yet in a unit, after making units below it (bottom-up)."""
    remaining = sum(p.numel() for p in module._parameters.values() if p is not None)
    for name, child in module.named_children():
        remaining += _size_based(child, f"{prefix}.{name}" if prefix else name, min_params, crossing, chosen)
    if prefix and remaining >= min_params and not crossing(prefix):
        chosen.append(prefix)
        return 0
    return remaining


def check_named_units(models: dict[str, nn.Module], units: str) -> None:
    """Classes named in dist.fsdp_units of which no network has a module (a typo, or another model's
    names), each of them: one line listing the classes the networks have. One network may lack a
    class another has; a class no network has would be dropped without a word, its modules left in
    the root unit."""
    if units == "auto":
        return
    classes = [name.strip() for name in units.split(",") if name.strip()]
    kinds = sorted({user_class(m).__name__ for model in models.values() for m in model.modules()})
    if missing := [name for name in classes if name not in kinds]:
        shown = ", ".join(kinds[:8]) + (" ..." if len(kinds) > 8 else "")
        named = (
            "names no module of the networks"
            if len(missing) == len(classes)
            else f"names {', '.join(missing)}, which no network has"
        )
        raise ConfigError(
            f"dist.fsdp_units={units} {named} (their modules are: {shown})",
            "name the classes of their repeated blocks (e.g. dist.fsdp_units=Block), or use dist.fsdp_units=auto",
        )


def _by_class(model: nn.Module, classes: list[str], crossing) -> list[str]:
    chosen = [name for name, module in model.named_modules() if name and type(module).__name__ in classes]
    for name in chosen:
        if tie := crossing(name):
            raise ConfigError(
                f"dist.fsdp_units makes {name} a unit of its own, but its parameter {tie[0]} is tied to {tie[1]} "
                "outside it, and a tied parameter must stay in one unit",
                "leave that class out of dist.fsdp_units (the tie then stays in the root), or use dist.fsdp_units=auto",
            )
    # children first: reverse of named_modules' parents-first order
    return chosen[::-1]


def _tied_across(model: nn.Module):
    """A function: module path -> (a name inside it, a name outside it) of one parameter, or None."""
    names = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    tied = [group for group in names.values() if len(group) > 1]

    def crossing(path: str) -> tuple[str, str] | None:
        for group in tied:
            inside = [n for n in group if n.startswith(path + ".")]
            outside = [n for n in group if not n.startswith(path + ".")]
            if inside and outside:
                return inside[0], outside[0]
        return None

    return crossing


def user_class(model: nn.Module) -> type:
    """The network's own class: fully_shard changes a module's class to FSDP<its class>."""
    cls, sharded = type(model), _loaded("torch.distributed.fsdp", "FSDPModule")
    if sharded is None or not issubclass(cls, sharded):
        return cls
    return next(c for c in cls.__mro__[1:] if c is not sharded)


def is_sharded(model: nn.Module) -> bool:
    sharded = _loaded("torch.distributed.fsdp", "FSDPModule")
    return sharded is not None and isinstance(getattr(model, "_orig_mod", model), sharded)


def _fsdp_modules(networks: list[nn.Module]) -> list:
    return [m for net in networks for m in getattr(net, "_orig_mod", net).modules() if is_sharded(m)]


@contextmanager
def gathered(networks: list[nn.Module]) -> Iterator[None]:
    """Every unit's parameters whole on every rank for the block, then sharded again: evaluation and
    prediction give each rank its own number of batches, and a unit that all-gathers in its forward
    would wait forever for a rank that has none left. The weights only, once: no gradients, no
    optimizer state (torch's advice for evaluating FSDP2 models)."""
    modules = _fsdp_modules(networks)
    if not modules:
        yield
        return
    roots = {id(getattr(net, "_orig_mod", net)) for net in networks}
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            # FSDP2 keeps a root's parameters after its forward (the backward needs them at once)
            module.set_reshard_after_forward(id(module) not in roots, recurse=False)


@contextmanager
def gradient_sync(networks: list[nn.Module], on: bool) -> Iterator[None]:
    """Without sync, micro-batch gradients accumulate unsharded on each rank (FSDP1's no_sync):
    the reduce-scatter runs once, on the last micro-batch."""
    roots = [getattr(net, "_orig_mod", net) for net in networks if is_sharded(net)]
    for root in roots:
        root.set_requires_gradient_sync(on)
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)


def total_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over sharded gradients: the norm of the whole model's gradient (each rank's
    shard's norm is partial; `full_tensor` sums them), then every shard scaled by the same factor."""
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def full_weights(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The network's state with every sharded tensor whole, on the host (`keep`: this rank keeps it,
    others only help gather). A collective, one tensor at a time, so no rank ever holds more than one
    whole tensor on its device; a tied tensor is gathered once and stays one tensor under both names."""
    whole: dict[int, torch.Tensor] = {}
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in whole:
            tensor = value.full_tensor() if is_dtensor(value) else value
            whole[id(value)] = tensor.detach().cpu() if keep else torch.empty(0)
        out[key] = whole[id(value)]
    return out if keep else {}
