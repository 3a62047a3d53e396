"""`ddplab report RUN_DIR [RUN_DIR ...]`: a run's curves as PNG files and a short text summary.

It reads only files a run writes as it goes (`metrics.jsonl`, `run.json`, `config.yaml`), so it
works on a run that is still training: a half-written last line is skipped. Several runs are
overlaid, one colour each, for comparison.

Panels: loss (train solid, evaluation dashed), one per other evaluation metric, learning rate,
throughput, then any other training metric (e.g. grad_norm). `report.png` holds them all."""

import json
import math
import os
import re
from dataclasses import dataclass, field

from ..errors import DdplabError
from ..train.logs import is_number
from ..train.rundir import read_run_info

SKIPPED = {"train/epoch"}  # an x-axis, not a curve
TITLES = {"train/lr": "learning rate", "train/samples_per_s": "throughput (samples/s)"}


@dataclass
class Run:
    path: str
    rows: list[dict]
    info: dict = field(default_factory=dict)  # run.json: world size, batch plan, start time
    monitor: tuple[str, str] | None = None  # (eval metric, max|min) from the run's checkpoint config

    @property
    def name(self) -> str:
        return self.path.rstrip("/")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.rows if is_number(r.get(key))]
        return [p[0] for p in points], [p[1] for p in points]


@dataclass
class Panel:
    title: str
    keys: list[str]  # metric keys drawn in this panel (train and eval loss share one)

    filename = property(lambda self: re.sub(r"[^a-z0-9]+", "_", self.title.lower()).strip("_") + ".png")


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
    return Run(path, rows, read_run_info(path), read_monitor(os.path.join(path, "config.yaml")))


def panels_for(runs: list[Run]) -> list[Panel]:
    keys = sorted({k for run in runs for row in run.rows for k, v in row.items()
                   if k.startswith(("train/", "eval/")) and k not in SKIPPED and is_number(v)})
    panels = []
    loss = [k for k in ("train/loss", "eval/loss") if k in keys]
    if loss:
        panels.append(Panel("loss", loss))
    panels += [Panel(k, [k]) for k in keys if k.startswith("eval/") and k != "eval/loss"]
    panels += [Panel(TITLES[k], [k]) for k in TITLES if k in keys]
    panels += [Panel(k, [k]) for k in keys if k.startswith("train/") and k not in TITLES and k != "train/loss"]
    return panels


def draw(runs: list[Run], out_dir: str) -> list[str]:
    """One PNG per panel plus `report.png` with every panel; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    panels = panels_for(runs)
    if not panels:
        raise DdplabError("no train/ or eval/ metrics logged yet", "wait for the first log line (trainer.log_every)")
    written = []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        _plot_panel(ax, panel, runs)
        written.append(_save(fig, os.path.join(out_dir, panel.filename)))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _plot_panel(ax, panel, runs)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    fig.suptitle(", ".join(run.name for run in runs), fontsize=10)
    written.append(_save(fig, os.path.join(out_dir, "report.png")))
    return written


def summary(run: Run) -> str:
    """A few lines: progress, batch plan, wall time, best and last evaluation."""
    last_step = max((r["step"] for r in run.rows), default=0)
    epochs = [r["train/epoch"] for r in run.rows if is_number(r.get("train/epoch"))]
    lines = [f"{run.name}: {last_step} steps" + (f" ({epochs[-1]:.2f} epochs)" if epochs else "")]
    i = run.info
    if i:
        lines.append(f"  {i['world_size']} ranks x micro-batch {i['micro_batch']} x accumulate {i['accumulate']} = "
                     f"effective batch {i['global_batch']}; {i['backend']} on {i['device']}")
    times = [r["time"] for r in run.rows if is_number(r.get("time"))]
    start = i.get("started_at") or (min(times) if times else None)
    if times and start:
        lines.append(f"  wall time {_duration(max(times) - start)} (to the last logged line)")
    train_loss = run.series("train/loss")[1]
    if train_loss:
        lines.append(f"  last train loss {train_loss[-1]:.4g}")
    if run.monitor:
        key, mode = run.monitor
        steps_, values = run.series(f"eval/{key}")
        if values:
            best = (max if mode == "max" else min)(range(len(values)), key=values.__getitem__)
            lines.append(f"  best eval/{key} {values[best]:.4g} at step {steps_[best]} ({mode})")
    last_eval = next((r for r in reversed(run.rows) if any(k.startswith("eval/") for k in r)), None)
    if last_eval:
        shown = "  ".join(f"{k[5:]} {v:.4g}" for k, v in last_eval.items() if k.startswith("eval/") and is_number(v))
        lines.append(f"  last eval (step {last_eval['step']}): {shown}")
    others = {k: v for r in run.rows for k, v in r.items() if "/" in k and not k.startswith(("train/", "eval/"))}
    if others:
        lines.append("  " + "  ".join(f"{k} {v:.4g}" for k, v in others.items() if is_number(v)))
    done = os.path.isfile(os.path.join(run.path, "final", "meta.json"))
    lines.append("  final model exported to final/" if done else "  no final model yet (running, stopped or failed)")
    return "\n".join(lines)


def report(paths: list[str], out: str | None) -> int:
    runs = [load_run(p) for p in paths]
    out_dir = out or (os.path.join(paths[0], "results", "report") if len(paths) == 1 else "report")
    for run in runs:
        print(summary(run))
    files = draw(runs, out_dir)
    print(f"ddplab: {len(files)} PNG files written to {out_dir} (all panels in {os.path.join(out_dir, 'report.png')})")
    return 0


def _plot_panel(ax, panel: Panel, runs: list[Run]) -> None:
    colours = [f"C{i % 10}" for i in range(len(runs))]
    short = [os.path.basename(run.name) for run in runs]  # legend: the folders' own names, if they differ
    names = short if len(set(short)) == len(short) else [run.name for run in runs]
    for run, colour, name in zip(runs, colours, names):
        for key in panel.keys:
            x, y = run.series(key)
            if not x:
                continue
            is_eval = key.startswith("eval/")
            label = key if len(runs) == 1 else f"{name} {key}"
            ax.plot(x, y, color=colour, linestyle="--" if is_eval else "-", marker="o" if is_eval else None,
                    markersize=3, linewidth=1.4, label=label)
    ax.set_title(panel.title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(panel.keys[0].split("/", 1)[-1] if len(panel.keys) == 1 else "loss")
    ax.grid(alpha=0.3)
    if ax.lines and (len(runs) > 1 or len(panel.keys) > 1):
        ax.legend(fontsize=7)


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def read_monitor(config_path: str) -> tuple[str, str] | None:
    """(checkpoint.monitor, checkpoint.mode) of a run's config.yaml: the metric its checkpoints were
    ranked by, or None."""
    try:
        from omegaconf import OmegaConf

        ck = OmegaConf.load(config_path).get("checkpoint", {})
    except Exception:  # no config, or not ours: the summary just leaves out the best value
        return None
    return (ck.get("monitor"), ck.get("mode", "max")) if ck.get("monitor") else None


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
