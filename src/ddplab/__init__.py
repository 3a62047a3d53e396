"""ddplab: write a PyTorch experiment once, run it on one CPU, many processes, many GPUs or nodes.

Names are imported on first use: `import ddplab` costs little more than torch's, and the command line can
set up logging before torch loads."""

import importlib
from typing import Any

__version__ = "0.1.0"

# module (under ddplab) -> the names `import ddplab` exports from it
_WHERE = {
    "config": "Config DistConfig RunConfig TrainerConfig load_config setting",
    "config_rules": "Range one_of",
    "errors": "DdplabError",
    "experiment": "Experiment",
    "train.metrics": "MetricTracker",
    "checkpoint.export": "load_model",
    "distributed.runtime": "Runtime current init",
    "train.schedules": "warmup_schedule",
    "distributed.console": "print0 print_local0 print_rank rank_zero_only local_rank_zero_only",
    "train.shards": "ShardedDataset write_shards index_shards",
    "launch.notebook": "run RunResult",
}
_EXPORTS = {name: module for module, names in _WHERE.items() for name in names.split()}

# Modules users reach as `ddplab.<name>` (e.g. ddplab.collectives.gather_concat), by where they live.
_SUBMODULES = {
    "collectives": "distributed.collectives",
    "metrics": "train.metrics",
    "data": "train.data",
    "runtime": "distributed.runtime",
    "config": "config",
}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    raise AttributeError(f"module 'ddplab' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
