"""Runs in object storage (run.dir=s3://...), against a real S3-compatible server: moto's, started
here on 127.0.0.1. A run resumes from its bucket on a machine that never saw it; no reader ever
loads half a checkpoint; a store that stops answering, and one these credentials cannot write, are
one line each; the writer SIGKILLed mid-upload never costs more than the checkpoint it was writing."""

import json
import os
import random
import re
import signal
import socket
import threading
import time
import uuid

import pytest
import torch

from ddplab.checkpoint.mirror import RunMirror, Uploads
from ddplab.checkpoint.objects import store_for
from ddplab.checkpoint.store import CheckpointManager, list_checkpoints, load_latest_valid, load_state
from ddplab.errors import DdplabError
from ddplab.tools.listing import print_checkpoints, print_runs
from helpers import FIXTURES, budget, clean_env, ddplab, ddplab_here, finish, s3_client, start, start_saver

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32", "model.dropout=0.0"]
pytestmark = pytest.mark.timeout(60)


def _run(s3, url, local, name, *args, n=2, expect=0, env=None, timeout=120, exp=EXP, apart=False):
    """The run (a launch's launcher, or one process) runs in this one unless `apart`: live replicas,
    and a one-process run behind a proxy thread of this process (the proxy would wait for the run's
    GIL, and a 1 s storage timeout would see that wait)."""
    command = ["run", exp, f"run.dir={url}", f"run.local_dir={local}", f"run.name={name}", *COMMON, *args]
    env = env or clean_env(**s3)
    ranks = ["-n", str(n)] if n > 1 else []
    res = ddplab(*command, *ranks, env=env, timeout=timeout) if apart else ddplab_here(*command, *ranks, env=env)
    assert res.returncode == expect, res.stdout + res.stderr
    return res


def _params(local, name):
    return torch.load(local / "classifier" / name / "results" / "final.pt", weights_only=True)["params"]


# ---- the commit rule, read in this process -------------------------------------------------------
def _manager(tmp_path, url, keep_last=2):
    """ddplab's writer as rank 0 uses it: local commit, then the bucket."""
    uploads = Uploads(RunMirror(url, str(tmp_path)), keep_last, 0, "max")
    return CheckpointManager(
        str(tmp_path / "checkpoints"), keep_last=keep_last, remote=f"{url}/checkpoints", uploads=uploads
    )


def _state(step):
    return {"models": {"net": {"w": torch.full((1000,), float(step))}}, "progress": {"step": step}}


def test_a_reader_sees_only_committed_whole_checkpoints_and_falls_back_from_a_damaged_one(s3, bucket, tmp_path, capsys):
    url = f"{bucket}/runs/classifier/r"
    s3c = s3_client(s3["AWS_ENDPOINT_URL"])
    name = bucket.removeprefix("s3://")
    s3c.put_object(Bucket=name, Key="runs/classifier/r/checkpoints/notes.txt", Body=b"a user's own file")
    manager = _manager(tmp_path, url)
    for step in (1, 2, 3):
        manager.save(_state(step), step, 0, None)
    remote = f"{url}/checkpoints"
    # retention in the bucket follows the local rule, after the newer one is committed; it deletes
    # checkpoints only
    assert [i.step for i in list_checkpoints(remote)] == [2, 3]
    assert load_bytes(f"{remote}/notes.txt") == b"a user's own file"
    key = "runs/classifier/r/checkpoints/step-00000003/state.pt"
    # the damage in each copy a reader may use: first this machine's local copy, the bucket's intact
    own = tmp_path / "checkpoints" / "step-00000003" / "state.pt"
    kept = own.read_bytes()
    own.write_bytes(kept[:-100] + bytes(b ^ 0xFF for b in kept[-100:]))
    info, state = load_latest_valid(remote, cache=str(tmp_path / "checkpoints"))
    # the bucket's object, verified, not the damaged local copy
    assert info.step == 3 and torch.equal(state["models"]["net"]["w"], torch.full((1000,), 3.0))
    own.write_bytes(kept)
    # then the bucket's: the same size, other bytes: only the checksum in COMMITTED tells
    body = bytearray(s3c.get_object(Bucket=name, Key=key)["Body"].read())
    body[-100] ^= 0xFF
    s3c.put_object(Bucket=name, Key=key, Body=bytes(body))
    # a fresh machine: no local copy to read instead
    info, state = load_latest_valid(remote, cache=str(tmp_path / "elsewhere"))
    assert info.step == 2 and torch.equal(state["models"]["net"]["w"], torch.full((1000,), 2.0))
    err = capsys.readouterr().err
    assert "step-00000003/state.pt cannot be read" in err and "falling back to the previous checkpoint" in err
    # the machine that wrote it reads its own verified copy, not the damaged object
    info, state = load_latest_valid(remote, cache=str(tmp_path / "checkpoints"))
    assert info.step == 3 and torch.equal(state["models"]["net"]["w"], torch.full((1000,), 3.0))
    # an upload cut short before its marker is not a checkpoint
    s3c.delete_object(Bucket=name, Key="runs/classifier/r/checkpoints/step-00000002/COMMITTED")
    assert [i.step for i in list_checkpoints(remote)] == [3]
    print_checkpoints(url)
    out = capsys.readouterr().out
    assert "step-00000003" in out and "latest" in out and "step-00000002" not in out
    # a marker that is not what ddplab writes: skipped, and named as the marker (it holds the meta)
    s3c.put_object(Bucket=name, Key="runs/classifier/r/checkpoints/step-00000003/COMMITTED", Body=b"{garbled")
    assert list_checkpoints(remote) == []
    assert "step-00000003 has a damaged COMMITTED" in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "best"), [("max", 2), ("min", 3)])
def test_the_buckets_retention_keeps_the_best_by_the_monitors_mode_as_the_local_folder_does(
    s3, bucket, tmp_path, mode, best
):
    url = f"{bucket}/runs/classifier/best-{mode}"
    uploads = Uploads(RunMirror(url, str(tmp_path)), 1, 1, mode)
    manager = CheckpointManager(
        str(tmp_path / "checkpoints"), keep_last=1, keep_best=1, mode=mode, remote=f"{url}/checkpoints", uploads=uploads
    )
    # step 2 scores highest, step 3 lowest; the last is step 4
    for step, metric in ((1, 0.5), (2, 0.9), (3, 0.1), (4, 0.3)):
        manager.save(_state(step), step, 0, metric)
    manager.wait()
    local = [i.step for i in list_checkpoints(str(tmp_path / "checkpoints"))]
    remote = [i.step for i in list_checkpoints(f"{url}/checkpoints")]
    assert local == remote == sorted([best, 4]), (local, remote)


def test_a_checkpoint_gone_from_a_bucket_named_bucket_is_called_gone_not_a_missing_bucket(s3, tmp_path):
    # a bucket whose name holds "bucket", as many do; the checkpoint was removed by retention
    name = f"my-bucket-{uuid.uuid4().hex[:8]}"
    s3_client(s3["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    with pytest.raises(DdplabError) as e:
        load_state(f"s3://{name}/runs/classifier/r/checkpoints/step-00000002")
    assert "COMMITTED is gone" in str(e.value) and "bucket does not exist" not in str(e.value), str(e.value)
    # a bucket that is not there is still named so
    with pytest.raises(DdplabError, match="the bucket does not exist"):
        load_state(f"s3://no-{name}/runs/classifier/r/checkpoints/step-00000002")


class _Killed(Exception):
    """The writer's end, at a chosen point of an upload."""


def test_an_upload_cut_short_after_any_of_its_objects_leaves_no_checkpoint_in_the_bucket(s3, bucket, tmp_path):
    """The writer dies after each object of an upload in turn (a fixed point, not a random moment):
    the bucket lists the step only once its marker, put last, is there."""
    CheckpointManager(str(tmp_path / "checkpoints"), keep_last=0).save(_state(1), 1, 0, None)
    folder = str(tmp_path / "checkpoints" / "step-00000001")
    url = f"{bucket}/runs/classifier/cut"
    mirror = RunMirror(url, str(tmp_path))
    put = mirror.store.put_file
    for objects in range(3):
        done = []

        def dying(*args, objects=objects, done=done):
            if len(done) == objects:
                raise _Killed
            done.append(args[-1])
            return put(*args)

        mirror.store.put_file = dying
        with pytest.raises(_Killed):
            mirror.upload_checkpoint(folder)
        assert list_checkpoints(f"{url}/checkpoints") == [], done
    mirror.store.put_file = put
    mirror.upload_checkpoint(folder)
    assert [info.step for info in list_checkpoints(f"{url}/checkpoints")] == [1]


def test_a_local_checkpoint_changed_after_its_commit_is_never_loaded(tmp_path, capsys):
    manager = CheckpointManager(str(tmp_path), keep_last=0)
    for step in (1, 2):
        manager.save(_state(step), step, 0, None)
    state = tmp_path / "step-00000002" / "state.pt"
    data = bytearray(state.read_bytes())
    data[-100] ^= 0xFF
    state.write_bytes(bytes(data))
    info, _ = load_latest_valid(str(tmp_path))
    assert info.step == 1
    assert "step-00000002/state.pt cannot be read" in capsys.readouterr().err


# ---- whole runs ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_resumes_from_its_bucket_on_a_machine_that_never_saw_it_bitwise(s3, bucket, tmp_path):
    """2 ranks train 6 steps into the bucket (uploads in the background); a machine with an empty
    disk resumes on 1 rank to 12: the same weights, bit for bit, as the same resume on one disk."""
    first, second = tmp_path / "first", tmp_path / "second"
    runs = f"{bucket}/runs"
    _run(s3, runs, first, "r", "trainer.max_steps=6", "trainer.checkpoint_every=3", "checkpoint.async_save=true")
    res = _run(s3, runs, second, "r", "trainer.max_steps=12", n=1)
    assert f"resumed from {runs}/classifier/r/checkpoints/step-00000006 at step 6" in res.stdout
    assert f"and in {runs}/classifier/r" in res.stdout
    # the reference: the first machine's own copy of the run, resumed from its disk alone
    local = ddplab_here("run", EXP, f"run.dir={first}", "run.name=r", *COMMON, "trainer.max_steps=12")
    assert local.returncode == 0 and f"resumed from {first}/classifier/r/checkpoints/step-00000006" in local.stdout
    a, b = _params(second, "r"), _params(first, "r")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # what the bucket holds: the run's record, final/, the summary, the last two checkpoints
    summary = json.loads(load_bytes(f"{runs}/classifier/r/summary.json"))
    assert summary["status"] == "finished" and summary["step"] == 12
    # the whole history, in the bucket and in the new machine's copy: both attempts' lines and evaluations
    for history in (
        load_bytes(f"{runs}/classifier/r/metrics.jsonl").decode(),
        (second / "classifier" / "r" / "metrics.jsonl").read_text(),
    ):
        rows = [json.loads(line) for line in history.splitlines()]
        # logged each 10 steps and at the end: step 6 is the first machine's
        assert {r["step"] for r in rows if "train/loss" in r} == {6, 10, 12}
        assert {r["step"] for r in rows if "eval/loss" in r} >= {6, 12}
    log = load_bytes(f"{runs}/classifier/r/log.txt").decode()
    # each attempt's banner: the first machine's 2 ranks, the second's 1
    assert "2 process(es) on cpu" in log and "1 process(es) on cpu" in log, log
    assert summary["attempts"] == 2 and len(json.loads(load_bytes(f"{runs}/classifier/r/run.json"))["attempts"]) == 2
    # and any machine draws it from the bucket
    res = ddplab_here("report", f"{runs}/classifier/r", "--out", str(tmp_path / "report"), env=clean_env(**s3))
    assert res.returncode == 0 and (tmp_path / "report" / "report.png").is_file(), res.stderr
    assert f"{runs}/classifier/r" in res.stdout
    assert [i.step for i in list_checkpoints(f"{runs}/classifier/r/checkpoints")] == [6, 12]
    assert load_bytes(f"{runs}/classifier/r/final/model.safetensors")
    # any machine evaluates it from the bucket
    out = tmp_path / "eval.json"
    res = ddplab_here("eval", EXP, "--checkpoint", f"{runs}/classifier/r", "--out", str(out), env=clean_env(**s3))
    assert res.returncode == 0, res.stderr
    n = json.loads(out.read_text())["n"]
    # and predicts with it: the experiment and settings come from the run's record in the bucket
    rows = tmp_path / "predictions.jsonl"
    res = ddplab_here("predict", f"{runs}/classifier/r", "--input", "eval", "--out", str(rows), env=clean_env(**s3))
    assert res.returncode == 0, res.stderr
    assert len(rows.read_text().splitlines()) == n > 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_second_job_writing_the_same_run_in_a_bucket_is_refused_in_one_line(s3, bucket, tmp_path):
    """Two jobs given one run name (two machines, each with its own disk): the first holds the run's
    lease in the bucket and renews it; the second is refused in one line, writes nothing, and the
    run is the first's alone. Once the first ends, the same command continues the run."""
    runs = f"{bucket}/runs"
    lease = ["run.storage_lease_s=4"]
    first = start(
        "run", EXP, "-n", "2", f"run.dir={runs}", f"run.local_dir={tmp_path / 'one'}", "run.name=r", *COMMON,
        *lease, "trainer.max_steps=60", "data.slow_sample_s=0.005", env=clean_env(**s3),
    )  # fmt: skip
    try:
        store = store_for(f"{runs}/classifier/r")
        deadline = time.monotonic() + budget(90)
        while not store.find(".ddplab-lease") and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        second = _run(s3, runs, tmp_path / "two", "r", *lease, "trainer.max_steps=60", "seed=5", n=1, expect=2)
        errors = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "is being written by another job (process" in errors[0], second.stderr
        assert not (tmp_path / "two" / "classifier" / "r" / "checkpoints").exists() or not any(
            (tmp_path / "two" / "classifier" / "r" / "checkpoints").iterdir()
        )
    finally:
        code, out, err = finish(first, timeout=100)
    assert code == 0, out + err
    assert "seed: 5" not in load_bytes(f"{runs}/classifier/r/config.yaml").decode()
    assert json.loads(load_bytes(f"{runs}/classifier/r/summary.json"))["step"] == 60
    # the first let go at its end: the next job takes the run at once and continues it
    again = _run(s3, runs, tmp_path / "two", "r", *lease, "trainer.max_steps=62", n=1)
    assert "resumed from" in again.stdout and "watching" not in again.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_live_replicas_keep_their_runs_in_the_bucket_and_resume_on_machines_that_never_saw_them(s3, bucket, tmp_path):
    """dist.fault_tolerance=live: each replica's run in its own folder of the bucket; a whole job
    lost with its disks resumes every replica from there."""
    pytest.importorskip("torchft")
    runs = f"{bucket}/runs"
    live = ["dist.fault_tolerance=live", "trainer.checkpoint_every=3"]
    # replicas: each in a process of its own
    _run(s3, runs, tmp_path / "first", "live", "trainer.max_steps=6", *live, apart=True)
    for replica in (0, 1):
        steps = [i.step for i in list_checkpoints(f"{runs}/classifier/live/replica-{replica}/checkpoints")]
        assert steps == [3, 6]
    res = _run(s3, runs, tmp_path / "second", "live", "trainer.max_steps=9", *live, apart=True)
    for replica in (0, 1):
        at = f"{runs}/classifier/live/replica-{replica}/checkpoints/step-00000006 at step 6"
        assert f"[replica {replica}] resumed from {at}" in res.stdout, res.stdout
    assert json.loads(load_bytes(f"{runs}/classifier/live/replica-1/summary.json"))["step"] == 9
    listed = ddplab_here("runs", runs, "--json", env=clean_env(**s3))
    assert {row["run"] for row in json.loads(listed.stdout)} == {"live/replica-0", "live/replica-1"}, listed.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_loads_the_best_checkpoint_from_the_bucket_and_the_bucket_lists_the_run(
    s3, bucket, tmp_path, capsys
):
    """load_best_checkpoint in a run in object storage: every rank reads the bucket's copy (rank 0's
    disk may be another machine's); `ddplab runs s3://...` lists the run from its record there."""
    runs, local = f"{bucket}/runs", tmp_path / "local"
    env = clean_env(**s3, SCRIPTED_SCORES="0.1,0.9,0.2")
    args = ["trainer.max_steps=6", "trainer.eval_every=2", "trainer.checkpoint_every=2", "checkpoint.monitor=score"]
    keep = ["checkpoint.keep_best=1", "checkpoint.keep_last=1"]
    _run(s3, runs, local, "best", *args, *keep, env=env, exp="tests/fixtures/experiments.py:ScriptedScore")
    remote = f"{runs}/scriptedscore/best/checkpoints"
    assert [i.step for i in list_checkpoints(remote)] == [4, 6]
    best = load_state(f"{remote}/step-00000004")["models"]["net"]
    for rank in (0, 1):
        held = torch.load(local / "scriptedscore" / "best" / "results" / f"params-rank{rank}.pt")
        assert all(torch.equal(held[k], best[k]) for k in best)
    print_runs(runs, as_json=True)
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["status"], r["checkpoint"]) for r in rows] == [("best", "finished", 6)]
    assert rows[0]["path"] == f"{runs}/scriptedscore/best"


def load_bytes(url: str) -> bytes:
    from ddplab.checkpoint.objects import store_for

    head, tail = url.rsplit("/", 1)
    return store_for(head).read_bytes(tail)


class FreezingProxy:
    """A TCP relay to the S3 server that stops answering, for good, once a client sends `trigger`
    (a request line): what a store that hangs mid-save looks like from the client. `thaw()` lets
    new connections through again."""

    def __init__(self, port: int, trigger: bytes):
        self.target, self.trigger = port, trigger
        self.frozen = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def thaw(self) -> None:
        self.frozen.clear()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, upstream: bool) -> None:
        with src, dst:
            while data := _recv(src):
                if upstream and self.trigger in data:
                    self.frozen.set()
                if self.frozen.is_set():
                    # swallow everything and never answer; the client's own timeout ends it
                    continue
                dst.sendall(data)


def _recv(sock) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_store_that_stops_answering_mid_save_costs_no_step_and_no_checkpoint(s3, bucket, tmp_path):
    """The store hangs while step 4's state is uploaded: training goes on, each failed upload is one
    warning, and the run ends non-zero saying which checkpoint is not in the bucket. Run again once
    the store answers, it uploads that checkpoint and ends; nothing was trained twice."""
    proxy = FreezingProxy(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), b"step-00000004/state.pt")
    env = clean_env(**{**s3, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"})
    runs, local = f"{bucket}/runs", tmp_path / "local"
    args = ["trainer.max_steps=8", "trainer.checkpoint_every=2", "run.storage_timeout_s=1"]
    res = _run(s3, runs, local, "f", *args, n=1, expect=2, env=env, apart=True)
    errors = [line for line in res.stderr.splitlines() if line.startswith("ddplab: error:")]
    assert len(errors) == 1 and "step-00000008 is saved in" in errors[0], res.stderr
    assert "could not be uploaded" in errors[0] and "no answer within 1 s" in errors[0]
    assert "Traceback" not in res.stderr
    for step in (4, 6):
        assert f"checkpoint step-0000000{step} is saved in" in res.stderr and "training goes on" in res.stderr
    # every step was trained and saved locally; the bucket kept what it had committed
    assert [i.step for i in list_checkpoints(str(local / "classifier" / "f" / "checkpoints"))] == [6, 8]
    remote = f"{runs}/classifier/f/checkpoints"
    assert [i.step for i in list_checkpoints(remote)] == [2]
    proxy.thaw()
    res = _run(s3, runs, local, "f", *args, n=1, env=env, apart=True)
    assert "at step 8" in res.stdout and "train step" not in res.stdout
    assert [i.step for i in list_checkpoints(remote)] == [2, 8]
    assert json.loads(load_bytes(f"{runs}/classifier/f/summary.json"))["step"] == 8


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stop_while_the_store_hangs_says_where_the_stop_checkpoint_is_and_the_command_uploads_it(
    s3, bucket, tmp_path
):
    proxy = FreezingProxy(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), b"step-00000004/state.pt")
    env = clean_env(**{**s3, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"})
    runs, local = f"{bucket}/runs", tmp_path / "local"
    args = ["trainer.max_steps=400", "trainer.checkpoint_every=2", "run.storage_timeout_s=1", "fault.step_sleep=0.1"]
    command = ["run", EXP, f"run.dir={runs}", f"run.local_dir={local}", "run.name=h", *COMMON, *args, "-n", "2"]
    run = start(*command, env=env)
    # the store stops answering at step 4's upload; training goes on meanwhile
    assert proxy.frozen.wait(budget(60)) and run.poll() is None, "the run never reached step 4's upload"
    time.sleep(1)
    run.send_signal(signal.SIGTERM)
    code, out, err = finish(run, 60, "ddplab run (SIGTERM while the store hangs)")
    assert code == 143, out + err
    said = [line for line in err.splitlines() if line.startswith("ddplab: stopped by SIGTERM")]
    assert len(said) == 1 and "nothing was saved" not in said[0], err
    step = int(re.search(r"a checkpoint was saved at step (\d+) in ", said[0])[1])
    assert "and not in the run's bucket (no answer within 1 s" in said[0], said[0]
    assert "To continue, on this machine once the store answers: ddplab run" in said[0]
    # it is committed on this disk, and the bucket has none of it
    folder = local / "classifier" / "h" / "checkpoints"
    assert list_checkpoints(str(folder))[-1].step == step
    remote = f"{runs}/classifier/h/checkpoints"
    assert all(i.step < step for i in list_checkpoints(remote))
    # the command it gives, once the store answers, uploads that checkpoint first and goes on from it
    proxy.thaw()
    res = ddplab(*command, "trainer.max_steps=" + str(step + 2), env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"at step {step}" in res.stdout
    assert list_checkpoints(remote)[-1].step == step + 2


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_uploading_writer_killed_at_random_moments_never_loses_a_committed_checkpoint(s3, bucket, tmp_path):
    url = f"{bucket}/runs/saver/r"
    rng, newest = random.Random(0), 0
    for _ in range(5):
        proc = start_saver(tmp_path / "checkpoints", newest, url, env=clean_env(**s3))
        # somewhere inside an upload (its objects, its marker, the pruning), or between two
        time.sleep(rng.uniform(0.0, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        infos = list_checkpoints(f"{url}/checkpoints")
        assert infos, "a checkpoint was committed in the bucket before the kill"
        for info in infos:
            state = load_state(info.path)
            assert state["progress"]["step"] == info.step
            assert all(torch.equal(t, torch.full_like(t, float(info.step))) for t in state["models"]["net"].values())
        # never older than what the bucket held before this round
        assert infos[-1].step >= newest
        newest = infos[-1].step
    assert newest >= 5


# ---- bad input: one line, before any worker starts ------------------------------------------------
@pytest.fixture
def read_only(s3, bucket):
    """Credentials of a user that may read the bucket, not write it (moto checks them from here on)."""
    import boto3
    import moto.settings

    iam = boto3.client("iam", endpoint_url=s3["AWS_ENDPOINT_URL"])
    user = f"reader-{uuid.uuid4().hex[:6]}"
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"]}]}
    policy["Statement"][0]["Resource"] = "*"
    iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    before = moto.settings.INITIAL_NO_AUTH_ACTION_COUNT
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    yield {**s3, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = before


@pytest.mark.parametrize(
    "where, expected",
    [
        ("foo://bucket/runs", "no storage library here knows the scheme foo://"),
        ("gs://bucket/runs", "needs a package that is not installed"),
        ("s3://no-such-bucket-here/runs", "cannot be written (the bucket does not exist)"),
        ("read-only", "cannot be written (access denied"),
        ("no-credentials", "cannot be written (no credentials were found); set AWS_ACCESS_KEY_ID and"),
    ],
)
def test_a_store_that_cannot_be_used_is_one_line_before_any_worker_starts(
    request, s3, bucket, tmp_path, where, expected
):
    env = clean_env(**s3)
    if where == "read-only":
        env, where = clean_env(**request.getfixturevalue("read_only")), f"{bucket}/runs"
    if where == "no-credentials":
        # nothing botocore could find credentials in: no keys, no profile files, no instance metadata
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")}
        nowhere = str(tmp_path / "none")
        env.update(AWS_SHARED_CREDENTIALS_FILE=nowhere, AWS_CONFIG_FILE=nowhere, AWS_EC2_METADATA_DISABLED="true")
        where = f"{bucket}/runs"
    proc = start("run", EXP, "-n", "2", f"run.dir={where}", f"run.local_dir={tmp_path}", *COMMON, env=env)
    code, out, err = finish(proc, timeout=40)
    assert code == 2, out + err
    assert err.strip().count("\n") == 0 and err.startswith("ddplab: error:") and expected in err, err
    # each cause its own fix: the timeout is named only where it is the cause
    assert "storage_timeout_s" not in err
    # nothing started: no banner, no local run folder
    assert "process(es) on" not in out and not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (["run.dir=s3:/bucket/runs"], "run.dir=s3:/bucket/runs is a local folder named 's3:'"),
        (["run.dir=s3:bucket"], "write run.dir=s3://bucket"),
        (["run.dir=S3://bucket/runs"], "the scheme S3:// is written in capitals"),
        (
            ["run.dir=file:///tmp/runs"],
            "a folder on this machine written as a URL; write it as a path: run.dir=/tmp/runs",
        ),
        (["run.dir=s3://My_Bucket/runs"], "'My_Bucket' is not a valid S3 bucket name"),
        (["run.dir=s3://ab/runs"], "'ab' is not a valid S3 bucket name"),
        (
            ["run.dir=s3://bucket/runs", "run.local_dir=s3://other/copy"],
            "run.local_dir=s3://other/copy: the run's local",
        ),
        (["run.dir=s3://bucket/runs", "run.local_dir=FILE/below"], "FILE is not a folder"),
    ],
)
def test_a_run_folder_written_wrong_is_one_line_naming_its_setting_before_anything_starts(tmp_path, where, expected):
    """A URL with one slash would train into a local folder named 's3:'; an upper-case scheme, an
    invalid bucket name or a local copy that is a URL fail at the first request, after the workers
    started. No store is asked: these are refused as typed."""
    (tmp_path / "FILE").write_text("a file where a folder belongs")
    settings = [w.replace("FILE", str(tmp_path / "FILE")) for w in where]
    res = ddplab_here(
        "run", str(FIXTURES / "experiments.py:Classifier"), "-n", "2", *settings, *COMMON, cwd=str(tmp_path)
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and expected.replace("FILE", str(tmp_path / "FILE")) in lines[0], (
        res.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_a_sweep_into_a_bucket_is_one_line(tmp_path):
    res = ddplab("sweep", EXP, "run.dir=s3://bucket/runs", "model.lr=choice(0.1,0.2)", *COMMON, timeout=40)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "a sweep keeps its study and trials in a local folder" in res.stderr
