"""Where metrics go: metrics.jsonl always, TensorBoard, W&B and MLflow when enabled, the console and
log.txt on rank 0, a tqdm bar on local rank 0 of each node. One W&B run and one MLflow run per run,
re-attached on resume by the ids checkpoints keep (`ids()`)."""

import json
import math
import os
import sys
import time
from typing import Any

from ..errors import ConfigError


class RunLog:
    """All sinks behind one `log(step, metrics)` call. Create it on every rank; only rank 0 writes."""

    def __init__(self, run_dir: str, cfg, is_main: bool, ids: dict | None = None, earlier: list[str] = ()):
        """EARLIER: lines already shown on the console, said before this log opened, for log.txt."""
        self.run_dir = run_dir
        self.is_main = is_main
        self._jsonl = self._text = self._tb = self._wandb = self._mlflow = None
        ids = ids or {}
        self.wandb_id = ids.get("wandb_id")
        self.mlflow_id = ids.get("mlflow_id")
        if not is_main:
            return
        # Open for the whole run, line-buffered so a crash loses no finished line; close() closes them.
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)  # noqa: SIM115
        self._text = open(os.path.join(run_dir, "log.txt"), "a", buffering=1)  # noqa: SIM115
        self._text.writelines(line + "\n" for line in earlier)
        if cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if cfg.log.wandb:
            self._wandb = _start_wandb(cfg, run_dir, self.wandb_id)
            self.wandb_id = self._wandb.id
        if cfg.log.mlflow:
            from .trackers import MlflowRun

            self._mlflow = MlflowRun(cfg, run_dir, self.mlflow_id)
            self.mlflow_id = self._mlflow.id

    def ids(self) -> dict:
        """The trackers' run ids, for checkpoints: a resumed run logs on to the same runs."""
        return {"wandb_id": self.wandb_id, "mlflow_id": self.mlflow_id}

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        """Write one line of metrics, measured now."""
        self.log_lines([(step, metrics, round(time.time(), 3))], prefix)

    def log_lines(self, lines: list[tuple[int, dict[str, Any], float]], prefix: str = "") -> None:
        """Several (step, metrics, when) lines in one write: the training loop gets about a
        second's worth of log lines at a time (the heartbeat in intervals.py)."""
        if not self.is_main or not lines:
            return
        rows = []
        # the numbers of each line, for the trackers that take numbers only (MLflow: in one call)
        scalars = []
        for step, metrics, when in lines:
            named = {f"{prefix}{k}": v for k, v in metrics.items()}
            rows.append(json.dumps({"step": step, "time": when, **named}) + "\n")
            numbers = {key: value for key, value in named.items() if is_number(value)}
            for key, value in numbers.items():
                if self._tb is not None:
                    self._tb.add_scalar(key, value, step)
            if self._wandb is not None:
                self._wandb.log({**named, "step": step}, step=step)
            scalars.append((step, numbers, when))
        self._jsonl.write("".join(rows))
        if self._mlflow is not None:
            self._mlflow.log(scalars)

    def log_model(self, folder: str) -> None:
        """The exported model (final/), for the trackers that keep files (MLflow)."""
        if self._mlflow is not None:
            self._mlflow.log_model(folder)

    def ranks(self, step: int, figures: dict[str, list]) -> None:
        """Each rank's own figures (stragglers.py), in metrics.jsonl only: a list per field,
        indexed by rank, under the key 'ranks' (TensorBoard and W&B get the step's scalars only)."""
        if self.is_main:
            self._jsonl.write(json.dumps({"step": step, "time": round(time.time(), 3), "ranks": figures}) + "\n")

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        """Record the run's hyperparameters against its final metrics (TensorBoard's HParams tab)."""
        if self.is_main and self._tb is not None:
            clean = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
            self._tb.add_hparams(clean, {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".")

    @property
    def is_open(self) -> bool:
        """Whether it still writes (until close(), at the end of fit())."""
        return not self.is_main or self._text is not None

    def text(self, line: str) -> None:
        """A console line from rank 0, kept in log.txt as well."""
        if self.is_main:
            write_line(line)
            self._text.write(line + "\n")

    def close(self) -> None:
        sinks = (
            (self._jsonl, "close"),
            (self._text, "close"),
            (self._tb, "close"),
            (self._wandb, "finish"),
            (self._mlflow, "finish"),
        )
        for sink, end in sinks:
            if sink is not None:
                getattr(sink, end)()
        self._jsonl = self._text = self._tb = self._wandb = self._mlflow = None


def progress_bar(total: int, initial: int, enabled: bool, node: int | None):
    """A tqdm bar on local rank 0 of each node (steps/s, ETA, the last logged values); a disabled
    one, which costs nothing, everywhere else."""
    from tqdm import tqdm

    from ..distributed.console import RankLines

    # updates in place, not as lines
    stream = sys.__stderr__ if isinstance(sys.stderr, RankLines) else sys.stderr
    return tqdm(
        total=total,
        initial=initial,
        desc=f"node {node}" if node is not None else "train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=stream,
        disable=not enabled,
    )


def write_line(line: str) -> None:
    """Print a line without tearing an active progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def format_metrics(metrics: dict[str, Any]) -> str:
    return "  ".join(f"{key} {shown(key, value)}" for key, value in metrics.items())


def shown(key: str, value: Any) -> str:
    """A value as a log line or the progress bar shows it: the share of time waiting for data as a
    percentage (as the summary says it), any other number with 4 significant digits."""
    if not is_number(value):
        return str(value)
    if key.endswith("data_wait"):
        return f"{100 * value:.1f}%"
    return f"{value:.4g}"


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): what can be drawn, averaged or shown with :.4g."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _start_wandb(cfg, run_dir: str, run_id: str | None):
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "log.wandb=true but wandb is not installed", "pip install 'ddplab[wandb]' or set log.wandb=false"
        ) from None
    from omegaconf import OmegaConf

    return wandb.init(
        project=cfg.log.wandb_project,
        name=os.path.basename(run_dir),
        dir=run_dir,
        id=run_id,
        resume="allow",
        mode=cfg.log.wandb_mode,
        config=OmegaConf.to_container(cfg, resolve=True),
    )


def banner(name: str, rt, precision: str, plan, epoch_steps: int | None, total: int | None, run_dir: str) -> str:
    """The line a run starts with: where it runs, its batch plan, its length and its folder."""
    accumulate = str(plan.accumulate)
    if plan.chosen:
        accumulate += " (auto)"
    return (
        f"{name}: {rt.world_size} process(es) on {rt.device_name} ({rt.backend}, {precision}), "
        f"micro-batch {plan.micro_batch} per rank x accumulate {accumulate} x {rt.world_size} ranks = "
        f"global batch {plan.global_batch}; {epoch_steps or '?'} steps/epoch, {total or '?'} steps; run dir {run_dir}"
    )
