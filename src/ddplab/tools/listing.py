"""`ddplab checkpoints RUN_DIR`: what a run has saved, and which checkpoint resume would use."""

import os
import time

from ..checkpoint.store import list_checkpoints
from ..errors import DdplabError
from .commbench import human_bytes
from ..train.summary import read_monitor


def print_checkpoints(run_dir: str) -> int:
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        raise DdplabError(f"{run_dir} has no checkpoints/ folder", "pass a run directory, e.g. runs/<experiment>/<name>")
    infos = list_checkpoints(directory)
    if not infos:
        print(f"no committed checkpoints in {directory}")
        return 0
    monitored = [i for i in infos if i.metric is not None]
    mode = (read_monitor(os.path.join(run_dir, "config.yaml")) or ("", "max"))[1]
    best = (max if mode == "max" else min)(monitored, key=lambda i: i.metric) if monitored else None
    print(f"{'checkpoint':<16} {'step':>8} {'epoch':>6} {'metric':>10} {'size':>10}  {'saved':<19}  notes")
    for info in infos:
        notes = ", ".join(n for n, on in (("latest", info is infos[-1]), ("best", info is best)) if on)
        metric = f"{info.metric:.5g}" if info.metric is not None else "-"
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.time))
        print(f"{os.path.basename(info.path):<16} {info.step:>8} {info.epoch:>6} {metric:>10} "
              f"{human_bytes(info.size):>10}  {saved:<19}  {notes}")
    return 0

