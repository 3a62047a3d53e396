"""A sweep of `ddplab sweep` read back from its folder: each trial with its values, how it ended and
its result, best first. `ddplab runs` shows a sweep as one group; `ddplab report SWEEP` draws the
metric against each searched key.

The study (SWEEP/study.db) is what the sweep itself goes by, so it is read here too: the trials'
values, states, results and each evaluation they reported."""

import glob
import json
import math
import os

from ..errors import DdplabError
from ..train.rundir import is_locked

SWEEP_FILE = "sweep.json"


def find_sweeps(directory: str) -> list[str]:
    """DIRECTORY itself when it is a sweep, else the sweeps in it (RUN_DIR/<experiment>/<name>)."""
    if os.path.isfile(os.path.join(directory, SWEEP_FILE)):
        return [directory]
    return [os.path.dirname(p) for p in sorted(glob.glob(os.path.join(directory, "*", "*", SWEEP_FILE)))]


def read_sweep(folder: str) -> tuple[dict, list[dict]]:
    """sweep.json, and one row per trial, best first: finished trials by their result, then pruned
    ones by their last reported value, then the rest."""
    import optuna

    try:
        with open(os.path.join(folder, SWEEP_FILE)) as f:
            sweep = json.load(f)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=os.path.basename(folder), storage=f"sqlite:///{folder}/study.db")
    except (OSError, ValueError, KeyError) as e:
        raise DdplabError(
            f"{folder} is not a readable sweep ({type(e).__name__})", "pass a folder ddplab sweep made"
        ) from None
    rows = [_row(sweep, folder, trial) for trial in study.trials]
    sign = -1 if sweep["mode"] == "max" else 1
    order = {"finished": 0, "pruned": 1}
    rows.sort(key=lambda r: (order.get(r["status"].split()[0], 2), sign * r["value"] if r["value"] is not None else 0))
    return sweep, rows


def _row(sweep: dict, folder: str, trial) -> dict:
    run = os.path.join(folder, sweep["experiment"], f"trial-{trial.number:03d}")
    steps = sorted(trial.intermediate_values)
    last = trial.intermediate_values[steps[-1]] if steps else None
    state = trial.state.name
    status = {"COMPLETE": "finished", "FAIL": "failed", "WAITING": "waiting"}.get(state)
    if state == "PRUNED":
        status = f"pruned (step {steps[-1]})" if steps else "pruned"
    if state == "RUNNING":
        status = "running" if is_locked(run) else "interrupted"
    return {
        "experiment": sweep["experiment"],
        "trial": trial.number,
        "run": os.path.basename(run),
        "status": status,
        "value": trial.value if state == "COMPLETE" else last,
        "params": dict(trial.params),
        "reported": {str(step): trial.intermediate_values[step] for step in steps},
        "path": run,
    }


def sweep_lines(folder: str) -> list[str]:
    """`ddplab runs`' group of a sweep: a heading, then a line per trial, best first."""
    sweep, rows = read_sweep(folder)
    ended = sum(r["status"].startswith(("finished", "pruned")) for r in rows)
    keys = list(sweep["space"])
    metric = sweep["monitor"]
    state = "running" if is_locked(folder) else "done" if ended >= sweep["trials"] else "stopped (same command goes on)"
    lines = [
        f"sweep {os.path.relpath(folder)}: {ended} of {sweep['trials']} trials ended, {state}; "
        f"eval/{metric} ({sweep['mode']}), best first",
        f"  {'trial':<10} {'status':<16} {metric:>12}  " + "  ".join(f"{k:>14}" for k in keys),
    ]
    for r in rows:
        value = f"{r['value']:.4g}" if r["value"] is not None and math.isfinite(r["value"]) else "-"
        values = "  ".join(f"{_shown(r['params'].get(k)):>14}" for k in keys)
        lines.append(f"  {r['run']:<10} {r['status']:<16} {value:>12}  {values}")
    return lines


def _shown(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def draw_sweep(folder: str, out_dir: str) -> str:
    """One PNG: the metric against each searched key, a finished trial as a dot, a pruned one as a
    cross at its last reported value (log scale for a loguniform key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, rows = read_sweep(folder)
    keys = list(sweep["space"])
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for kind, marker in (("finished", "o"), ("pruned", "x")):
            points = [
                (r["params"][key], r["value"]) for r in rows if r["status"].startswith(kind) and r["value"] is not None
            ]
            if points:
                ax.scatter([_axis(p[0]) for p in points], [p[1] for p in points], marker=marker, label=kind)
        if sweep["space"][key].startswith("loguniform"):
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"eval/{sweep['monitor']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{os.path.basename(folder)}: eval/{sweep['monitor']} ({sweep['mode']}) by searched value")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sweep.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _axis(value):
    """A choice of words is drawn at its word (matplotlib's categorical axis); numbers as numbers."""
    return str(value) if isinstance(value, (str, bool)) else value
