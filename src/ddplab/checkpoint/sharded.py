"""Sharded training state (dist.strategy=fsdp) in a checkpoint: each rank writes its own shards.

    step-00000040/  state.pt, meta.json, shards/{.metadata, __0_0.distcp, __1_0.distcp, …}, COMMITTED

A sharded network's weights, its optimizer state and its moving average are DTensors: each rank holds
a slice. `split` takes every DTensor out of the captured state and leaves a placeholder naming it;
torch.distributed.checkpoint (DCP) writes the slices, every rank its own file, and rank 0 writes the
rest to state.pt as before. Nothing is gathered to one rank.

`fill` puts them back for a resume into whatever shape this run has: DCP reads the slices each rank
now holds (another world size: other slices of the same tensors), or whole tensors into an unsharded
network (a run with dist.strategy=ddp, `ddplab eval`, `ddplab predict`); a DDP checkpoint's whole
tensors are cut into this rank's slices. The values are copied, never recomputed: bit for bit."""

import os
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.fsdp import dtensors_possible, is_dtensor
from ..errors import DdplabError

# the shards' folder in a checkpoint, and the key state.pt names it by
SHARDS = "shards"
# a sharded tensor's place in state.pt
PLACEHOLDER = "__sharded__"
# the entries of the training state that hold a sharded network's tensors: its weights, their
# optimizer state, their moving average (the others never hold a DTensor and are left alone)
ENTRIES = ("models", "optimizers", "ema")


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the state with each DTensor replaced by {PLACEHOLDER: key}, those DTensors by key)."""
    shards: dict[str, torch.Tensor] = {}

    def walk(value, path: str):
        if is_dtensor(value):
            shards[path] = value
            return {PLACEHOLDER: path}
        if isinstance(value, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, f"{path}/{i}") for i, v in enumerate(value))
        return value

    return walk(state, ""), shards


def save_shards(shards: dict[str, torch.Tensor], folder: str, group=None, background: bool = False):
    """Every rank writes its slices to `folder` (a collective); `background`: returns a future once
    they are staged on the host, training goes on (DCP's async save over its own `group`)."""
    import torch.distributed.checkpoint as dcp

    if background:
        return dcp.async_save(shards, checkpoint_id=folder, process_group=group)
    dcp.save(shards, checkpoint_id=folder, process_group=group)
    return None


def fill(saved: dict[str, Any], live: dict[str, Any], source: str) -> dict[str, Any]:
    """`saved` with its sharded tensors read back into the tensors `live` holds now (the state
    objects by name; of those, the ENTRIES that `saved` has). A collective when `saved` has shards."""
    folder = saved.get(SHARDS)
    names = [name for name in ENTRIES if hasattr(live.get(name), "state_dict") and saved.get(name) is not None]
    # a run that never sharded anything is not asked for its state (an optimizer's may be a collective)
    sharded_now = dtensors_possible() and any(
        is_dtensor(t) for name in names for t in _tensors(live[name].state_dict())
    )
    if folder is None and not sharded_now:
        return saved
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    for name in names:
        for opt in getattr(live[name], "objects", []):
            if isinstance(opt, torch.optim.Optimizer):
                # a fresh optimizer has no state to read into (a zero step at lr 0 makes it)
                _init_optim_state(opt)
    reads: dict[str, torch.Tensor] = {}
    out = dict(saved)
    for name in names:
        out[name] = _match(saved[name], live[name].state_dict(), reads)
    if reads:
        if folder is None:
            raise DdplabError(f"{source} names sharded tensors but has no {SHARDS}/ folder", "pass another checkpoint")
        dcp.load(reads, checkpoint_id=folder, process_group=dist.group.WORLD if dist.is_initialized() else None)
    # entries this run does not load (the optimizers, for `ddplab eval`) keep their placeholders
    return {key: _resolve(value, reads) if key in names else value for key, value in out.items()}


def _match(saved, live, reads: dict):
    """Walk `saved` beside `live`: a placeholder is read into the live tensor at its place; a whole
    tensor where this run holds a slice is cut to this rank's slice."""
    if isinstance(saved, dict) and PLACEHOLDER in saved:
        if not isinstance(live, torch.Tensor):
            raise DdplabError(
                f"the checkpoint's sharded tensor {saved[PLACEHOLDER]} has no place in this run",
                "resume from a checkpoint of this experiment and settings",
            )
        reads[saved[PLACEHOLDER]] = live
        return saved
    if isinstance(saved, torch.Tensor) and is_dtensor(live):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(live.device), live.device_mesh, live.placements, src_data_rank=None)
    if isinstance(saved, dict) and isinstance(live, dict):
        return {k: _match(v, live[k], reads) if k in live else v for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)):
        pairs = zip(saved, live, strict=False)
        matched = [_match(s, w, reads) for s, w in pairs]
        return type(saved)(matched + list(saved[len(matched) :]))
    return saved


def _resolve(value, reads: dict):
    if isinstance(value, dict):
        if PLACEHOLDER in value:
            return reads[value[PLACEHOLDER]]
        return {k: _resolve(v, reads) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(v, reads) for v in value)
    return value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def shard_files(folder: str) -> list[str]:
    """The shards' files of a checkpoint folder, relative to it (for its commit marker)."""
    shards = os.path.join(folder, SHARDS)
    if not os.path.isdir(shards):
        return []
    return sorted(os.path.join(SHARDS, name) for name in os.listdir(shards))
