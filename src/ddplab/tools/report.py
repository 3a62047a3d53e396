"""`ddplab report RUN_DIR [RUN_DIR ...]`: a run's curves as PNG files and a short text summary (of a
sweep's folder: its trials, and the metric against each searched key, tools/sweeps.py).

It reads only files a run writes as it goes, so it works on a run still training; several runs are
overlaid. Panels: loss (evaluation dashed), each evaluation metric, learning rate, throughput, any
other training metric; `report.png` holds them all."""

import math
import os
import re
import tempfile
from dataclasses import dataclass

from ..checkpoint.objects import is_url
from ..errors import DdplabError
from ..train.logs import is_number
from ..train.summary import Run, load_run, record, summary
from .sweeps import draw_sweep, find_sweeps, sweep_lines

# an x-axis, not a curve
SKIPPED = {"train/epoch"}
TITLES = {"train/lr": "learning rate", "train/samples_per_s": "throughput (samples/s)"}
# each rank's own time per step (train/stragglers.py), from the 'ranks' records
RANKS_TITLE = "time per step by rank"


@dataclass
class Panel:
    title: str
    keys: list[str]  # metric keys drawn in this panel (train and eval loss share one)

    @property
    def filename(self):
        return re.sub(r"[^a-z0-9]+", "_", self.title.lower()).strip("_") + ".png"


def panels_for(runs: list[Run]) -> list[Panel]:
    keys = sorted(
        {
            k
            for run in runs
            for row in run.rows
            for k, v in row.items()
            if k.startswith(("train/", "eval/")) and k not in SKIPPED and is_number(v)
        }
    )
    loss = [k for k in ("train/loss", "eval/loss") if k in keys]
    panels = [Panel("loss", loss)] if loss else []
    panels += [Panel(k, [k]) for k in keys if k.startswith("eval/") and k != "eval/loss"]
    panels += [Panel(TITLES[k], [k]) for k in TITLES if k in keys]
    panels += [Panel(k, [k]) for k in keys if k.startswith("train/") and k not in TITLES and k != "train/loss"]
    if any(isinstance(row.get("ranks"), dict) for run in runs for row in run.rows):
        panels.append(Panel(RANKS_TITLE, ["ranks"]))
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
    for ax, panel in zip(axes.flat, panels, strict=False):
        _plot_panel(ax, panel, runs)
    for ax in list(axes.flat)[len(panels) :]:
        ax.remove()
    fig.suptitle(", ".join(run.name for run in runs), fontsize=10)
    written.append(_save(fig, os.path.join(out_dir, "report.png")))
    return written


def report(paths: list[str], out: str | None) -> int:
    if len(paths) == 1 and not is_url(paths[0]) and find_sweeps(paths[0]) == [paths[0]]:
        return _report_sweep(paths[0], out)
    with tempfile.TemporaryDirectory() as scratch:
        runs = []
        for path in paths:
            run = load_run(_readable(path, scratch))
            # named as the user named it (a run in a bucket was read into the scratch folder)
            run.label = path if is_url(path) else None
            runs.append(run)
        # a run in a bucket is drawn here, beside the others
        local = len(paths) == 1 and not is_url(paths[0])
        out_dir = out or (os.path.join(paths[0], "results", "report") if local else "report")
        for run in runs:
            print(summary(record(run)))
        files = draw(runs, out_dir)
    print(f"ddplab: {len(files)} PNG files written to {out_dir} (all panels in {os.path.join(out_dir, 'report.png')})")
    return 0


def _readable(path: str, scratch: str) -> str:
    """A run folder to read: a local one as it is; a run in object storage (s3://...) read into
    `scratch`, in a folder of its own name (the curves' legend)."""
    if not is_url(path):
        return path
    from ..checkpoint.mirror import RunMirror, run_of

    url = run_of(path)
    local = os.path.join(scratch, str(len(os.listdir(scratch))), *url.rstrip("/").split("/")[-2:])
    os.makedirs(local)
    RunMirror(url, local).fetch_for_reading()
    if not os.listdir(local):
        raise DdplabError(f"{url} holds no run (no run.json, metrics.jsonl or summary.json there)", "pass a run's URL")
    return local


def _report_sweep(folder: str, out: str | None) -> int:
    """A sweep: its trials best first, and the metric drawn against each searched key."""
    print("\n".join(sweep_lines(folder)))
    path = draw_sweep(folder, out or os.path.join(folder, "report"))
    print(f"ddplab: the metric against each searched key drawn in {path}")
    return 0


def _plot_panel(ax, panel: Panel, runs: list[Run]) -> None:
    if panel.title == RANKS_TITLE:
        _plot_ranks(ax, runs)
        return
    colours = [f"C{i % 10}" for i in range(len(runs))]
    # legend: the folders' own names, if they differ
    short = [os.path.basename(run.name) for run in runs]
    names = short if len(set(short)) == len(short) else [run.name for run in runs]
    for run, colour, name in zip(runs, colours, names, strict=False):
        for key in panel.keys:
            x, y = run.series(key)
            if not x:
                continue
            is_eval = key.startswith("eval/")
            label = key if len(runs) == 1 else f"{name} {key}"
            ax.plot(
                x,
                y,
                color=colour,
                linestyle="--" if is_eval else "-",
                # a series of one point is a line of no length: a marker shows it
                marker="o" if is_eval or len(x) == 1 else None,
                markersize=3,
                linewidth=1.4,
                label=label,
            )
    ax.set_title(panel.title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(panel.keys[0].split("/", 1)[-1] if len(panel.keys) == 1 else "loss")
    ax.grid(alpha=0.3)
    if ax.lines and (len(runs) > 1 or len(panel.keys) > 1):
        ax.legend(fontsize=7)


def _plot_ranks(ax, runs: list[Run]) -> None:
    """Per rank, its forward (solid) and its data wait (dashed) in ms per step; the step itself in
    black (every rank's step lasts as long as the slowest's). Of the first run that has them."""
    rows = next(rows for rows in ([r for r in run.rows if isinstance(r.get("ranks"), dict)] for run in runs) if rows)
    steps = [row["step"] for row in rows]
    world = max(len(row["ranks"]["step_s"]) for row in rows)
    # an elastic job's records have several sizes: a rank shows where it existed
    for rank in range(world):
        at = [(s, row["ranks"]) for s, row in zip(steps, rows, strict=True) if rank < len(row["ranks"]["step_s"])]
        colour = f"C{rank % 10}"
        forward = [1000 * figures["forward_s"][rank] for _, figures in at]
        data = [1000 * figures["data_s"][rank] for _, figures in at]
        ax.plot([s for s, _ in at], forward, color=colour, linewidth=1.2, label=f"rank {rank} forward")
        ax.plot([s for s, _ in at], data, color=colour, linewidth=1.2, linestyle="--", label=f"rank {rank} data wait")
    ax.plot(steps, [1000 * max(row["ranks"]["step_s"]) for row in rows], color="black", linewidth=1.4, label="step")
    ax.set_title(RANKS_TITLE)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ms per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2 if world > 4 else 1)


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
