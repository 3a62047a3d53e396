"""What a run did, read back from the files it writes as it goes (a half-written last line is skipped),
so it works on a running job: the summary each run ends with (summary.json) and `ddplab report`'s text."""

import json, os, shlex, statistics, sys
from dataclasses import dataclass, field

from ..errors import DdplabError
from .logs import is_number
from .rundir import read_json


@dataclass
class Run:
    path: str
    rows: list[dict]
    info: dict = field(default_factory=dict)  # run.json: world size, batch plan, start time
    monitor: tuple[str, str] | None = None  # (eval metric, max|min) from the run's checkpoint config

    name = property(lambda self: self.path.rstrip("/"))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.rows if is_number(r.get(key))]
        return [p[0] for p in points], [p[1] for p in points]


def load_run(path: str) -> Run:
    """Read a run directory, or say in one line why it is not one."""
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        why = "has no metrics.jsonl" if os.path.isdir(path) else "does not exist"
        raise DdplabError(f"run directory {path} {why}", "pass a run directory such as runs/<experiment>/<name>")
    rows = []
    with open(metrics) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # the line a running job is writing right now
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return Run(path, rows, read_json(os.path.join(path, "run.json")), read_monitor(os.path.join(path, "config.yaml")))


def record(run: Run) -> dict:
    """The facts of a run (summary.json): length, batch plan, wall time, loss, evaluations, export."""
    times, info = [r["time"] for r in run.rows if is_number(r.get("time"))], run.info
    start, epochs = info.get("started_at") or min(times, default=None), run.series("train/epoch")[1]
    best = None
    if run.monitor and run.series(f"eval/{run.monitor[0]}")[1]:
        (key, mode), (steps, values) = run.monitor, run.series(f"eval/{run.monitor[0]}")
        at = (max if mode == "max" else min)(range(len(values)), key=values.__getitem__)
        best = {"metric": key, "mode": mode, "value": values[at], "step": steps[at]}
    last_eval = next((r for r in reversed(run.rows) if any(k.startswith("eval/") for k in r)), {})
    return {"run": run.name, "step": max((r["step"] for r in run.rows), default=0),
            "epoch": epochs[-1] if epochs else None, "plan": info or None,
            "wall_s": max(times) - start if times and start else None,
            "train_loss": (run.series("train/loss")[1] or [None])[-1],
            **{key: statistics.fmean(v) if (v := run.series(f"train/{key}")[1]) else None
               for key in ("samples_per_s", "tokens_per_s", "data_wait")},
            "best": best,
            "last_eval_step": last_eval.get("step"),
            "last_eval": {k[5:]: v for k, v in last_eval.items() if k.startswith("eval/")},
            "other": {k: v for r in run.rows for k, v in r.items() if k.split("/")[0] not in ("train", "eval", k)},
            "final": os.path.isfile(os.path.join(run.path, "final", "meta.json"))}


def summary(r: dict) -> str:
    """A few lines of a `record()`: progress, batch plan, wall time, best and last evaluation."""
    p, epochs = r["plan"], "" if r["epoch"] is None else f" ({r['epoch']:.2f} epochs)"
    lines = [f"{r['run']}: {r['step']} steps{epochs}"]
    if p:
        lines.append(f"  {p['world_size']} ranks x micro-batch {p['micro_batch']} x accumulate {p['accumulate']} = "
                     f"effective batch {p['global_batch']}; {p['backend']} on {p['device']}")
    if r["wall_s"] is not None:
        lines.append(f"  wall time {duration(r['wall_s'])} (to the last logged line)")
    if r["train_loss"] is not None:
        tokens = f" ({r['tokens_per_s']:.1f} tokens/s)" if r.get("tokens_per_s") else ""
        wait = f", {100 * r['data_wait']:.1f} % of it waiting for data" if r.get("data_wait") is not None else ""
        lines.append(f"  last train loss {r['train_loss']:.4g}; {r['samples_per_s'] or 0:.1f} samples/s{tokens} in "
                     f"training{wait}")
    if r.get("peak_mem_gib"):
        lines.append("  peak GPU memory per rank: " + ", ".join(f"{m:.2f}" for m in r["peak_mem_gib"]) + " GiB")
    if b := r["best"]:
        lines.append(f"  best eval/{b['metric']} {b['value']:.4g} at step {b['step']} ({b['mode']})")
    if shown := "  ".join(f"{k} {v:.4g}" for k, v in r["last_eval"].items() if is_number(v)):
        lines.append(f"  last eval (step {r['last_eval_step']}): {shown}")
    if shown := "  ".join(f"{k} {v:.4g}" for k, v in r["other"].items() if is_number(v)):
        lines.append("  " + shown)
    lines.append("  final model exported to final/" if r["final"] else "  no final model yet (running, stopped, failed)")
    return "\n".join(lines)


def end_of_run(t, peak_mem_gib: list | None) -> None:
    """Rank 0, when training ends (train/loop.py's Trainer `t`): the summary, with the run's status,
    throughput, each rank's peak GPU memory and the commands that resume, evaluate and report it;
    all of it in summary.json."""
    cls, run_dir = type(t.exp), t.run_dir
    file = getattr(sys.modules.get(cls.__module__), "__file__", None) or "?"  # a file given as file.py:Class
    target = f"{cls.__module__ if cls.__module__.startswith('ddplab.') else os.path.relpath(file)}:{cls.__qualname__}"
    again = [target, "--config", os.path.join(run_dir, "config.yaml")] + ["-n", str(t.rt.local_world_size)] * (
        t.rt.world_size > 1)
    r = {**record(load_run(run_dir)), "peak_mem_gib": peak_mem_gib, "status": "stopped early" if t.stalled else
         "finished", "commands": {
        "resume": shlex.join(["ddplab", "run", *again]), "report": shlex.join(["ddplab", "report", run_dir]),
        "evaluate": shlex.join(["ddplab", "eval", *again, "--checkpoint", run_dir])}}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(r, f, indent=1)
    t.exp.print(f"{summary(r)}\n  {r['status']}; its files are in {run_dir}"
                + "".join(f"\n  {k}: {c}" for k, c in r["commands"].items()))


def read_monitor(config_path: str) -> tuple[str, str] | None:
    """(checkpoint.monitor, checkpoint.mode) of a run's config.yaml: what ranks its checkpoints, or None."""
    try:
        from omegaconf import OmegaConf

        ck = OmegaConf.load(config_path).get("checkpoint", {})
    except Exception:  # no config, or not ours: the summary just leaves out the best value
        return None
    return (ck.get("monitor"), ck.get("mode", "max")) if ck.get("monitor") else None


def duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
