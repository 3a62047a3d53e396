"""The files `ddplab eval` and `ddplab predict` write: the metrics as JSON, the predictions as CSV or
JSON lines. Rank 0 writes each whole or not at all (beside its path, then renamed onto it)."""

import contextlib
import csv
import json
import os
import sys

import torch

from ..checkpoint.objects import is_url
from ..checkpoint.store import resolve_checkpoint
from ..errors import DdplabError


def write_eval(metrics: dict, checkpoint: str, out: str | None) -> None:
    """Print the metrics as JSON and write them to `out` (default: next to the checkpoint)."""
    path = out or default_eval_path(checkpoint)
    _write_file(path, "the evaluation metrics", lambda f: json.dump(metrics, f, indent=1))
    print(json.dumps(metrics), flush=True)
    print(f"ddplab: evaluation metrics written to {path}", file=sys.stderr, flush=True)


def write_predictions(outputs: dict[str, torch.Tensor], path: str) -> None:
    """One row per input row, in input order: CSV (an output of several values per row is columns
    NAME_0, NAME_1, ...) or JSON lines. Floats keep the digits that tell them apart."""
    # output name -> rows, each a list of that output's values for one input row
    table = {name: _rows(values) for name, values in outputs.items()}
    count = len(next(iter(table.values())))
    if path.endswith(".jsonl"):
        lines = [json.dumps(_json_row(table, i)) + "\n" for i in range(count)]
        _write_file(path, "the predictions", lambda f: f.writelines(lines))
    else:
        header = [
            name if len(rows[0]) == 1 else f"{name}_{j}" for name, rows in table.items() for j in range(len(rows[0]))
        ]
        body = [[value for rows in table.values() for value in rows[i]] for i in range(count)]
        _write_file(path, "the predictions", lambda f: csv.writer(f).writerows([header, *body]))
    print(f"ddplab: {count} predictions written to {path}", file=sys.stderr, flush=True)


def _rows(values: torch.Tensor) -> list[list]:
    """A tensor of one output as rows of Python numbers; float32 rounded to the 9 digits it holds."""
    keep = values.dtype == torch.float64
    return [
        [x if isinstance(x, int) or keep else float(f"{x:.9g}") for x in row]
        for row in values.reshape(len(values), -1).tolist()
    ]


def _json_row(table: dict[str, list[list]], i: int) -> dict:
    """Row `i`: each output's value, or its list of values."""
    return {name: rows[i][0] if len(rows[i]) == 1 else rows[i] for name, rows in table.items()}


def _write_file(path: str, what: str, write) -> None:
    """Whole or not at all: written beside `path`, then renamed onto it."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(f"{path}.tmp", "w", newline="") as f:
            write(f)
        os.replace(f"{path}.tmp", path)
    except OSError as e:
        # a folder given as --out, a read-only run folder
        with contextlib.suppress(OSError):
            os.remove(f"{path}.tmp")
        raise DdplabError(
            f"cannot write {what} to {path} ({e.strerror})", "pass --out FILE in a writable folder"
        ) from None


def default_eval_path(checkpoint: str) -> str:
    """`<run>/results/eval-step-00000040.json` for a checkpoint of a run directory."""
    if is_url(checkpoint):
        # a run in object storage: the metrics stay on this machine, named after the run and step
        step_dir = resolve_checkpoint(checkpoint)
        run = step_dir.rstrip("/").split("/")[-3]
        return os.path.join("results", f"eval-{run}-{step_dir.rstrip('/').rsplit('/', 1)[-1]}.json")
    step_dir = os.path.abspath(resolve_checkpoint(checkpoint))
    if os.path.isfile(step_dir):
        step_dir = os.path.dirname(step_dir)
    run_dir = os.path.dirname(os.path.dirname(step_dir))
    return os.path.join(run_dir, "results", f"eval-{os.path.basename(step_dir)}.json")
