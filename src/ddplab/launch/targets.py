"""What `ddplab run TARGET` runs: a registered experiment, `file.py[:Name]`, or `module[:Name]`.

A target with a `:Name` (or a registered name) is called with the resolved config in the process group.
A bare file or module is a script: it runs as `__main__` with the remaining arguments in `sys.argv`, as
under `torchrun`, and sets itself up (`ddplab.init()` or its own group)."""

import ast
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..entries import PAYLOAD_SUFFIX, load_entry
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
    path, _, name = spec.rpartition(":") if PAYLOAD_SUFFIX + ":" in spec else spec.partition(":")
    if path.endswith(PAYLOAD_SUFFIX):
        # sent by ddplab.run from a Python session (launch/notebook.py)
        entry = f"{os.path.abspath(path)}:{name}"
        return Target(spec, obj=runnable(load_entry(entry), name), entry=entry)
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise DdplabError(
                f"target file {path} does not exist", f"check the path, or run a registered experiment: {known}"
            )
        if not name:
            _check_is_a_script(path, path)
            return Target(spec, script=path)
        entry = f"{os.path.abspath(path)}:{name}"
        return Target(spec, obj=runnable(load_entry(entry), spec), entry=entry)
    if _module_exists(path):
        if name:
            return Target(spec, obj=runnable(load_entry(spec), spec), entry=spec)
        origin = importlib.util.find_spec(path).origin
        if origin and origin.endswith(".py"):
            _check_is_a_script(origin, path)
        return Target(spec, module=path)
    raise DdplabError(
        f"unknown target '{spec}'", f"give a registered experiment ({known}), path/to/file.py[:Name] or a module"
    )


def runnable(obj: Any, spec: str) -> Any:
    """An Experiment class (trained), or a function (called with the resolved config). Anything
    else, a network or a dataclass say, would be called, train nothing and exit 0."""
    from ..experiment import Experiment

    if (isinstance(obj, type) and issubclass(obj, Experiment)) or inspect.isfunction(obj):
        return obj
    what = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
    raise DdplabError(
        f"{spec} is {what}, neither an Experiment nor a function: running it would train nothing",
        "name a subclass of ddplab.Experiment (or a function that takes the config) after the colon",
    )


def _check_is_a_script(path: str, spec: str) -> None:
    """A file that defines experiments runs as a script only when it says it is one: a
    `__main__` guard or a call to ddplab.init(). Otherwise it would train nothing and exit 0."""
    with open(path, errors="replace") as f:
        tree = ast.parse(f.read())
    experiments = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("Experiment") for base in node.bases)
    ]
    if experiments and not _says_it_is_a_script(tree):
        raise DdplabError(
            f"{spec} defines {', '.join(experiments)} but runs nothing as a script (no __main__ guard, "
            "no ddplab.init())",
            f"name the class to train: ddplab run {spec}:{experiments[-1]}",
        )


def _says_it_is_a_script(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and "__name__" in ast.unparse(node) and "__main__" in ast.unparse(node):
            return True
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("ddplab.init", "init"):
            return True
    return False


def _module_exists(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
