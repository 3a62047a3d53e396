"""`ddplab.run` from a notebook, executed by a real Jupyter kernel (nbclient): an experiment defined
in a cell trains on 2 processes with its output in the cell and its result back in the kernel; a
failing run is one line; an interrupted cell stops the run, which saves and ends every worker; the
kernel holds no process group and can run again."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
from nbclient import NotebookClient

import ddplab
from ddplab.entries import PAYLOAD_SUFFIX, load_entry
from ddplab.errors import DdplabError
from ddplab.launch.notebook import LastError, _copy
from helpers import budget, summary_of

DEFINE = """
import torch, ddplab
from torch import nn
from torch.utils.data import TensorDataset

def points(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())

class Cell(ddplab.Experiment):
    def build(self):
        self.net = nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train_dataset(self):
        return points(256, 0)

    def eval_dataset(self):
        return points(64, 1)

    def training_step(self, batch):
        x, y = batch
        if self.cfg.seed == 13:
            raise ValueError("a bug in the notebook's own training_step")
        if self.cfg.seed == 14:
            time.sleep(0.05)
        return nn.functional.cross_entropy(self.net(x), y)

    def evaluation_step(self, batch):
        x, y = batch
        return {"accuracy": (self.net(x).argmax(1) == y).float()}

import time
QUIET = ["run.dir=runs", "trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
"""
TRAIN = """
result = ddplab.run(Cell, n=2, overrides=[*QUIET, "trainer.max_steps=8", "run.name=two", "trainer.progress=true"])
print("METRICS", result.metrics, result.run_dir)
"""
FUNCTION = """
import torch.distributed as dist
print("WORLD", ddplab.run(lambda cfg: dist.get_world_size() * 10, n=2).returned)
"""
FAIL = """ddplab.run(Cell, n=2, overrides=[*QUIET, "trainer.max_steps=8", "seed=13", "run.name=fails"])"""
LONG = """ddplab.run(Cell, n=2, overrides=[*QUIET, "trainer.max_steps=100000", "seed=14", "run.name=long"])"""
AFTER = """print("GROUP", dist.is_initialized())"""


def _notebook():
    cells = [nbformat.v4.new_code_cell(code) for code in (DEFINE, TRAIN, FUNCTION, FAIL, LONG, AFTER)]
    for cell in cells[3:5]:
        cell.metadata["tags"] = ["raises-exception"]
    return nbformat.v4.new_notebook(cells=cells)


def _text(cell, name=None) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and name in (None, o.name))


def _interrupt_when_training(client, run_dir, started):
    """Interrupt the kernel once the long run has logged a step (as a user would, watching it)."""
    deadline = time.monotonic() + budget(120)
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    started.append(time.monotonic())
    # what the notebook's interrupt button does: SIGINT to the kernel
    os.kill(client.km.provisioner.process.pid, signal.SIGINT)


def _started_in(folder, but: int) -> list[int]:
    """The processes working in `folder` (the kernel's launcher and workers start there), but one."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and int(entry.name) != but and os.readlink(entry / "cwd") == str(folder):
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_notebook_trains_on_two_processes_fails_in_one_line_and_stops_when_interrupted(tmp_path):
    nb = _notebook()
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index in range(4):
            client.execute_cell(nb.cells[index], index)
        started: list[float] = []
        watcher = threading.Thread(
            target=_interrupt_when_training, args=(client, tmp_path / "runs" / "cell" / "long", started)
        )
        watcher.start()
        client.execute_cell(nb.cells[4], 4)
        stopped = time.monotonic()
        watcher.join()
        left = _started_in(tmp_path, but=client.km.provisioner.process.pid)
        client.execute_cell(nb.cells[5], 5)
    _, train, function, fail, long, after = nb.cells

    # the run's output in the cell, its metrics back in the kernel
    out = _text(train)
    assert "2 process(es) on cpu" in out and "finished; its files are in" in out, out
    assert "resume: ddplab.run(Cell, n=2, config=" in out
    # the progress bar too, redrawn in place
    assert "\rtrain: 100%" in out and "8/8" in out
    summary = summary_of(tmp_path / "runs" / "cell" / "two")
    assert f"METRICS {summary['last_eval']} {tmp_path / 'runs' / 'cell' / 'two'}" in out
    assert summary["last_eval"]["accuracy"] > 0.5
    assert "WORLD 20" in _text(function)

    # a bug in the notebook's code: its traceback in the cell's output, then ddplab's one line
    errors = [o for o in fail.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "LaunchError", fail.outputs
    assert errors[0].traceback == ["ddplab: error: the run of Cell failed (exit code 1); its output above says why"]
    assert "ValueError: a bug in the notebook's own training_step" in _text(fail, "stderr")

    # interrupted: the run saved where it stopped, no worker is left, the kernel goes on
    assert [o.ename for o in long.outputs if o.output_type == "error"] == ["KeyboardInterrupt"]
    assert stopped - started[0] < 60
    said = next(line for line in _text(long, "stderr").splitlines() if line.startswith("ddplab: stopped by SIGTERM"))
    step = int(said.split("a checkpoint was saved at step ")[1].split()[0])
    assert (tmp_path / "runs" / "cell" / "long" / "checkpoints" / f"step-{step:08d}").is_dir()
    # and how to continue it, as the session would call it
    assert said.endswith("To continue: ddplab.run(Cell, n=2, overrides=[" + ", ".join(
        repr(s) for s in ["run.dir=runs", "trainer.progress=false", "log.tensorboard=false",
                          "trainer.global_batch_size=32", "trainer.max_steps=100000", "seed=14", "run.name=long"]
    ) + "])"), said  # fmt: skip
    assert not left
    assert "GROUP False" in _text(after)


def _holding_a_lock() -> type:
    """An experiment defined where workers cannot import it (a function's own, as a notebook's
    classes are), so it travels by value, and holding a lock, which nothing can pickle."""

    class Holds(ddplab.Experiment):
        guard = threading.Lock()

    return Holds


def _say(call) -> str:
    started = time.monotonic()
    with pytest.raises(DdplabError) as refused:
        call()
    assert time.monotonic() - started < 10
    return str(refused.value)


@pytest.mark.timeout(60)
def test_what_cannot_run_is_refused_in_the_session_in_one_line_before_any_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    holds = _holding_a_lock()
    assert _say(lambda: ddplab.run(holds, n=0)).startswith("n=0: the number of processes must be a whole number")
    assert _say(lambda: ddplab.run(holds, n=2)).startswith(
        "Holds cannot be sent to the worker processes: cloudpickle cannot pickle it (TypeError: cannot pickle "
        "'_thread.lock' object)"
    )
    assert "trainer.max_stepz" in _say(lambda: ddplab.run(holds, n=2, overrides=["trainer.max_stepz=3"]))
    # a string is one setting
    assert "trainer.max_stepz" in _say(lambda: ddplab.run(holds, n=2, overrides="trainer.max_stepz=3"))
    assert "neither an Experiment nor a function" in _say(lambda: ddplab.run(torch.nn.Linear, n=2))
    # two counts of processes: n, and one among the launch flags, however written
    for launch in (["-n", "3"], ["--nproc-per-node=3"], "--max-restarts 1 -n 3"):
        said = _say(lambda launch=launch: ddplab.run(holds, n=2, launch=launch))
        assert said.startswith("n=2 and launch's ") and "3 both give the number of processes" in said, said
    assert not list(tmp_path.iterdir())


def _trains() -> type:
    class Trains(ddplab.Experiment):
        def build(self):
            self.net = torch.nn.Linear(2, 2)
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

    return Trains


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_what_the_launcher_refuses_is_the_same_one_line_in_the_session(tmp_path, monkeypatch, capsys):
    """More processes than the machine allows, or a plan no world size of that count can keep: the
    launcher's refusal, before any worker starts, is the error the session raises, and only that
    (the copied output of the launcher does not show it a second time)."""
    monkeypatch.chdir(tmp_path)
    if not torch.cuda.is_available():
        said = _say(lambda: ddplab.run(_trains(), n=2, overrides=["dist.backend=nccl"]))
        assert said.startswith("dist.backend=nccl needs CUDA GPUs"), said
        assert "needs CUDA GPUs" not in capsys.readouterr().err
    said = _say(lambda: ddplab.run(_trains(), n=3, overrides=["trainer.global_batch_size=32"]))
    assert said.startswith("trainer.global_batch_size=32 does not divide into 3 ranks"), said
    assert "does not divide" not in capsys.readouterr().err


def test_a_class_whose_module_the_workers_cannot_import_is_one_line(tmp_path, monkeypatch):
    """Modules travel by name: one that exists in the session only cannot be loaded in a worker."""
    (tmp_path / "only_here.py").write_text("import ddplab\n\nclass Far(ddplab.Experiment):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here

    payload = tmp_path / ("target" + PAYLOAD_SUFFIX)
    payload.write_bytes(cloudpickle.dumps(only_here.Far))
    (tmp_path / "only_here.py").unlink()
    monkeypatch.delitem(sys.modules, "only_here")
    with pytest.raises(DdplabError, match=r"cannot be loaded in the worker processes \(ModuleNotFoundError"):
        load_entry(f"{payload}:Far")


SESSION = """
import sys, torch, ddplab
from torch import nn
from torch.utils.data import TensorDataset
from ddplab.config import load_config

class Cell(ddplab.Experiment):
    def build(self):
        self.net = nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train_dataset(self):
        x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, (x.sum(1) > 0).long())

    def training_step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

settings = ["run.dir=runs", "run.name=same", "trainer.progress=false", "log.tensorboard=false",
            "trainer.global_batch_size=32", "trainer.checkpoint_every=4"]
# first in the session's own process, then on 2 processes: the same run, continued
Cell(load_config(Cell.config_class, [*settings, "trainer.max_steps=4"])).fit()
ddplab.run(Cell, n=2, overrides=[*settings, "trainer.max_steps=8"])
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_trained_in_the_session_continues_on_several_processes(tmp_path):
    """The same class, in the session and sent to workers, is the same experiment: its run folder
    is continued, not refused as another experiment's."""
    (tmp_path / "session.py").write_text(SESSION)
    res = subprocess.run([sys.executable, "session.py"], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed from" in res.stdout and "at step 4" in res.stdout
    summary = summary_of(tmp_path / "runs" / "cell" / "same")
    assert summary["step"] == 8 and summary["plan"]["world_size"] == 2


OWN_SETTINGS = """
import json, torch, ddplab
from dataclasses import dataclass, field
from torch import nn
from torch.utils.data import TensorDataset

@dataclass
class Model:
    width: int = ddplab.setting(4, "the hidden layer's width")

@dataclass
class Settings(ddplab.Config):
    model: Model = field(default_factory=Model)

class Cell(ddplab.Experiment):
    config_class = Settings

    def build(self):
        self.net = nn.Sequential(nn.Linear(4, self.cfg.model.width), nn.Linear(self.cfg.model.width, 2))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def train_dataset(self):
        x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, (x.sum(1) > 0).long())

    def eval_dataset(self):
        return self.train_dataset()

    def training_step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def evaluation_step(self, batch):
        x, y = batch
        return {"accuracy": (self.net(x).argmax(1) == y).float()}

quiet = ["trainer.progress=false", "log.tensorboard=false", "trainer.max_steps=4", "trainer.global_batch_size=32"]
# the defaults: no run.dir, no run.name
first = ddplab.run(Cell, n=2, overrides=[*quiet, "model.width=6"], launch="--max-restarts 0")

# the cell run again with the class changed: its settings are the new class's
@dataclass
class Model:
    depth: int = ddplab.setting(1, "hidden layers")

@dataclass
class Settings(ddplab.Config):
    model: Model = field(default_factory=Model)

class Cell(Cell):
    config_class = Settings

    def build(self):
        self.net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(self.cfg.model.depth)], nn.Linear(4, 2))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

second = ddplab.run(Cell, n=2, overrides=[*quiet, "model.depth=3"])
print("RESULTS", json.dumps([[r.run_dir, r.metrics] for r in (first, second)]))
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_sessions_own_settings_travel_with_defaults_and_a_second_launch_uses_the_class_as_it_is_now(tmp_path):
    """A settings dataclass defined in the session travels by value (cloudpickle copied dataclasses'
    MISSING into every field: each default was lost and OmegaConf failed in the launcher); run with
    its defaults (no run.dir, no run.name), the result names a folder that exists and holds the
    metrics it returns; a session that redefines the class and runs again gets the new settings."""
    (tmp_path / "session.py").write_text(OWN_SETTINGS)
    res = subprocess.run([sys.executable, "session.py"], cwd=tmp_path, capture_output=True, text=True, timeout=130)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(res.stdout.split("RESULTS ", 1)[1])
    for (run_dir, metrics), setting in zip(results, ["width: 6", "depth: 3"], strict=True):
        run = Path(run_dir)
        assert run.parent == tmp_path / "runs" / "cell" and run.is_dir(), run_dir
        assert summary_of(run)["last_eval"] == metrics and metrics["accuracy"] > 0
        assert f"model:\n  {setting}\n" in (run / "config.yaml").read_text()
    assert results[0][0] != results[1][0]


@pytest.mark.parametrize("last", [True, False])
def test_the_copied_output_keeps_only_the_last_error_line_however_long_the_bar_redraws(last):
    """A run's stderr is copied as it comes; the session keeps its last 'ddplab: error:' line alone,
    not the run's whole output (a progress bar redraws with carriage returns and never ends a line).
    That line, when nothing follows it (the launcher's own last line), is held back from the copy:
    the session raises it, and the cell would show it twice."""
    read, write = os.pipe()
    bar = "".join(f"\rtrain: {i:3d}%|" for i in range(100))
    ending = "ddplab: error: the last one; its fix\n"
    text = f"ddplab: error: first\n{bar}\n" + (ending if last else f"{ending}[rank 1/2] x\n{bar}")
    copied, said = io.StringIO(), LastError()
    reader = threading.Thread(target=_copy, args=(os.fdopen(read, "rb"), copied, said))
    reader.start()
    with os.fdopen(write, "wb") as pipe:
        for start in range(0, len(text), 7):
            pipe.write(text[start : start + 7].encode())
            pipe.flush()
    reader.join(timeout=10)
    assert copied.getvalue() == (text.removesuffix(ending) if last else text)
    assert said.line == "ddplab: error: the last one; its fix" and said.shown is not last
