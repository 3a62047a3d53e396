"""Publishing and reuse: `final/` holds each network as safetensors plus the config that built it.

    final/model.safetensors (or <name>.safetensors per network), config.yaml, meta.json (with
    trainer.ema_decay the weights are their moving average, and meta.json says "weights": "ema")

`load_model(run_or_final_dir)` rebuilds the networks from that config and loads the weights, in any process."""

import json
import os
import sys
from typing import Any

from ..config import load_config, save_config
from ..distributed.wrapping import unwrap
from ..entries import load_entry
from ..errors import DdplabError
from .state import load_networks


def export_final(exp, models: dict, directory: str, ema_decay: float = 0.0) -> None:
    """Write the final networks (rank 0 only). safetensors holds tensors only: nothing executable."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    files = {name: "model.safetensors" if len(models) == 1 else f"{name}.safetensors" for name in models}
    for name, model in models.items():
        tensors = {k: v.detach().cpu().contiguous() for k, v in unwrap(model).state_dict().items()}
        save_file(tensors, os.path.join(directory, files[name]))
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


def load_model(path: str, overrides: list[str] | None = None) -> Any:
    """Rebuild the network(s) of a finished run: one network, or a dict of them by name.

    `path` is a run directory or its `final/` directory. `overrides` (key=value) adjust the config,
    e.g. to change a head for transfer learning; the weights must still fit."""
    from safetensors.torch import load_file

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
    load_networks(nets, {name: load_file(os.path.join(final, file)) for name, file in meta["networks"].items()}, final)
    for net in nets.values():
        net.eval()
    return next(iter(nets.values())) if len(nets) == 1 else nets
