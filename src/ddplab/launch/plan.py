"""The run plan: everything a worker needs, worked out once, before any process starts.

The command line resolves the target, reads the config, applies the overrides and checks the batch plan;
the launcher hands it to every worker as JSON in `DDPLAB_PLAN` (under torchrun, srun or mpirun a process
makes its own). Without `run.name` the plan names the run after its time: restarted workers find it."""

import json
import os
from dataclasses import asdict, dataclass, field

from .. import environment
from ..checkpoint.objects import ObjectStore, check_location, is_url
from ..config import Config, load_config
from ..entries import load_entry
from ..errors import DdplabError
from ..train.rundir import new_run_name
from .targets import resolve


@dataclass
class RunPlan:
    command: str  # run | eval
    target: str  # as the user gave it
    entry: str | None = None  # a callable target: "module:Name" or "/abs/file.py:Name"
    script: str | None = None  # a plain script target: a path or a module name, run as __main__
    config: str | None = None  # a callable target's resolved config, as YAML
    args: list[str] = field(default_factory=list)  # a script's arguments, as given
    checkpoint: str | None = None  # eval: which checkpoint
    out: str | None = None  # eval: where the metrics go
    eval_set: str | None = None  # eval: one set of a dict of eval sets (default: all)
    input: str | None = None  # predict: what to predict on (a file, or a dataset's name)
    launcher_pid: int | None = None  # set by ddplab's launcher: workers end when it does
    stop_file: str | None = None  # where rank 0 notes a stop by a signal (launch/stops.py)
    shown_ranks: list[int] | None = None  # --local-ranks-filter: the local ranks whose stdout is shown

    def to_env(self) -> None:
        os.environ[environment.PLAN] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "RunPlan":
        text = os.environ.get(environment.PLAN)
        if not text:
            raise DdplabError("this process was started without a run plan", "start it with `ddplab run`")
        return cls(**json.loads(text))

    def load(self):
        """The callable and its typed config (both None for a plain script); loaded once per process."""
        if self.entry is None:
            return None, None
        if getattr(self, "_loaded", None) is None:
            obj = load_entry(self.entry)
            self._loaded = obj, load_config(getattr(obj, "config_class", Config), yaml_text=self.config)
        return self._loaded


def check_local_copy(folder: str) -> None:
    """run.local_dir, where a run in a bucket is written first: a folder this process can write."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not os.path.isdir(existing) else "cannot be written"
        raise DdplabError(
            f"run.local_dir={folder}: {existing} {what}, and a run in object storage is written there first",
            "give run.local_dir a folder this machine can write",
        )


def make_plan(command: str, target: str, rest: list[str], config_file: str | None = None, **given) -> RunPlan:
    """Resolve `target` and its settings (key=value items of `rest`) into a plan (`given`: eval's and predict's
    fields); a user mistake is a DdplabError here, once, instead of once per started worker."""
    from omegaconf import OmegaConf

    from ..config import split_overrides

    found = resolve(target)
    if found.is_script:
        if command != "run":
            raise DdplabError(
                f"ddplab {command} needs an Experiment class, and {target} is a plain script",
                "pass NAME or file.py:Class",
            )
        return RunPlan(command, target, script=found.script or found.module, args=list(rest))
    overrides, extra = split_overrides(rest)
    if extra:
        raise DdplabError(f"unexpected arguments {extra}", "give settings as key=value, e.g. trainer.max_steps=100")
    cfg = load_config(getattr(found.obj, "config_class", Config), overrides, config_file)
    if "run" in cfg and cfg.run.name is None:
        cfg.run.name = new_run_name()
    if "run" in cfg:
        check_location("run.dir", cfg.run.dir)
        if is_url(cfg.run.dir):
            check_location("run.local_dir", cfg.run.local_dir, local_only=True)
    if command == "run" and "run" in cfg and is_url(cfg.run.dir):
        check_local_copy(cfg.run.local_dir)
        # a bucket that does not exist or cannot be written is known before any worker starts
        ObjectStore(cfg.run.dir, cfg.run.storage_timeout_s).check_writable()
    out = os.path.abspath(given.pop("out")) if given.get("out") else None
    plan = RunPlan(command, target, entry=found.entry, config=OmegaConf.to_yaml(cfg), out=out, **given)
    # this process has both already
    plan._loaded = found.obj, cfg
    return plan
