"""What `ddplab run TARGET` runs: a registered experiment, `file.py[:Name]`, or `module[:Name]`.

A target with a `:Name` (or a registered name) is called with the resolved config in the process group.
A bare file or module is a script: it runs as `__main__` with the remaining arguments in `sys.argv`, as
under `torchrun`, and sets itself up (`ddplab.init()` or its own group)."""

import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..entries import load_entry
from ..errors import DdplabError
from ..experiments import REGISTRY


@dataclass
class Target:
    spec: str
    script: str | None = None  # path of a script to run as __main__
    module: str | None = None  # module to run as __main__
    obj: Callable[..., Any] | None = None  # callable taking the resolved config
    entry: str | None = None  # where obj lives, "module:Name" or "/abs/file.py:Name" (entries.py)

    @property
    def is_script(self):
        return self.obj is None


def resolve(spec: str) -> Target:
    """Turn the user's TARGET string into something runnable, or say why it is not."""
    known = ", ".join(sorted(REGISTRY))
    if spec in REGISTRY:
        return Target(spec, obj=load_entry(REGISTRY[spec]), entry=REGISTRY[spec])
    path, _, name = spec.partition(":")
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise DdplabError(
                f"target file {path} does not exist", f"check the path, or run a registered experiment: {known}"
            )
        if not name:
            _check_runs_something(path)
            return Target(spec, script=path)
        entry = f"{os.path.abspath(path)}:{name}"
        return Target(spec, obj=load_entry(entry), entry=entry)
    if _module_exists(path):
        return Target(spec, module=path) if not name else Target(spec, obj=load_entry(spec), entry=spec)
    raise DdplabError(
        f"unknown target '{spec}'", f"give a registered experiment ({known}), path/to/file.py[:Name] or a module"
    )


def _check_runs_something(path: str) -> None:
    """A file that only defines experiments would run as a script, do nothing and exit 0."""
    with open(path, errors="replace") as f:
        text = f.read()
    classes = re.findall(r"^class (\w+)\(.*Experiment\b", text, re.M)
    if classes and not re.search(r"^(if|for|while|with|try)\b|^[\w.]+\(|^[\w, ]+=.*\(", text, re.M):
        # top-level code
        raise DdplabError(
            f"{path} defines {', '.join(classes)} but calls nothing when run as a script",
            f"name the class to train: ddplab run {path}:{classes[-1]}",
        )


def _module_exists(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
