"""The run directory: `run.dir/<experiment>/<run.name or timestamp>/`.

Rank 0 chooses the name and every rank receives it, so all ranks agree on one directory even when
their clocks tick over between them. Without `run.name`, the run plan names the run after its
start time (launch/plan.py), kept across agent restarts so restarted workers find their
checkpoints; set `run.name` yourself to resume a run started earlier.
"""

import json
import os
import time

from ..distributed import collectives
from ..config import save_config
from ..errors import ConfigError

SUBDIRS = ("checkpoints", "tensorboard", "results", "final")


def prepare_run_dir(cfg, experiment: str, is_main: bool) -> str:
    name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
    path = collectives.broadcast_object(os.path.join(cfg.run.dir, experiment, name) if is_main else None)
    if is_main:
        try:
            for sub in SUBDIRS:
                os.makedirs(os.path.join(path, sub), exist_ok=True)
            save_config(cfg, os.path.join(path, "config.yaml"))
        except OSError as e:
            raise ConfigError(f"cannot write the run directory {path} ({e.strerror})",
                              "pass a writable run.dir=PATH") from None
    return path


def write_run_info(run_dir: str, info: dict) -> None:
    """`run.json`: what the config alone does not say (world size, batch plan, backend), for
    `ddplab report`. A resumed run keeps the first start time, so wall time covers every attempt."""
    started = read_run_info(run_dir).get("started_at")
    with open(os.path.join(run_dir, "run.json"), "w") as f:
        json.dump({**info, "started_at": started or time.time()}, f, indent=1)


def read_run_info(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
