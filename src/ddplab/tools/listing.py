"""`ddplab runs [DIR]`: every run and how it stands, a sweep's trials as a group (tools/sweeps.py);
`ddplab checkpoints RUN_DIR`: what one run has saved, and which checkpoint resume would use."""

import glob
import json
import os
import re
import tempfile
import time

from ..checkpoint.mirror import RECORD, SUMMARY
from ..checkpoint.objects import is_url, join, store_for
from ..checkpoint.store import best_checkpoints, list_checkpoints
from ..errors import DdplabError
from ..train.ending import failed_part
from ..train.rundir import is_locked, read_json
from ..train.summary import duration, load_run, read_monitor, record
from .sweeps import find_sweeps, read_sweep, sweep_lines

# the folder of one replica of a live job (dist.fault_tolerance=live) inside its run's
REPLICA = re.compile(r"replica-\d+")


def print_runs(directory: str, as_json: bool) -> int:
    """One line per run folder (`DIR/<experiment>/<name>/`), or a JSON list for scripts; DIR may be
    a run.dir in object storage."""
    if is_url(directory):
        sweeps, rows = [], _rows_in_bucket(directory)
    else:
        sweeps = find_sweeps(directory)
        # a sweep's folder holds its trials' runs: shown as the sweep's group alone
        alone = sweeps == [directory]
        # a live job's replicas each keep a run of their own in it (dist.fault_tolerance=live)
        patterns = [
            os.path.join(directory, "*", "*", "run.json"),
            os.path.join(directory, "*", "*", "replica-*", "run.json"),
        ]
        found = sorted(p for pattern in patterns for p in glob.glob(pattern))
        folders = [] if alone else [os.path.dirname(p) for p in found]
        rows = [_status_or_damage(folder) for folder in folders]
    if not rows and not sweeps:
        raise DdplabError(f"no runs in {directory}", "pass the run.dir the runs were written to (default: runs)")
    if as_json:
        trials = [{**row, "sweep": folder} for folder in sweeps for row in read_sweep(folder)[1]]
        print(json.dumps(rows + trials, indent=1))
        return 0
    # as wide as the longest status ("failed at the end (on_fit_end)")
    width = max([19, *(len(row["status"]) for row in rows)])
    if rows:
        print(f"{'experiment':<16} {'run':<26} {'status':<{width}} {'step':>8}  {'best':<22} wall time")
    for row in rows:
        print(_line(row, width))
    for folder in sweeps:
        print("\n".join(sweep_lines(folder)))
    return 0


def _line(row: dict, width: int) -> str:
    best = f"{row['best']['metric']} {row['best']['value']:.4g}" if row["best"] else "-"
    wall = duration(row["wall_s"]) if row["wall_s"] is not None else "-"
    step = row["checkpoint"] or "-"
    return f"{row['experiment']:<16} {row['run']:<26} {row['status']:<{width}} {step:>8}  {best:<22} {wall}"


def _status_or_damage(path: str, saved: list | None = None) -> dict:
    """A run folder's status; a folder whose files cannot be read is one row saying so, never the
    end of the listing."""
    try:
        row = run_status(path, saved)
        # what the table will show must be showable
        _line(row, len(row["status"]))
        return row
    except (DdplabError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return {
            **_names(path),
            "status": f"damaged ({type(e).__name__})",
            "checkpoint": None,
            "best": None,
            "wall_s": None,
            "path": path,
        }


def _rows_in_bucket(url: str) -> list[dict]:
    """The runs of a run.dir in object storage: each one's record read into a scratch folder, its
    committed checkpoints listed in the bucket. Whether it is running cannot be known there: one
    without a summary is unfinished."""
    store = store_for(url)
    keys = set(store.find())
    runs = sorted(k[: -len("/run.json")] for k in keys if k.endswith("/run.json") and _is_run(k.split("/")[:-1]))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for run in runs:
            local = os.path.join(scratch, run)
            os.makedirs(local)
            for name in (*RECORD, SUMMARY):
                if f"{run}/{name}" in keys:
                    with open(os.path.join(local, name), "wb") as f:
                        f.write(store.read_bytes(run, name))
            saved = list_checkpoints(join(url, run, "checkpoints"))
            row = _status_or_damage(local, saved)
            if row["status"] == "killed (resumable)":
                row["status"] = "unfinished (resumable)"
            rows.append({**row, "path": join(url, run)})
    return rows


def run_status(path: str, saved: list | None = None) -> dict:
    """running (lock held), finished or stopped early (summary.json), failed at the end (on_fit_end or the
    export), killed (resumable), or failed (no checkpoint). `saved`: its committed checkpoints, when
    they are elsewhere (a bucket)."""
    if saved is None:
        saved = list_checkpoints(os.path.join(path, "checkpoints"))
    ended = read_json(os.path.join(path, "summary.json"))
    # a summary already holds best and wall time
    logged = os.path.isfile(os.path.join(path, "metrics.jsonl"))
    r = ended or (record(load_run(path)) if logged else {"best": None, "wall_s": None})
    status = ended.get("status") or ("killed (resumable)" if saved else "failed")
    if part := failed_part(path):
        # training is done: fixing the part, not resuming, is what helps (train/ending.py)
        status = f"failed at the end ({part})"
    if is_locked(path):
        status = "running"
    return {
        **_names(path),
        "status": status,
        "checkpoint": saved[-1].step if saved else None,
        "best": r["best"],
        "wall_s": r["wall_s"],
        "path": path,
    }


def _is_run(parts: list[str]) -> bool:
    """EXPERIMENT/NAME, or EXPERIMENT/NAME/replica-ID of a live job."""
    return len(parts) == 2 or (len(parts) == 3 and REPLICA.fullmatch(parts[2]) is not None)


def _names(path: str) -> dict:
    """The experiment and the run a folder is: NAME, or NAME/replica-ID for a replica of a live job."""
    parent, name = os.path.split(os.path.normpath(path))
    if REPLICA.fullmatch(name):
        parent, run = os.path.split(parent)
        name = f"{run}/{name}"
    return {"experiment": os.path.basename(parent), "run": name}


def print_checkpoints(run_dir: str) -> int:
    """A run folder's committed checkpoints, or a run's in object storage (s3://.../<experiment>/<name>)."""
    directory = join(run_dir, "checkpoints") if is_url(run_dir) else os.path.join(run_dir, "checkpoints")
    if not is_url(run_dir) and not os.path.isdir(directory):
        raise DdplabError(
            f"{run_dir} has no checkpoints/ folder", "pass a run directory, e.g. runs/<experiment>/<name>"
        )
    infos = list_checkpoints(directory)
    if not infos:
        print(f"no committed checkpoints in {directory}")
        return 0
    # the mode each checkpoint was ranked by (its meta; older ones: the run's config)
    mode = infos[-1].mode or (read_monitor(os.path.join(run_dir, "config.yaml")) or ("", "max"))[1]
    best = next(iter(best_checkpoints(infos, mode, 1)), None)
    print(f"{'checkpoint':<16} {'step':>8} {'epoch':>6} {'metric':>10} {'size':>10}  {'saved':<19}  notes")
    for info in infos:
        notes = ", ".join(n for n, on in (("latest", info is infos[-1]), ("best", info is best)) if on)
        metric = f"{info.metric:.5g}" if info.metric is not None else "-"
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.time))
        print(
            f"{os.path.basename(info.path):<16} {info.step:>8} {info.epoch:>6} {metric:>10} "
            f"{human_bytes(info.size):>10}  {saved:<19}  {notes}"
        )
    return 0


def human_bytes(n: float) -> str:
    """1024 -> '1 KB', 13400 -> '13.1 KB'."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1024
