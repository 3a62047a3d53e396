"""ddplab: write a PyTorch experiment once, run it on one CPU, many processes, many GPUs or nodes.

Names are imported on first use, so `import ddplab` costs little more than `import torch`, and the
command line can set up logging before torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "config",
    "DistConfig": "config",
    "RunConfig": "config",
    "TrainerConfig": "config",
    "load_config": "config",
    "DdplabError": "errors",
    "Experiment": "experiment",
    "MetricTracker": "metrics",
    "load_model": "export",
    "Runtime": "runtime",
    "current": "runtime",
    "init": "runtime",
    "print0": "console",
    "print_local0": "console",
    "print_rank": "console",
    "rank_zero_only": "console",
    "local_rank_zero_only": "console",
}

_SUBMODULES = ("collectives", "metrics", "data", "runtime", "config")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ddplab' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
