"""MLflow beside TensorBoard and W&B (log.mlflow=true): rank 0 logs the run's settings, its metrics
and the exported model; a resumed run continues the same MLflow run, its id kept in checkpoints.

Without log.mlflow_uri the tracking store is a SQLite file in the run folder (RUN/mlflow.db, its
artifacts in RUN/mlflow-artifacts), so nothing needs a server: `mlflow ui --backend-store-uri
sqlite:///RUN/mlflow.db` shows it."""

import logging
import os
import urllib.parse

from ..errors import ConfigError

# MLflow takes at most this many parameters, and this many metrics, in one call
_PARAMS_PER_CALL = 100
_METRICS_PER_CALL = 1000


# the stores an MLflow client can track to, by the URI's scheme
# the first four are offered in the line that refuses another (file: MLflow 3.7 on refuses it unasked)
_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "file", "databricks", "databricks-uc", "uc")
# seconds a tracking server has to answer before the run is refused (MLflow's own client retries for minutes)
SERVER_WAIT_S = 5.0


def check_tracking_uri(uri: str) -> None:
    """log.mlflow_uri, checked before any worker starts: a scheme MLflow knows (an unknown one was a
    49-line chained traceback), a SQLite file whose folder exists or can be made, a server that
    answers within seconds (a server that is down held the run for minutes)."""
    if not uri:
        return
    # a plain path is MLflow's file store, as file:PATH is
    scheme, _, rest = uri.partition(":") if ":" in uri else ("file", "", uri)
    if scheme == "file" and _file_store_refused():
        raise ConfigError(
            f"log.mlflow_uri={uri} is MLflow's file store, which this MLflow refuses (it is in maintenance mode)",
            "track to a SQLite file, e.g. log.mlflow_uri=sqlite:///PATH/mlflow.db, leave it empty for one in the run "
            "folder, or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store",
        )
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"log.mlflow_uri={uri} has the scheme {scheme!r}, which MLflow does not track to",
            f"use one of {', '.join(_SCHEMES[:4])}, … (e.g. sqlite:///PATH/mlflow.db), or leave it empty for "
            "a store in the run folder",
        )
    if scheme in ("sqlite", "file"):
        if scheme == "sqlite":
            # SQLAlchemy's: sqlite:///relative.db, sqlite:////absolute.db
            folder = os.path.dirname(rest[3:] if rest.startswith("///") else rest.lstrip("/"))
        else:
            # a URL's (file:///absolute) or a plain path
            folder = urllib.parse.urlparse(uri).path if ":" in uri else uri
        try:
            os.makedirs(folder or ".", exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"log.mlflow_uri={uri}: its folder {folder} cannot be made ({e.strerror})",
                "point it at a writable folder",
            ) from None
    elif scheme in ("http", "https"):
        _check_server(uri)


def _file_store_refused() -> bool:
    """Whether this MLflow refuses a file store: those that name MLFLOW_ALLOW_FILE_STORE do, unless it is set."""
    try:
        from mlflow import environment_variables
    except ImportError:
        return False
    allowed = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return allowed is not None and not allowed.get()


def _check_server(uri: str) -> None:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=SERVER_WAIT_S).close()
    except urllib.error.HTTPError:
        # it answered, if not to this
        return
    except (urllib.error.URLError, OSError) as e:
        why = getattr(e, "reason", e)
        raise ConfigError(
            f"the MLflow tracking server at {uri} does not answer within {SERVER_WAIT_S:g} s ({why})",
            "start it (mlflow server), correct log.mlflow_uri, or leave it empty for a store in the run folder",
        ) from None


class MlflowRun:
    """One ddplab run as one MLflow run."""

    def __init__(self, cfg, run_dir: str, run_id: str | None):
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise ConfigError(
                "log.mlflow=true but mlflow is not installed", "pip install 'ddplab[mlflow]' or set log.mlflow=false"
            ) from None
        # its lines about creating the store's tables
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        check_tracking_uri(cfg.log.mlflow_uri)
        uri = cfg.log.mlflow_uri or f"sqlite:///{os.path.abspath(run_dir)}/mlflow.db"
        self.client = MlflowClient(uri)
        if run_id:
            self.id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        name = cfg.log.mlflow_experiment or os.path.basename(os.path.dirname(run_dir))
        found = self.client.get_experiment_by_name(name)
        # a local store keeps its files beside it (else MLflow puts them in the working folder)
        local = uri.startswith("sqlite:///")
        artifacts = f"file://{os.path.dirname(uri[len('sqlite:///') :])}/mlflow-artifacts" if local else None
        experiment = found.experiment_id if found else self.client.create_experiment(name, artifacts)
        self.id = self.client.create_run(experiment, run_name=os.path.basename(run_dir)).info.run_id
        self._log_params(cfg)

    def _log_params(self, cfg) -> None:
        """Every setting, dotted (trainer.global_batch_size=32), as the run's parameters."""
        from mlflow.entities import Param
        from omegaconf import OmegaConf

        flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
        # (MLflow keeps at most 6000 characters of a value)
        params = [Param(key, str(value)[:6000]) for key, value in flat.items()]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(self.id, params=params[start : start + _PARAMS_PER_CALL])

    def log(self, rows: list[tuple[int, dict[str, float], float]]) -> None:
        """(step, {name: number}, when) lines, as metrics at their step and time."""
        from mlflow.entities import Metric

        metrics = [
            Metric(key, float(value), int(when * 1000), step)
            for step, named, when in rows
            for key, value in named.items()
        ]
        for start in range(0, len(metrics), _METRICS_PER_CALL):
            self.client.log_batch(self.id, metrics=metrics[start : start + _METRICS_PER_CALL])

    def log_model(self, folder: str) -> None:
        """The exported model (final/: safetensors and config) as the run's artifacts under model/."""
        self.client.log_artifacts(self.id, folder, artifact_path="model")
        self.exported = True

    def finish(self) -> None:
        """FINISHED once the model is exported; KILLED for a run that stopped before (a resume sets
        it running again)."""
        self.client.set_terminated(self.id, "FINISHED" if getattr(self, "exported", False) else "KILLED")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
