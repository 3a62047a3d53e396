"""Live recovery's parts in one process: how a step's global batch is shared, and the one-line
refusals that come before any replica starts."""

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from ddplab.config import DistConfig
from ddplab.distributed import live
from ddplab.errors import ConfigError, DdplabError, LaunchError
from ddplab.launch.launcher import LaunchOptions
from ddplab.launch.replicas import Replicas, count
from ddplab.train.data import BatchPlan, GlobalBatchSampler
from ddplab.train.progress import TrainProgress
from ddplab.train.sources import QuorumBatches

pytestmark = pytest.mark.timeout(30)


def _batches(progress, accumulate=2, n=100, g=12):
    data = TensorDataset(torch.arange(n))
    plan = BatchPlan(g, 1, accumulate)
    return QuorumBatches(
        data,
        plan,
        seed=7,
        epoch=0,
        collate_fn=lambda s: [i for (i,) in s],
        device=torch.device("cpu"),
        progress=progress,
    )


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_every_quorum_shares_the_same_global_batch_each_sample_once_in_order(size):
    progress = TrainProgress()
    progress.step = progress.step_in_epoch = 3
    batches = _batches(progress)
    # the global batch of step 3 as any world size reads it
    sampler = GlobalBatchSampler(100, BatchPlan(12, 1, 1), 0, seed=7, epoch=0, start_step=3)
    expected = [int(i) for i in next(iter(sampler))]
    taken, counts = [], []
    for rank in range(size):
        micro, sizes = batches.share(rank, size, accumulate=2)
        pieces = [list(map(int, m)) for m in micro]
        assert [len(p) for p in pieces] == sizes and len(sizes) <= 2
        taken += [i for p in pieces for i in p]
        counts.append(sum(sizes))
    assert taken == expected
    # shares differ by at most one sample
    assert max(counts) - min(counts) <= 1


def test_a_replica_healed_into_the_next_epoch_leaves_the_old_one_without_ending_it():
    progress = TrainProgress()
    batches = _batches(progress)
    assert batches.has_step(0)
    progress.epoch, progress.step_in_epoch = 1, 2
    assert not batches.has_step(2) and not batches.exhausted
    micro, _ = batches.share(0, 1, 1)
    again = QuorumBatches(batches.dataset, batches.plan, 7, 1, batches.collate.fn, batches.device, progress)
    assert list(map(int, next(micro))) == list(map(int, next(again.share(0, 1, 1)[0])))


def test_several_nodes_are_told_how_replicas_meet_instead():
    with pytest.raises(DdplabError) as e:
        count(LaunchOptions(nproc_per_node="2", nnodes="2"))
    assert "ddplab lighthouse" in e.value.fix and "dist.replica_id=FIRST" in e.value.fix
    assert count(LaunchOptions(nproc_per_node="3")) == 3


class StandIns(Replicas):
    """The launcher's replicas as small processes: `behaviour[replica]` is the code each start runs
    (its n-th start the n-th item); "finish" marks the replica as having taken the run's last step and
    exits 0, or runs the code after "finish;"."""

    def __init__(self, folder, behaviour: dict[int, list[str]]):
        super().__init__(None, OmegaConf.create({"dist": {"replica_id": 0}}), "", len(behaviour), str(folder))
        self.behaviour = behaviour
        self.starts: dict[int, int] = dict.fromkeys(behaviour, 0)

    def start(self, replica: int, place: int) -> None:
        code = self.behaviour[replica][self.starts[replica]]
        self.starts[replica] += 1
        if code.startswith("finish"):
            ending = code.partition(";")[2].strip() or "raise SystemExit(0)"
            code = f"open({str(self.start_folder)!r} + '/finished-{replica}', 'w'); {ending}"
        self.procs[replica] = subprocess.Popen([sys.executable, "-c", "import time\n" + code])


@pytest.mark.timeout(30)
def test_a_replica_that_fails_after_a_peer_finished_the_run_is_not_replaced(tmp_path, capsys):
    late = StandIns(tmp_path / "a", {0: ["finish"], 1: ["time.sleep(0.4); raise SystemExit(3)", "raise SystemExit(0)"]})
    (tmp_path / "a").mkdir()
    assert late.run(replacements=3) == 0
    assert late.starts == {0: 1, 1: 1}
    assert (
        "replica 1 failed (exit code 3) after replica(s) [0] finished the run; not replaced" in capsys.readouterr().out
    )
    # the same failure while its peer still trains: replaced
    early = StandIns(tmp_path / "b", {0: ["time.sleep(0.6)"], 1: ["raise SystemExit(3)", "raise SystemExit(0)"]})
    (tmp_path / "b").mkdir()
    assert early.run(replacements=3) == 0
    assert early.starts == {0: 1, 1: 2}
    # a replica that fails after its own last step (in its export, say) resumes there: replaced
    alone = StandIns(tmp_path / "c", {0: ["finish; raise SystemExit(3)", "raise SystemExit(0)"]})
    (tmp_path / "c").mkdir()
    assert alone.run(replacements=3) == 0
    assert alone.starts == {0: 2}


@pytest.mark.timeout(60)
def test_a_replica_is_heard_by_the_lighthouse_from_its_first_quorum_not_while_it_starts(monkeypatch):
    # torchft forms no quorum of half the live replicas or fewer: a replacement heard while it builds
    # its model would hold a lone peer's steps until it asks for a quorum
    pytest.importorskip("torchft")
    monkeypatch.delenv("DDPLAB_REPLICAS_START", raising=False)
    monkeypatch.delenv("DDPLAB_REPLICA_ID", raising=False)
    monkeypatch.delenv("DDPLAB_LIGHTHOUSE", raising=False)
    server = live.serve_lighthouse("127.0.0.1:0", 1)
    address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    replica = live.Replica(
        DistConfig(fault_tolerance="live", lighthouse=address, replica_id=7, timeout_s=20), torch.device("cpu")
    )
    try:
        time.sleep(0.5)
        assert "replica_7" not in urllib.request.urlopen(address + "/status").read().decode()
        assert replica.quorum(0)[:2] == (0, 1)
        assert "replica_7" in urllib.request.urlopen(address + "/status").read().decode()
    finally:
        replica.close()
        server.shutdown()


def test_a_replica_without_a_lighthouse_is_told_where_to_get_one(monkeypatch):
    monkeypatch.delenv("DDPLAB_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError) as e:
        live.lighthouse_of(DistConfig(fault_tolerance="live"))
    assert "ddplab run -n N" in e.value.fix
    monkeypatch.setenv("DDPLAB_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("DDPLAB_REPLICA_ID", "4")
    cfg = DistConfig(fault_tolerance="live", lighthouse="http://elsewhere:2", replica_id=1)
    # the launcher's word wins over the settings it was started with
    assert live.lighthouse_of(cfg) == "http://127.0.0.1:1" and live.replica_id(cfg) == 4


def test_no_lighthouse_at_the_address_is_one_line_within_the_wait():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(LaunchError) as e:
        live.wait_for_lighthouse(f"http://127.0.0.1:{port}", timeout_s=1)
    assert time.monotonic() - began < 5
    assert "no lighthouse answers" in e.value.cause and "ddplab lighthouse --port" in e.value.fix


def test_a_replica_in_object_storage_is_uploaded_to_its_own_folder():
    from ddplab.config import Config
    from ddplab.train.rundir import run_url

    cfg = OmegaConf.structured(Config)
    cfg.run.dir, cfg.run.local_dir = "s3://bucket/runs", "local"
    assert run_url(cfg, "local/exp/name") == "s3://bucket/runs/exp/name"
    assert run_url(cfg, "local/exp/name/replica-3") == "s3://bucket/runs/exp/name/replica-3"


def test_a_stream_or_an_own_loader_is_one_line_asking_for_a_dataset():
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, IterableDataset

    from ddplab.train.sources import TrainData

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(100))

    for loader, dataset, said in [(None, Stream(), "a stream"), (DataLoader(range(8)), None, "a loader")]:
        exp = SimpleNamespace(train_loader=lambda loader=loader: loader, train_dataset=lambda dataset=dataset: dataset)
        with pytest.raises(ConfigError) as e:
            TrainData(exp, BatchPlan(8, 1, 1), TrainProgress(), 0, quorum=True)
        assert said in e.value.cause and "map-style Dataset" in e.value.fix
