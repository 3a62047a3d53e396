"""What a run did, read back from the files it writes as it goes (a half-written last line is skipped),
so it works on a running job: the summary each run ends with (summary.json) and `ddplab report`'s text."""

import json
import os
import shlex
import statistics
import sys
from dataclasses import dataclass, field

from .. import environment
from ..errors import DdplabError
from .logs import is_number
from .rundir import read_json
from .stragglers import per_rank_line, per_rank_means


@dataclass
class Run:
    path: str
    rows: list[dict]
    info: dict = field(default_factory=dict)  # run.json: world size, batch plan, start time
    monitor: tuple[str, str] | None = None  # (eval metric, max|min) from the run's checkpoint config
    # what the user called it, where that is not `path` (a run in a bucket, read into a local folder)
    label: str | None = None

    @property
    def name(self):
        return (self.label or self.path).rstrip("/")

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
            except ValueError:
                # the line a running job is writing right now
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return Run(path, rows, read_json(os.path.join(path, "run.json")), read_monitor(os.path.join(path, "config.yaml")))


def record(run: Run) -> dict:
    """The facts of a run (summary.json): length, batch plan, wall time, loss, evaluations, export."""
    info = run.info
    epochs = run.series("train/epoch")[1]
    best = None
    if run.monitor and run.series(f"eval/{run.monitor[0]}")[1]:
        (key, mode), (steps, values) = run.monitor, run.series(f"eval/{run.monitor[0]}")
        at = (max if mode == "max" else min)(range(len(values)), key=values.__getitem__)
        best = {"metric": key, "mode": mode, "value": values[at], "step": steps[at]}
    last_eval = next((r for r in reversed(run.rows) if any(k.startswith("eval/") for k in r)), {})
    return {
        "run": run.name,
        "step": max((r["step"] for r in run.rows), default=0),
        "epoch": epochs[-1] if epochs else None,
        "plan": info or None,
        **training_time(run),
        "train_loss": (run.series("train/loss")[1] or [None])[-1],
        **{
            key: statistics.fmean(v) if (v := run.series(f"train/{key}")[1]) else None
            for key in ("samples_per_s", "tokens_per_s", "data_wait")
        },
        "ranks": per_rank_means(run.rows),
        "best": best,
        "last_eval_step": last_eval.get("step"),
        "last_eval": {k[5:]: v for k, v in last_eval.items() if k.startswith("eval/")},
        "other": {k: v for r in run.rows for k, v in r.items() if k.split("/")[0] not in ("train", "eval", k)},
        "final": os.path.isfile(os.path.join(run.path, "final", "meta.json")),
    }


def training_time(run: Run) -> dict:
    """Wall time spent training: each attempt's start to its last logged line, summed over the attempts
    (the time a job was down between a stop and its resume is not in it), and how many there were."""
    times = sorted(r["time"] for r in run.rows if is_number(r.get("time")))
    starts = [t for t in run.info.get("attempts") or [run.info.get("started_at")] if is_number(t)]
    if not times:
        return {"wall_s": None, "attempts": len(starts) or None}
    if not starts:
        return {"wall_s": times[-1] - times[0], "attempts": None}
    total = 0.0
    for start, end in zip(starts, [*starts[1:], float("inf")], strict=True):
        logged = [t for t in times if start <= t < end]
        total += logged[-1] - start if logged else 0.0
    return {"wall_s": total, "attempts": len(starts)}


def summary(facts: dict) -> str:
    """A few lines of a `record()`: progress, batch plan, wall time, best and last evaluation."""
    plan = facts["plan"]
    epochs = "" if facts["epoch"] is None else f" ({facts['epoch']:.2f} epochs)"
    lines = [f"{facts['run']}: {facts['step']} steps{epochs}"]
    # a run.json written in part (a damaged folder) shows no plan rather than failing
    if plan and {"world_size", "micro_batch", "accumulate", "global_batch", "backend", "device"} <= set(plan):
        lines.append(
            f"  {plan['world_size']} ranks x micro-batch {plan['micro_batch']} x accumulate {plan['accumulate']} = "
            f"effective batch {plan['global_batch']}; {plan['backend']} on {plan['device']}"
        )
    if facts["wall_s"] is not None:
        attempts = facts.get("attempts") or 1
        over = f", {attempts} attempts" if attempts > 1 else ""
        lines.append(f"  wall time {duration(facts['wall_s'])} training (to the last logged line{over})")
    if facts["train_loss"] is not None:
        lines.append(_throughput(facts))
    # (a summary.json of an older ddplab has the GPU's only)
    peaks = [
        f"{kind} {', '.join(f'{gib:.2f}' for gib in facts[key])} GiB"
        for kind, key in (("resident", "peak_rss_gib"), ("GPU", "peak_mem_gib"))
        if facts.get(key)
    ]
    if peaks:
        lines.append(f"  peak memory per rank: {'; '.join(peaks)}")
    if facts.get("ranks"):
        lines.append(per_rank_line(facts["ranks"]))
    if best := facts["best"]:
        lines.append(f"  best eval/{best['metric']} {best['value']:.4g} at step {best['step']} ({best['mode']})")
    if shown := _numbers(facts["last_eval"]):
        lines.append(f"  last eval (step {facts['last_eval_step']}): {shown}")
    if shown := _numbers(facts["other"]):
        lines.append("  " + shown)
    if facts["final"]:
        lines.append("  final model exported to final/")
    else:
        lines.append("  no final model yet (running, stopped, failed)")
    return "\n".join(lines)


def _throughput(facts: dict) -> str:
    tokens = f" ({facts['tokens_per_s']:.1f} tokens/s)" if facts.get("tokens_per_s") else ""
    wait = ""
    if facts.get("data_wait") is not None:
        wait = f", {100 * facts['data_wait']:.1f} % of it waiting for data"
    return (
        f"  last train loss {facts['train_loss']:.4g}; {facts['samples_per_s'] or 0:.1f} samples/s{tokens} in "
        f"training{wait}"
    )


def _numbers(values: dict) -> str:
    return "  ".join(f"{key} {value:.4g}" for key, value in values.items() if is_number(value))


def peak_memory(device) -> dict[str, float | None]:
    """This rank's peak memory in GiB: its process's resident set (the CPU's RAM, without DataLoader
    workers, which are processes of their own) and, on a GPU, what torch allocated there."""
    import resource

    import torch

    # Linux counts ru_maxrss in KiB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"rss": rss, "gpu": gpu}


def end_of_run(
    exp, run_dir: str, status: str, peaks: list[dict], url: str | None = None, extra: dict | None = None
) -> None:
    """Rank 0, when training ends: the summary, with the run's status, throughput, each rank's peak
    memory and the commands that resume, evaluate and report it; all of it in summary.json. `url`:
    the run's copy in object storage, which any machine can evaluate; `extra`: more facts for
    summary.json (a replica's live recovery)."""
    again = [_target(type(exp)), "--config", os.path.join(run_dir, "config.yaml")]
    processes = ["-n", str(exp.rt.local_world_size)] if exp.rt.world_size > 1 else []
    # as launched: an elastic job's --nnodes and rendezvous flags too
    launched = shlex.split(os.environ.get(environment.LAUNCH_FLAGS, "")) or processes
    facts = {
        **record(load_run(run_dir)),
        "peak_rss_gib": [peak["rss"] for peak in peaks],
        "peak_mem_gib": [peak["gpu"] for peak in peaks] if peaks[0]["gpu"] is not None else None,
        "status": status,
        "commands": {
            "resume": shlex.join(["ddplab", "run", *again, *launched]),
            "report": shlex.join(["ddplab", "report", run_dir]),
            "evaluate": shlex.join(["ddplab", "eval", *again, *processes, "--checkpoint", url or run_dir]),
        },
        **(extra or {}),
    }
    if os.environ.get(environment.RETURNED):
        # started by ddplab.run in a Python session, from a class that lives there only
        config = os.path.join(run_dir, "config.yaml")
        facts["commands"] = {
            "resume": f"ddplab.run({type(exp).__qualname__}, n={exp.rt.local_world_size}, config={config!r})",
            "report": facts["commands"]["report"],
        }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(facts, f, indent=1)
    commands = "".join(f"\n  {name}: {command}" for name, command in facts["commands"].items())
    where = f"{run_dir}, and in {url}" if url else run_dir
    exp.print(f"{summary(facts)}\n  {status}; its files are in {where}{commands}")


def _target(cls: type) -> str:
    """How `ddplab run` names the experiment again: a module of ddplab's, or the file it came from."""
    if cls.__module__.startswith("ddplab."):
        return f"{cls.__module__}:{cls.__qualname__}"
    # a file given as file.py:Class
    file = getattr(sys.modules.get(cls.__module__), "__file__", None) or "?"
    return f"{os.path.relpath(file)}:{cls.__qualname__}"


def read_monitor(config_path: str) -> tuple[str, str] | None:
    """(checkpoint.monitor, checkpoint.mode) of a run's config.yaml: what ranks its checkpoints, or None."""
    try:
        from omegaconf import OmegaConf

        if not os.path.isfile(config_path):
            # none, or a FIFO that would block the read
            return None
        ck = OmegaConf.load(config_path).get("checkpoint", {})
    except Exception:
        # no config, or not ours: the summary just leaves out the best value
        return None
    return (ck.get("monitor"), ck.get("mode", "max")) if ck.get("monitor") else None


def duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
