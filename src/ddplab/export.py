"""Publishing and reuse: `final/` holds each network as safetensors plus the config that built it.

    final/model.safetensors     the network (one file per network: <name>.safetensors when several)
    final/config.yaml           the resolved config
    final/meta.json             which experiment class built the networks, and their file names

`load_model(run_or_final_dir)` rebuilds the networks from that config and loads the weights, for
inference or transfer learning, in a plain process (no process group needed).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from typing import Any



from .config import save_config
from .errors import DdplabError
from .wrapping import unwrap


def export_final(exp, directory: str) -> None:
    """Write the final networks (rank 0 only). safetensors holds tensors only: nothing executable."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    names = list(exp.models)
    files = {name: "model.safetensors" if len(names) == 1 else f"{name}.safetensors" for name in names}
    for name, model in exp.models.items():
        tensors = {k: v.detach().cpu().contiguous() for k, v in unwrap(model).state_dict().items()}
        save_file(tensors, os.path.join(directory, files[name]))
    save_config(exp.cfg, os.path.join(directory, "config.yaml"))
    cls = type(exp)
    meta = {"experiment": f"{cls.__module__}:{cls.__qualname__}", "source": _source_file(cls), "networks": files}
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def load_model(path: str, overrides: list[str] | None = None) -> Any:
    """Rebuild the network(s) of a finished run: one network, or a dict of them by name.

    `path` is a run directory or its `final/` directory. `overrides` (key=value) adjust the config,
    e.g. to change a head for transfer learning; the weights must still fit.
    """
    from safetensors.torch import load_file

    from .config import load_config
    from .state import load_matching

    final = os.path.join(path, "final") if os.path.isdir(os.path.join(path, "final")) else path
    meta_path = os.path.join(final, "meta.json")
    if not os.path.exists(meta_path):
        raise DdplabError(f"{path} has no exported model (final/meta.json)", "point at a finished run directory")
    with open(meta_path) as f:
        meta = json.load(f)
    cls = _load_class(meta["experiment"], meta.get("source"))
    cfg = load_config(cls.config_class, list(overrides or []), os.path.join(final, "config.yaml"))
    exp = cls(cfg)
    exp.build()
    nets = {}
    for name, file in meta["networks"].items():
        net = getattr(exp, name)
        load_matching(net, load_file(os.path.join(final, file)), name)
        nets[name] = net.eval()
    return next(iter(nets.values())) if len(nets) == 1 else nets


def _source_file(cls) -> str | None:
    module = sys.modules.get(cls.__module__)
    return os.path.abspath(module.__file__) if module is not None and getattr(module, "__file__", None) else None


def _load_class(spec: str, source: str | None):
    module_name, qualname = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if not source or not os.path.exists(source):
            raise DdplabError(f"cannot import {module_name} to rebuild the model", "make the experiment importable") from None
        loader = importlib.util.spec_from_file_location(module_name, source)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        loader.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


