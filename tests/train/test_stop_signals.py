"""A stop signal is a promise to save, wherever it lands: SIGTERM to a worker in a step, in an
evaluation, in a checkpoint's save (periodic checkpoints on) ends the job at the next safe point
with a checkpoint and exit 143; one that lands while the run is ending (on_fit_end), whether sent to
a worker or to the launcher, leaves a finished run and exit 0, never "nothing was saved"."""

import os
import signal
import time

import pytest

from ddplab import environment
from ddplab.checkpoint.store import list_checkpoints
from ddplab.errors import PeerFailed
from ddplab.launch import stops
from ddplab.launch.plan import RunPlan
from ddplab.train.signals import StopSignals
from helpers import finish, run_target, start, summary_of

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = (
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "trainer.max_steps=60",
    "trainer.eval_every=10",
    "trainer.checkpoint_every=10",
    "checkpoint.keep_last=0",
)
pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", ["step", "evaluation", "save"])
def test_a_sigterm_to_a_worker_saves_at_the_next_safe_point_wherever_it_lands(tmp_path, moment):
    res = run_target(EXP, tmp_path, "r", *COMMON, f"fault.sigterm_in={moment}", "fault.sigterm_at_step=20", expect=143)
    run = tmp_path / "classifier" / "r"
    steps = [info.step for info in list_checkpoints(str(run / "checkpoints"))]
    # the periodic ones up to the signal, then the stop's own, before the run's end
    assert steps[:2] == [10, 20] and 20 <= steps[-1] < 60, (steps, res.stderr)
    assert f"stopped by SIGTERM; a checkpoint was saved at step {steps[-1]}" in res.stderr
    assert not (run / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigterm_to_a_worker_in_on_fit_end_leaves_a_finished_run(tmp_path):
    res = run_target(EXP, tmp_path, "r", *COMMON, "fault.sigterm_in=on_fit_end", "fault.sigterm_at_step=60")
    summary = summary_of(tmp_path / "classifier" / "r")
    assert summary["status"] == "finished" and "nothing was saved" not in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigterm_to_the_launcher_in_on_fit_end_leaves_a_finished_run_and_exit_0(tmp_path):
    proc = start("run", EXP, "-n", "2", f"run.dir={tmp_path}", "run.name=r", *COMMON, "fault.fit_end_s=3")
    run = tmp_path / "classifier" / "r"
    deadline = time.monotonic() + 60
    while not (run / "in-fit-end").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, 60, "ddplab run")
    assert code == 0, out + err
    assert "nothing was saved" not in err and "came after training had finished; the run is complete" in err
    assert summary_of(run)["status"] == "finished"


def test_the_sigterm_that_follows_a_peers_failure_ends_the_worker_instead(tmp_path, monkeypatch):
    """torch's agent sends SIGTERM to the other workers of a job one of whose workers failed; the
    failed worker's note for this attempt tells it from a scheduler's SIGTERM (the end-to-end case
    is test_hangs' rank that stops answering)."""
    monkeypatch.setenv(environment.RESTART_COUNT, "1")
    # expect_failures sets it: put back as it was after the test
    monkeypatch.setenv(environment.PEER_FAILED, "")
    stops.expect_failures(RunPlan(command="run", target="t", entry="t", stop_file=str(tmp_path / "stop.json")))
    # the note of an earlier attempt, whose failure the agent restarted the workers for, is not this one's
    (tmp_path / "failed-0").touch()
    signals = StopSignals("SIGTERM,SIGUSR1")
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == "SIGTERM"
        stops.note_failure()
        assert (tmp_path / "failed-1").exists()
        # SLURM's warning signal is a stop whatever happened
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.received == "SIGUSR1"
        # a worker failing itself (an exception being handled) finishes its own report
        try:
            raise RuntimeError("this worker's own failure")
        except RuntimeError:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert signals.received == "SIGTERM"
        with pytest.raises(PeerFailed):
            os.kill(os.getpid(), signal.SIGTERM)
            # the handler runs between two bytecodes of this thread
            time.sleep(5)
        # a worker on its way out (run_plan's teardown) is not cut short either
        stops.stand_down()
        signals.received = None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert signals.received == "SIGTERM"
    finally:
        signals.close()
