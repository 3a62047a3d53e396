"""What `ddplab run TARGET` runs: a registered experiment, `file.py[:Name]`, or `module[:Name]`.

A target with a `:Name` (or a registered name) is a callable that ddplab calls with the resolved
config after joining the process group. A bare file or module is a script: it runs as `__main__`
with the remaining arguments in `sys.argv`, exactly as under `torchrun`, and sets itself up
(`ddplab.init()` or `torch.distributed.init_process_group`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .errors import DdplabError
from .experiments import REGISTRY


@dataclass
class Target:
    spec: str
    script: str | None = None  # path of a script to run as __main__
    module: str | None = None  # module to run as __main__
    obj: Callable[..., Any] | None = None  # callable taking the resolved config

    @property
    def is_script(self) -> bool:
        return self.obj is None

    def run_script(self, argv: list[str]) -> None:
        sys.argv = [self.script or self.module or self.spec, *argv]
        if self.script:
            sys.path.insert(0, os.path.dirname(os.path.abspath(self.script)))
            runpy.run_path(self.script, run_name="__main__")
        else:
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)  # type: ignore[arg-type]


def resolve(spec: str) -> Target:
    """Turn the user's TARGET string into something runnable, or say why it is not."""
    if spec in REGISTRY:
        return Target(spec, obj=_load_attr(*REGISTRY[spec].split(":")))
    path, _, name = spec.partition(":")
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise DdplabError(f"target file {path} does not exist", "check the path, or run a registered experiment: " + _known())
        return Target(spec, script=path) if not name else Target(spec, obj=_load_from_file(path, name))
    if _module_exists(path):
        return Target(spec, module=path) if not name else Target(spec, obj=_load_attr(path, name))
    raise DdplabError(f"unknown target '{spec}'", f"give a registered experiment ({_known()}), path/to/file.py[:Name] or a module")


def _known() -> str:
    return ", ".join(sorted(REGISTRY))


def _module_exists(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _load_attr(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    return _get(mod, name, module)


def _load_from_file(path: str, name: str) -> Any:
    module_name = os.path.splitext(os.path.basename(path))[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location(module_name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return _get(mod, name, path)


def _get(mod: Any, name: str, where: str) -> Any:
    if not hasattr(mod, name):
        public = [n for n in dir(mod) if not n.startswith("_")]
        raise DdplabError(f"{where} has no '{name}'", f"pick one of: {', '.join(public[:12])}")
    return getattr(mod, name)
