"""Elastic jobs for real: two `ddplab run --nnodes 1:2` agents joined by torch's c10d rendezvous on
loopback, one SIGKILLed mid-epoch (agent and workers) and started again. The test experiment's
rank 0 logs every global micro-batch it trains on (tests/fixtures/elastic.py), from which the test
rebuilds the sequence of global batches the final weights were trained on."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import (
    REPO,
    STARTED,
    clean_env,
    ddplab_here,
    finish,
    free_port,
    kill_group,
    netns_unavailable,
    run_target,
    start,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EXP = "tests/fixtures/elastic.py:Elastic"
STEPS = 300
COMMON = [
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every=10",
    "trainer.global_batch_size=8",
    "trainer.progress=false",
    "log.tensorboard=false",
]
# One rank or two sum a batch's gradients in another order: after 300 steps the weights of a 1-rank
# and a 2-rank run differ by at most 4.8e-7 (measured), while one step more or less moves them by
# about 1e-2 (lr 0.05). 1e-5 tells the two apart with room on both sides.
TOLERANCE = 1e-5


def applied_batches(log_file) -> tuple[list[tuple[int, tuple[int, ...]]], list[dict]]:
    """The global batches the final weights were trained on, step by step, and the raw log. Workers
    that start anew (another process id) resume from a checkpoint: the steps they log undo every
    step logged before from there on."""
    raw = [json.loads(line) for line in log_file.read_text().splitlines()]
    steps: dict[int, list[int]] = {}
    for before, record in zip([None, *raw], raw, strict=False):
        if before is not None and record["pid"] != before["pid"]:
            steps = {s: v for s, v in steps.items() if s < record["step"]}
        steps.setdefault(record["step"], []).extend(record["indices"])
    return sorted((s, tuple(sorted(v))) for s, v in steps.items()), raw


def _wait_for(condition, what: str, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.2)


def _records(log_file) -> list[dict]:
    try:
        return [json.loads(line) for line in log_file.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted schedule and final weights: the same run on one process (its global
    batches do not depend on the world size)."""
    tmp = tmp_path_factory.mktemp("elastic_ref")
    run_target(EXP, tmp, "ref", *COMMON, n=1)
    run_dir = tmp / "elastic" / "ref"
    chain, _ = applied_batches(run_dir / "results" / "batches.jsonl")
    return chain, torch.load(run_dir / "results" / "params-rank0.pt", weights_only=True)


def _paced(tmp_path):
    """The file that slows each step by a tenth of a second while it exists (fixtures/elastic.py)."""
    pace = tmp_path / "pace"
    pace.touch()
    return pace


def _rejoined(records: list[dict]) -> bool:
    """The job trained on one node and then on two again."""
    worlds = [r["world"] for r in records]
    return 1 in worlds and 2 in worlds[worlds.index(1) :]


def _node(tmp_path, endpoint: str):
    """One node of the job, paced: an agent and its worker, in their own process group."""
    args = ["run", EXP, f"run.dir={tmp_path}", "run.name=e", *COMMON]
    flags = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-conf", "last_call_timeout=2"]
    return start(*args, *flags, env=clean_env(ELASTIC_PACE_FILE=str(_paced(tmp_path))))


def test_a_node_leaves_and_joins_again_and_the_batches_are_the_uninterrupted_ones(reference, tmp_path):
    """The store lives in `ddplab rendezvous`, so either node may go: the first one started goes."""
    port = free_port()
    store = start("rendezvous", "--host", "127.0.0.1", "--port", str(port), env=clean_env())
    endpoint = f"127.0.0.1:{port}"
    _wait_for(lambda: _can_connect(port), "the rendezvous store")
    first = _node(tmp_path, endpoint)
    second = _node(tmp_path, endpoint)
    log = tmp_path / "elastic" / "e" / "results" / "batches.jsonl"
    try:
        # mid-epoch (64 steps per epoch), 5 steps past the checkpoint at step 40
        _wait_for(lambda: any(r["step"] >= 45 for r in _records(log)), "step 45 on two nodes")
        kill_group(first)
        _wait_for(lambda: any(r["world"] == 1 for r in _records(log)), "the job to go on on one node")
        again = _node(tmp_path, endpoint)
        _wait_for(lambda: _rejoined(_records(log)), "the job on two nodes again")
        # the rest of the run at full speed
        (tmp_path / "pace").unlink()
        code, out, err = finish(second, 200, "the node that stayed")
        rejoined_code, rejoined_out, rejoined_err = finish(again, 30, "the node that joined again")
    finally:
        kill_group(store)
    assert code == 0, out + err
    assert rejoined_code == 0, rejoined_out + rejoined_err
    assert "restarted after a failure" in out and "node(s) ask to join" in out, out
    chain, raw = applied_batches(log)
    worlds = [r["world"] for r in raw]
    # two nodes, then one, then two again
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, worlds
    assert worlds.index(1) < len(worlds) - 1 - worlds[::-1].index(1)
    assert chain == reference[0], "the global batches applied differ from the uninterrupted schedule"
    # steps after the last checkpoint were trained twice: once before the kill, once after
    restarts = [i for i in range(1, len(raw)) if raw[i]["pid"] != raw[i - 1]["pid"]]
    redone = [raw[i]["step"] for i in restarts if raw[i]["step"] <= raw[i - 1]["step"]]
    assert redone and redone[0] == 41, [(raw[i - 1]["step"], raw[i]["step"]) for i in restarts]
    final = torch.load(tmp_path / "elastic" / "e" / "results" / "params-rank0.pt", weights_only=True)
    for name, value in final.items():
        torch.testing.assert_close(value, reference[1][name], atol=TOLERANCE, rtol=0)


def test_losing_the_node_that_hosts_the_store_ends_in_one_line(tmp_path):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    host = _node(tmp_path, endpoint)
    # the first agent binds the endpoint and hosts the store
    _wait_for(lambda: _can_connect(port), "the first node's store")
    other = _node(tmp_path, endpoint)
    log = tmp_path / "elastic" / "e" / "results" / "batches.jsonl"
    _wait_for(lambda: any(r["step"] >= 3 for r in _records(log)), "training on two nodes")
    kill_group(host)
    code, out, err = finish(other, 60, "the node that stayed")
    assert code == 2, out + err
    assert "Traceback" not in err, err
    assert "the rendezvous store at 127.0.0.1" in err and "ddplab rendezvous --port" in err, err
    assert len([line for line in err.splitlines() if line.startswith("ddplab: error")]) == 1, err


def _can_connect(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


NETNS = netns_unavailable()


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_two_nodes_on_a_network_lose_one_and_get_it_back(reference, tmp_path):
    """Two network namespaces joined by a veth link (scripts/two-nodes.sh); node 0 hosts the store.
    Node 1 is SIGKILLed (agent and workers) 5 steps past the checkpoint at step 40, and started
    again once node 0 trains alone: the job trains on two nodes, then one, then two."""
    prefix = f"ddpe{os.getpid() % 100000}"
    kill, rejoin = tmp_path / "kill", tmp_path / "rejoin"
    script = [
        "bash",
        str(REPO / "scripts" / "two-nodes.sh"),
        *("--nnodes", "1:2", "--port", str(free_port()), "--kill-after", str(kill), "--rejoin-after", str(rejoin)),
        *(EXP, f"run.dir={tmp_path}", "run.name=e", *COMMON),
        *("--rdzv-conf", "last_call_timeout=2"),
    ]
    env = clean_env(
        PYTHON=sys.executable, NETNS=prefix, LOG_DIR=str(tmp_path / "logs"), ELASTIC_PACE_FILE=str(_paced(tmp_path))
    )
    job = subprocess.Popen(
        script, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    STARTED.append(job)
    log = tmp_path / "elastic" / "e" / "results" / "batches.jsonl"
    try:
        _wait_for(lambda: any(r["step"] >= 45 for r in _records(log)), "step 45 on two nodes")
        kill.touch()
        _wait_for(lambda: any(r["world"] == 1 for r in _records(log)), "node 0 to go on alone")
        rejoin.touch()
        _wait_for(lambda: _rejoined(_records(log)), "the job on two nodes again")
        (tmp_path / "pace").unlink()
        code, out, _ = finish(job, 200, "two-nodes.sh")
    finally:
        for node in ("n0", "n1"):
            subprocess.run(["ip", "netns", "del", prefix + node], capture_output=True)
    assert code == 0, out
    chain, raw = applied_batches(log)
    worlds = [r["world"] for r in raw]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2, worlds
    assert chain == reference[0], "the global batches applied differ from the uninterrupted schedule"


def test_a_store_that_outlives_a_job_refuses_its_rendezvous_id_to_the_next_one(tmp_path):
    port = free_port()
    store = start("rendezvous", "--host", "127.0.0.1", "--port", str(port), env=clean_env())
    try:
        _wait_for(lambda: _can_connect(port), "the rendezvous store")
        flags = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job7"]
        flags += ["--rdzv-conf", "last_call_timeout=1"]
        for name, expect in (("first", 0), ("second", 2)):
            # one process under the launcher (its flags start one)
            res = ddplab_here("run", EXP, f"run.dir={tmp_path}", f"run.name={name}", *flags, "trainer.max_steps=3")
            assert res.returncode == expect, res.stdout + res.stderr
    finally:
        kill_group(store)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert errors == [
        f"ddplab: error: the rendezvous 'job7' at 127.0.0.1:{port} is closed: a job with this --rdzv-id already "
        "ended there; give this job a new --rdzv-id (the same on every node)"
    ], res.stderr
