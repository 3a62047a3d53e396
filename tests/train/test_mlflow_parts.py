"""log.mlflow's parts (train/trackers.py) in this process, read back with MLflow's own client: the
store beside the run, the experiment and run names, every setting as a parameter, metrics at their
steps and times in batches MLflow accepts, the exported model, and a resumed run that continues the
same MLflow run. A killed two-rank run is test_mlflow.py's; these are the fast tests the mutation
run of the module uses (scripts/mutation.py)."""

import sys

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

import ddplab
from ddplab.errors import ConfigError
from ddplab.train import trackers
from ddplab.train.trackers import MlflowRun
from fixtures.experiments import Cfg
from helpers import ddplab_here, free_port

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _cfg(*overrides):
    return ddplab.load_config(Cfg, ["log.mlflow=true", "trainer.max_steps=7", "model.hidden=12", *overrides])


def _run_dir(tmp_path, name="first"):
    folder = tmp_path / "classifier" / name
    folder.mkdir(parents=True)
    return str(folder)


def test_a_run_is_an_mlflow_run_of_its_experiment_with_every_setting_and_its_metrics(tmp_path, monkeypatch):
    # small batches, so that a run's parameters and metrics take several calls
    monkeypatch.setattr(trackers, "_PARAMS_PER_CALL", 7)
    monkeypatch.setattr(trackers, "_METRICS_PER_CALL", 3)
    run_dir = _run_dir(tmp_path)
    tracked = MlflowRun(_cfg(), run_dir, None)
    tracked.log([(2, {"train/loss": 0.5, "train/lr": 0.1}, 1000.25), (4, {"train/loss": 0.25}, 1001.5)])
    # seven in one call: three calls of three, three and one
    tracked.log([(4, {"eval/accuracy": 0.75}, 1002.0), *[(6, {f"eval/m{i}": float(i)}, 1003.0) for i in range(6)]])
    tracked.finish()

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    experiment = client.get_experiment_by_name("classifier")
    assert experiment.artifact_location == f"file://{run_dir}/mlflow-artifacts"
    (run,) = client.search_runs(experiment.experiment_id)
    assert run.info.run_id == tracked.id and run.info.run_name == "first"
    # stopped before any export
    assert run.info.status == "KILLED"
    params = run.data.params
    assert params["trainer.max_steps"] == "7" and params["model.hidden"] == "12" and params["log.mlflow"] == "True"
    every = trackers._flatten(OmegaConf.to_container(_cfg(), resolve=True))
    assert set(params) == set(every) and len(every) > 7 * 3
    history = [(m.step, m.value, m.timestamp) for m in client.get_metric_history(tracked.id, "train/loss")]
    assert history == [(2, 0.5, 1000250), (4, 0.25, 1001500)]
    assert [(m.step, m.value) for m in client.get_metric_history(tracked.id, "eval/accuracy")] == [(4, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(tracked.id, "train/lr")] == [(2, 0.1)]
    assert [client.get_metric_history(tracked.id, f"eval/m{i}")[0].value for i in range(6)] == [
        float(i) for i in range(6)
    ]


def test_a_resumed_run_continues_the_same_mlflow_run_and_an_exported_model_finishes_it(tmp_path):
    run_dir = _run_dir(tmp_path)
    first = MlflowRun(_cfg(), run_dir, None)
    first.log([(1, {"train/loss": 1.0}, 1.0)])
    first.finish()
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")
    (final / "config.yaml").write_text("model: {}\n")

    resumed = MlflowRun(_cfg(), run_dir, first.id)
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    assert resumed.id == first.id and client.get_run(first.id).info.status == "RUNNING"
    resumed.log([(2, {"train/loss": 0.5}, 2.0)])
    resumed.log_model(str(final))
    resumed.finish()
    run = client.get_run(first.id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(first.id, "train/loss")] == [(1, 1.0), (2, 0.5)]
    assert sorted(a.path for a in client.list_artifacts(first.id, "model")) == [
        "model/config.yaml",
        "model/model.safetensors",
    ]
    # one experiment, one run
    assert len(client.search_runs(client.get_experiment_by_name("classifier").experiment_id)) == 1


def test_runs_share_an_experiment_by_name_and_a_store_given_by_uri(tmp_path):
    store = f"sqlite:///{tmp_path}/shared.db"
    cfg = _cfg(f"log.mlflow_uri={store}", "log.mlflow_experiment=tuning")
    a = MlflowRun(cfg, _run_dir(tmp_path, "a"), None)
    b = MlflowRun(cfg, _run_dir(tmp_path, "b"), None)
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("tuning")
    runs = client.search_runs(experiment.experiment_id)
    assert sorted(r.info.run_name for r in runs) == ["a", "b"] and a.id != b.id
    # a SQLite store keeps its files beside it, wherever it is
    assert experiment.artifact_location == f"file://{tmp_path}/mlflow-artifacts"
    assert not (tmp_path / "classifier" / "a" / "mlflow.db").exists()


def test_nested_settings_are_dotted():
    assert trackers._flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": "x"}) == {"a.b.c": 1, "a.d": [1, 2], "e": "x"}


def test_without_mlflow_installed_it_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError) as refused:
        MlflowRun(_cfg(), _run_dir(tmp_path), None)
    assert refused.value.cause == "log.mlflow=true but mlflow is not installed"
    assert refused.value.fix == "pip install 'ddplab[mlflow]' or set log.mlflow=false"


def test_batches_are_as_large_as_mlflow_takes_in_one_call():
    """Fewer calls per heartbeat, and never one MLflow refuses (its limits, read from MLflow)."""
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

    assert trackers._PARAMS_PER_CALL == MAX_PARAMS_TAGS_PER_BATCH
    assert trackers._METRICS_PER_CALL == MAX_METRICS_PER_BATCH


def test_a_tracking_uri_is_checked_in_one_line_before_anything_starts(tmp_path):
    in_a_file = tmp_path / "a-file"
    in_a_file.write_text("")
    refused = {
        "foo://x": "has the scheme 'foo', which MLflow does not track to",
        f"sqlite:///{in_a_file}/sub/mlflow.db": "cannot be made (Not a directory)",
        # a port nobody listens on: refused at once, not after MLflow's minutes of retries
        f"http://127.0.0.1:{free_port()}": "does not answer within 5 s",
    }
    for uri, said in refused.items():
        with pytest.raises(ConfigError) as e:
            trackers.check_tracking_uri(uri)
        assert said in str(e.value) and "\n" not in str(e.value), uri
    made = tmp_path / "new" / "folder"
    trackers.check_tracking_uri(f"sqlite:///{made}/mlflow.db")
    assert made.is_dir()
    trackers.check_tracking_uri("")


def _mlflow_accepts(uri: str) -> bool:
    """MLflow's own verdict on a tracking URI: whether its client can list experiments there."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).search_experiments()
    except MlflowException:
        return False
    return True


@pytest.mark.parametrize("allowed", ["false", "true"])
def test_the_check_refuses_a_file_store_exactly_when_mlflow_does(tmp_path, monkeypatch, allowed):
    # the file store, as a URL and as a plain path; MLflow 3.7 on refuses it unless allowed
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allowed)
    for uri in (f"file://{tmp_path}/as-url", str(tmp_path / "as-path"), f"sqlite:///{tmp_path}/db/mlflow.db"):
        try:
            trackers.check_tracking_uri(uri)
            refused = None
        except ConfigError as e:
            refused = str(e)
        assert (refused is None) == _mlflow_accepts(uri), (uri, refused)
        if refused:
            assert "MLflow's file store" in refused and "sqlite:///" in refused and "\n" not in refused
    # the folder a file URL names, not one under the working folder
    assert allowed != "true" or (tmp_path / "as-url").is_dir()


@pytest.mark.timeout(60)
def test_a_tracker_that_cannot_work_stops_the_launch_before_any_worker(tmp_path):
    res = ddplab_here(
        "run", "tests/fixtures/experiments.py:Classifier", "-n", "2", f"run.dir={tmp_path}", "log.mlflow=true",
        "log.mlflow_uri=foo://x",
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "scheme 'foo'" in lines[0], res.stderr
    assert not any(tmp_path.iterdir())
