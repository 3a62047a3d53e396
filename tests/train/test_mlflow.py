"""log.mlflow=true: rank 0 logs settings, metrics and the exported model to MLflow, and a run killed
and resumed goes on logging to the same MLflow run. Read back with MLflow's own client."""

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from ddplab.checkpoint.store import list_checkpoints, load_state
from helpers import clean_env, ddplab, ddplab_here, metrics_rows

EXP = "tests/fixtures/experiments.py:Classifier"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_killed_and_resumed_run_is_one_mlflow_run_with_every_step_once_per_log_line(tmp_path):
    args = [
        "run", EXP, "-n", "2", f"run.dir={tmp_path}", "run.name=tracked", "trainer.progress=false",
        "log.tensorboard=false", "log.mlflow=true", "trainer.max_steps=16", "trainer.log_every=2",
        "trainer.eval_every=8", "trainer.checkpoint_every=4", "model.hidden=12",
    ]  # fmt: skip
    # step 8's checkpoint is still being written when rank 1 dies at step 11: rank 0's teardown
    # waits for it, and the agent's SIGTERM after rank 1's death lands in that teardown
    first = ddplab_here(*args, "fault.die_at_step=11", "checkpoint.async_save=true", "fault.slow_save_s=4")
    assert first.returncode != 0
    run = tmp_path / "classifier" / "tracked"
    client = MlflowClient(f"sqlite:///{run}/mlflow.db")
    (killed,) = client.search_runs(client.get_experiment_by_name("classifier").experiment_id)
    # rank 0 ended it as the job failed, before any export
    assert killed.info.status == "KILLED"

    again = ddplab_here(*args, "fault.die_at_step=11")
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stdout + again.stderr
    (tracked,) = client.search_runs(client.get_experiment_by_name("classifier").experiment_id)
    assert tracked.info.run_id == killed.info.run_id and tracked.info.run_name == "tracked"
    assert tracked.info.status == "FINISHED"
    assert tracked.data.params["trainer.max_steps"] == "16" and tracked.data.params["model.hidden"] == "12"

    # each logged value once at its step, as metrics.jsonl has it last (rank 0 alone logs: one
    # rank more would log each step twice)
    lines = metrics_rows(run)
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        logged = {row["step"]: row[key] for row in lines if key in row}
        history = client.get_metric_history(tracked.info.run_id, key)
        by_step = {}
        for metric in sorted(history, key=lambda m: m.timestamp):
            by_step[metric.step] = metric.value
        assert by_step == pytest.approx(logged) and len(logged) >= 2, key
        # a step logged before the kill and again after it is there twice, never more
        assert len(history) == sum(key in row for row in lines)

    # the exported model, as the run's artifacts
    artifacts = [a.path for a in client.list_artifacts(tracked.info.run_id, "model")]
    assert "model/model.safetensors" in artifacts
    local = client.download_artifacts(tracked.info.run_id, "model/model.safetensors", str(tmp_path))
    assert Path(local).read_bytes() == (run / "final" / "model.safetensors").read_bytes()
    # the id a resume re-attaches to is in every checkpoint
    last = list_checkpoints(str(run / "checkpoints"))[-1]
    assert load_state(last.path, map_location=torch.device("cpu"))["loggers"]["mlflow_id"] == tracked.info.run_id


def test_log_mlflow_without_mlflow_installed_is_one_line(tmp_path):
    """The extra is optional: without it, log.mlflow=true is refused before training, in one line."""
    hidden = tmp_path / "hide" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed')\n")
    res = ddplab(
        "run", EXP, f"run.dir={tmp_path}", "log.mlflow=true", "trainer.max_steps=2", "trainer.progress=false",
        env=clean_env(PYTHONPATH=str(hidden.parent)),
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "log.mlflow=true but mlflow is not installed; pip install 'ddplab[mlflow]'" in lines[0]
