"""Where a user's class or function lives, as text: "module:Name" or "/abs/path/file.py:Name".
Run plans hand entries to workers and exported models record theirs, so both load alike."""

import importlib
import importlib.util
import os
import sys
from typing import Any

from .errors import DdplabError

# a class or function a Python session sent to its workers, pickled by value (launch/notebook.py)
PAYLOAD_SUFFIX = ".ddplab.pkl"


def load_entry(entry: str) -> Any:
    where, _, name = entry.rpartition(":")
    if where.endswith(PAYLOAD_SUFFIX):
        return load_payload(where)
    if not where.endswith(".py"):
        return _get(importlib.import_module(where), name, where)
    if not os.path.isfile(where):
        raise DdplabError(f"{where} does not exist", "check the path of the experiment's file")
    module_name = os.path.splitext(os.path.basename(where))[0]
    folder = os.path.dirname(os.path.abspath(where))
    # a file loaded before is that module again, as an import is: run twice, it would be another
    # module (ddplab_user_<name>), whose classes no checkpoint of the first one's would resume
    for loaded in (sys.modules.get(module_name), sys.modules.get(f"ddplab_user_{module_name}")):
        if loaded is not None and _is_file(loaded, where):
            return _get(loaded, name, where)
    if module_name in sys.modules or module_name in sys.stdlib_module_names:
        # a json.py must not replace json
        module_name = f"ddplab_user_{module_name}"
        # its sibling modules, after the standard ones it would hide
        sys.path.append(folder)
    else:
        # its sibling modules, first, as for a script
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, where)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return _get(module, name, where)


def _is_file(module: Any, path: str) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and os.path.realpath(file) == os.path.realpath(path)


def entry_of(cls: type) -> str:
    """The entry that loads `cls` from any folder: a module of a package by its name, a top-level module
    (e.g. a file run as file.py:Name, importable from its own folder only) by its file's path."""
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return f"{cls.__module__ if '.' in cls.__module__ or not file else os.path.abspath(file)}:{cls.__qualname__}"


def _get(module: Any, name: str, where: str) -> Any:
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            public = [n for n in dir(module) if not n.startswith("_")]
            raise DdplabError(f"{where} has no '{name}'", f"pick one of: {', '.join(public[:12])}")
        obj = getattr(obj, part)
    return obj


def load_payload(path: str) -> Any:
    """The class or function a session sent (launch/notebook.py), or one line saying why it cannot
    be loaded here: what it imports by name must be importable where the workers start."""
    import cloudpickle

    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except FileNotFoundError:
        raise DdplabError(f"{path} does not exist", "run it from the session that wrote it (ddplab.run)") from None
    except (ImportError, AttributeError) as e:
        raise DdplabError(
            f"the experiment sent from the session cannot be loaded in the worker processes ({type(e).__name__}: {e})",
            "define what it names in the notebook, or put the module it lives in where the session starts "
            "(its folder or sys.path)",
        ) from None
