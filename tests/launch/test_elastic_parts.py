"""Elastic jobs' parts (launch/elastic.py) in this process: which --nnodes is elastic, its restarts, the
line for a node that asks to join (from the agent's own log record, sent through its own logger), and
the rendezvous store's lines. Nodes that leave and join are tested with real agents in
test_elastic.py; these tests are the fast subset the mutation run of the module uses."""

import argparse
import logging
import os
import signal
import socket
import time

import pytest

from ddplab import environment
from ddplab.errors import DdplabError
from ddplab.launch import elastic
from helpers import ddplab_here, finish, free_port, start

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("nnodes", "elastic_job"),
    # "10:10" as two strings of its own (one-character strings are shared objects)
    # "2:10" is a range although its bounds' text sorts the other way round
    [
        ("1", False),
        ("2", False),
        ("2:2", False),
        ("10:10", False),
        ("1:2", True),
        ("2:4", True),
        ("2:10", True),
        ("1:", False),
    ],
)
def test_a_job_is_elastic_when_its_node_count_is_a_range(nnodes, elastic_job):
    assert elastic.is_elastic(nnodes) is elastic_job
    assert elastic.default_restarts(nnodes) == (3 if elastic_job else 0)
    assert elastic.ELASTIC_RESTARTS == 3


@pytest.fixture
def agent_log(monkeypatch):
    """torch's agent logger as a launcher leaves it, restored afterwards."""
    log = logging.getLogger(elastic._AGENT_LOG)
    saved = (list(log.handlers), log.level, log.propagate)
    monkeypatch.delenv(environment.REGROUPED, raising=False)
    yield log
    log.handlers[:], log.level, log.propagate = saved
    os.environ.pop(environment.REGROUPED, None)


def _joining(log, waiting):
    # the agent's own words (torch/distributed/elastic/agent/server/api.py)
    log.info("[%s] Detected %s new nodes from group_rank=%s; will restart worker group", "default", waiting, 0)


def _failed(log):
    log.info("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "default", "FAILED", 2, 3)


def test_a_node_that_asks_to_join_is_one_line_and_tells_the_next_workers(agent_log, capsys):
    elastic.watch_membership(verbose=False)
    _joining(agent_log, 2)
    out = capsys.readouterr()
    assert out.out == (
        "ddplab: 2 node(s) ask to join: the workers stop (saving a checkpoint if every rank still answers) "
        "and go on with the larger group from the latest one\n"
    )
    assert os.environ[environment.REGROUPED] == "1"
    # a failure after it is not a regrouping: the next workers resume as after any failure
    _failed(agent_log)
    assert environment.REGROUPED not in os.environ
    assert capsys.readouterr().out == ""


def test_other_agent_records_say_nothing_and_change_nothing(agent_log, capsys):
    elastic.watch_membership(verbose=False)
    agent_log.info("[%s] Rendezvous complete for workers", "default")
    agent_log.info("Detected new nodes")
    # worded without the count: nothing to say how many join
    agent_log.info("Detected %s new nodes", "default")
    assert capsys.readouterr().out == "" and environment.REGROUPED not in os.environ


def test_a_join_record_without_the_group_rank_is_said_too(agent_log, capsys):
    """The count is the record's second argument, whatever follows it: a shorter wording of the same
    record (without the group rank) still regroups."""
    elastic.watch_membership(verbose=False)
    agent_log.info("[%s] Detected %s new nodes; will restart worker group", "default", 1)
    assert capsys.readouterr().out.startswith("ddplab: 1 node(s) ask to join")
    assert os.environ[environment.REGROUPED] == "1"


def test_watching_twice_adds_one_handler_and_torchs_lines_show_only_when_verbose(agent_log):
    elastic.watch_membership(verbose=False)
    elastic.watch_membership(verbose=True)
    assert sum(isinstance(h, elastic._MembershipLine) for h in agent_log.handlers) == 1
    assert agent_log.level == logging.INFO and agent_log.propagate is True
    elastic.watch_membership(verbose=False)
    assert agent_log.propagate is False


def test_a_lost_or_closed_rendezvous_is_one_line_with_its_fix():
    lost = elastic.rendezvous_lost("host:29400", ConnectionResetError("gone"))
    assert lost.cause == (
        "the rendezvous store at host:29400 stopped answering (ConnectionResetError): the node that hosted it "
        "left the job, and an elastic job survives the loss of any node but that one"
    )
    assert lost.fix.startswith("run `ddplab rendezvous --port PORT` on a host that outlives the job")
    closed = elastic.rendezvous_closed("host:29400", "job7")
    assert (
        closed.cause == "the rendezvous 'job7' at host:29400 is closed: a job with this --rdzv-id already ended there"
    )
    assert closed.fix == "give this job a new --rdzv-id (the same on every node)"


def test_the_rendezvous_command_takes_a_host_and_a_port():
    parser = argparse.ArgumentParser()
    elastic.add_command(parser.add_subparsers())
    args = parser.parse_args(["rendezvous"])
    assert (args.host, args.port) == ("0.0.0.0", 29400)
    args = parser.parse_args(["rendezvous", "--host", "127.0.0.1", "--port", "1234"])
    assert (args.host, args.port) == ("127.0.0.1", 1234)


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_a_port_out_of_range_is_one_line(port):
    with pytest.raises(DdplabError) as refused:
        elastic.serve_store("127.0.0.1", port)
    assert refused.value.cause == f"--port {port} is not between 1 and 65535"


def test_a_busy_port_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DdplabError) as refused:
            elastic.serve_store("127.0.0.1", port)
    assert refused.value.cause.startswith(f"cannot listen on 127.0.0.1:{port} (")
    assert refused.value.fix == "pass a free --port, or stop what uses it"


def _free_port(wanted: int = 0) -> int:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", wanted))
        except OSError:
            pytest.skip(f"port {wanted} is in use on this machine")
        return probe.getsockname()[1]


# the lowest and the highest port there are, too: the range check lets them through (port 1 needs root)
@pytest.mark.parametrize("wanted", [0, 1, 65535])
def test_the_store_serves_agents_until_sigterm(capsys, wanted):
    import datetime
    import signal
    import threading

    import torch.distributed as dist

    port = _free_port(wanted)
    answers = []

    def agent():
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=20))
        client.set("joined", "yes")
        answers.append(client.get("joined"))
        # the store is serving (its handler is in place): stop it as a user would
        deadline = time.monotonic() + 20
        while signal.getsignal(signal.SIGTERM) is saved[signal.SIGTERM] and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    try:
        assert elastic.serve_store("127.0.0.1", port) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    thread.join(10)
    assert answers == [b"yes"]
    out = capsys.readouterr()
    assert out.out == f"ddplab: rendezvous store listening on 127.0.0.1:{port}; pass --rdzv-endpoint HOST:{port}\n"
    assert out.err == "ddplab: rendezvous store stopped\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "host, said",
    [
        ("no-such-host.invalid", "--host no-such-host.invalid does not resolve to an address"),
        # an address of no interface here (10.x: never routed anywhere by the test)
        ("10.123.45.67", "cannot listen on 10.123.45.67:"),
    ],
)
def test_the_rendezvous_command_checks_its_host_at_once(host, said):
    res = ddplab_here("rendezvous", "--host", host, "--port", str(free_port()))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and said in lines[0], res.stderr
    assert "--host" in lines[0].split("; ", 1)[1]


@pytest.mark.timeout(60)
def test_the_rendezvous_store_serves_clients_on_the_socket_it_bound():
    import datetime

    import torch.distributed as dist

    port = free_port()
    proc = start("rendezvous", "--host", "127.0.0.1", "--port", str(port))
    assert "listening on 127.0.0.1" in proc.stdout.readline()
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    client.set("key", "value")
    assert client.get("key") == b"value"
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, 20, "ddplab rendezvous")[0] == 0
