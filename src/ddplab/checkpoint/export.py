"""Publishing and reuse: `final/` holds each network as safetensors plus the config that built it.

    final/model.safetensors (or <name>.safetensors per network), config.yaml, meta.json (with
    trainer.ema_decay the weights are their moving average, and meta.json says "weights": "ema")

`load_model(run_or_final_dir)` rebuilds the networks from that config and loads the weights, in any process.

Tied parameters (a language model's `lm_head.weight = wte.weight`) are one tensor under two names.
safetensors refuses to write a tensor twice, so the file holds it once, under its first name, and
records every other name in the file's metadata as `{alias: kept name}`: safetensors' own convention
(`safetensors.torch.save_model`), so `safetensors.torch.load_model(net, file)` reads it too. Loading
puts each alias back before a strict `load_state_dict` (docs/decisions.md)."""

import collections
import json
import os
import sys
from typing import Any

import torch

from ..config import load_config, save_config
from ..distributed.wrapping import unwrap
from ..entries import load_entry
from ..errors import DdplabError
from .state import load_networks


def export_final(exp, models: dict, directory: str, ema_decay: float = 0.0, weights: dict | None = None) -> None:
    """Write the final networks (rank 0 only); `weights`: each network's state gathered whole already
    (sharded networks). safetensors holds tensors only: nothing executable."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    files = {name: "model.safetensors" if len(models) == 1 else f"{name}.safetensors" for name in models}
    for name, model in models.items():
        tensors, aliases = one_copy_each(weights[name] if weights else unwrap(model).state_dict())
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_file(tensors, os.path.join(directory, files[name]), metadata={"format": "pt", **aliases})
    save_config(exp.cfg, os.path.join(directory, "config.yaml"))
    cls = type(exp)
    # for a class that is not importable
    source = getattr(sys.modules.get(cls.__module__), "__file__", None)
    meta = {
        "experiment": f"{cls.__module__}:{cls.__qualname__}",
        "source": source and os.path.abspath(source),
        "networks": files,
        "weights": "ema" if ema_decay else "trained",
        "ema_decay": ema_decay,
    }
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def one_copy_each(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state without the names that alias an earlier one (the same tensor: storage, offset, shape,
    strides), and {alias: kept name}. Tensors that overlap without being the same view (one a slice of
    another) are written as copies of their own: loading fills each, and build() makes the overlap again."""
    kept: dict[tuple, str] = {}
    aliases = {}
    for key, value in state.items():
        view = (_storage(value), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
        if view in kept and value.numel():
            aliases[key] = kept[view]
        else:
            kept[view] = key
    views_of = collections.Counter(view[0] for view in kept)
    tensors = {key: state[key].clone() if views_of[view[0]] > 1 else state[key] for view, key in kept.items()}
    # in the state's own order
    return {key: tensors[key] for key in state if key in tensors}, aliases


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's memory is (an empty tensor's own object: it shares nothing)."""
    return tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)


def with_aliases(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors with every alias its metadata records put back under its own name."""
    aliases = {alias: kept for alias, kept in (metadata or {}).items() if kept in tensors and alias not in tensors}
    return {**tensors, **{alias: tensors[kept] for alias, kept in aliases.items()}}


def load_model(path: str, overrides: list[str] | None = None) -> Any:
    """Rebuild the network(s) of a finished run: one network, or a dict of them by name.

    `path` is a run directory or its `final/` directory. `overrides` (key=value) adjust the config,
    e.g. to change a head for transfer learning; the weights must still fit."""
    from safetensors import safe_open

    final = os.path.join(path, "final") if os.path.isdir(os.path.join(path, "final")) else path
    meta_path = os.path.join(final, "meta.json")
    if not os.path.exists(meta_path):
        raise DdplabError(f"{path} has no exported model (final/meta.json)", "point at a finished run directory")
    with open(meta_path) as f:
        meta = json.load(f)
    try:
        cls = load_entry(meta["experiment"])
    except ImportError:
        # a class from a file that is not importable by module name: its file
        cls = load_entry(f"{meta.get('source')}:{meta['experiment'].split(':')[1]}")
    cfg = load_config(cls.config_class, list(overrides or []), os.path.join(final, "config.yaml"))
    exp = cls(cfg)
    exp.build()
    nets = {name: getattr(exp, name) for name in meta["networks"]}
    saved = {}
    for name, file in meta["networks"].items():
        # the tensors and the metadata that names their aliases, in one read of the file
        with safe_open(os.path.join(final, file), "pt") as f:
            names = f.keys()
            saved[name] = with_aliases({key: f.get_tensor(key) for key in names}, f.metadata())
    load_networks(nets, saved, final)
    for net in nets.values():
        net.eval()
    return next(iter(nets.values())) if len(nets) == 1 else nets
