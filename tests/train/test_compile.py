"""trainer.compile with real gloo processes: the compiled DDP run trains what the uncompiled run
trains, with gradient accumulation (no_sync) on; a killed compiled run resumes; checkpoints and
final/ keep plain parameter names, so they load into an uncompiled model and back."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import clean_env, ddplab, ddplab_here

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "trainer.accumulate=2",
    "trainer.checkpoint_every=4",
    "trainer.max_steps=12",
]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _run(tmp_path, name, *args, n=2, env=None):
    res = ddplab_here("run", EXP, "-n", str(n), f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *args, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _state(tmp_path, name, step=12):
    return torch.load(
        tmp_path / "classifier" / name / "checkpoints" / f"step-{step:08d}" / "state.pt", weights_only=True
    )


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_a_compiled_run_trains_resumes_after_a_kill_and_keeps_plain_names(tmp_path):
    _run(tmp_path, "eager")
    eager = _state(tmp_path, "eager")["models"]["net"]
    out = _run(tmp_path, "compiled", "trainer.compile=true", "fault.die_at_step=7", "--max-restarts", "1").stdout
    assert (tmp_path / "classifier" / "compiled" / "died-once").exists()
    assert "restarted after a failure (restart 1" in out and "at step 4" in out
    results = torch.load(tmp_path / "classifier" / "compiled" / "results" / "final.pt")
    # compiled, around DDP: wrap, then compile
    assert results["called_through"] == ["OptimizedModule", "DDP"]
    # trainer.deterministic=warn reaches inductor too
    assert results["inductor_deterministic"] is True
    compiled = _state(tmp_path, "compiled")["models"]["net"]
    # no _orig_mod.
    assert list(compiled) == list(eager) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert _close(compiled, eager)
    final = load_file(tmp_path / "classifier" / "compiled" / "final" / "model.safetensors")
    assert sorted(final) == sorted(eager) and _close(final, compiled)

    # An eager run continued with compile on, and the compiled run's checkpoint evaluated by `ddplab eval`.
    _run(tmp_path, "switched", "trainer.max_steps=6")
    assert "at step 6" in _run(tmp_path, "switched", "trainer.compile=max-autotune-no-cudagraphs").stdout
    assert _close(_state(tmp_path, "switched")["models"]["net"], eager)
    run_dir = tmp_path / "classifier" / "compiled"
    res = ddplab("eval", EXP, "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir), timeout=120)
    # (the run's config says trainer.compile=true: evaluation runs the plain networks all the same)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["loss"] == pytest.approx(
        _state(tmp_path, "compiled")["eval_metrics"]["loss"], rel=1e-6
    )


def test_a_network_compiled_in_build_keeps_plain_names(tmp_path):
    _run(tmp_path, "in_build", "model.compile_in_build=true", "trainer.max_steps=4", n=1)
    assert torch.load(tmp_path / "classifier" / "in_build" / "results" / "final.pt")["inductor_deterministic"] is True
    assert list(_state(tmp_path, "in_build", 4)["models"]["net"]) == ["0.weight", "0.bias", "3.weight", "3.bias"]


def test_compile_where_it_cannot_run_is_one_line():
    res = ddplab_here(
        "run",
        EXP,
        "-n",
        "2",
        "trainer.compile=true",
        "trainer.progress=false",
        env=clean_env(CXX="no-such-compiler"),
    )
    assert res.returncode == 2, res.stderr
    # both ranks meet it; the rank named is the first to record it (the other may be stopped before it does)
    [line] = res.stderr.strip().splitlines()
    said, _, rank = line.rpartition(" (rank ")
    assert said == (
        "ddplab: error: trainer.compile=true cannot run here: No working C++ compiler found in "
        "torch._inductor.config.cpp.cxx: (None, 'no-such-compiler'); set trainer.compile=false, or install what it "
        "names"
    )
    assert rank in ("0)", "1)"), line
