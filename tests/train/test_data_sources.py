"""Training data beyond a map-style Dataset: IterableDatasets, an experiment's own loader, and shards on disk.

Real runs over gloo: the global batches at 1, 2 and 4 ranks, resume after a kill (bitwise) and on
another world size, exact evaluation of a stream, and the one-line errors (docs/data.md)."""

import functools
import json
import operator
from pathlib import Path

import pytest
import torch

import ddplab as lib
from ddplab.checkpoint.store import load_state
from ddplab.train.data import epoch_order
from fixtures.experiments import _dataset
from helpers import cuda_case, ddplab_here

EXP = "tests/fixtures/experiments.py:Streamed"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=64"]


def _source():
    # the fixture's training set
    return _dataset(512, 0, torch.float32)


def _run(tmp_path, name, kind, *args, n=2, expect=0):
    res = ddplab_here(
        "run",
        EXP,
        "-n",
        str(n),
        f"run.dir={tmp_path}",
        f"run.name={name}",
        f"data.kind={kind}",
        *COMMON,
        *args,
    )
    assert res.returncode == expect, res.stdout + res.stderr
    return res


def _end(tmp_path, name, rank=0):
    return torch.load(tmp_path / "streamed" / name / "results" / f"end-rank{rank}.pt")


def _steps_seen(tmp_path, name, world):
    """Each step's first features over all ranks, in rank order (the global batch)."""
    ranks = [torch.load(tmp_path / "streamed" / name / "results" / f"seen-rank{r}.pt") for r in range(world)]
    return [functools.reduce(operator.iadd, per_rank, []) for per_rank in zip(*ranks, strict=False)]


def _close(a, b):
    return all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stream_trains_on_its_global_batches_at_any_world_size_resumes_bitwise_and_evaluates_exactly(tmp_path):
    x = _source().tensors[0][:, 0]
    _run(tmp_path, "one", "stream", "trainer.max_epochs=2", n=1)
    out = _run(tmp_path, "two", "stream", "trainer.max_epochs=2").stdout
    assert "a resume mid-epoch reads and drops the samples of the stream trained on" in out
    one, two = _steps_seen(tmp_path, "one", 1), _steps_seen(tmp_path, "two", 2)
    # 8 steps an epoch, the stream's order, the same global batches
    assert len(one) == 16 and one == two
    # epoch 2 reads the stream again
    assert one[0] == x[:64].tolist() and one[8] == x[:64].tolist()
    assert _close(_end(tmp_path, "one")["params"], _end(tmp_path, "two")["params"])

    # every sample of the 301 eval stream once, exactly the loss of the final weights
    ex, ey = _dataset(301, 1, torch.float32).tensors
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(16, 2))
    net.load_state_dict(_end(tmp_path, "two")["params"])
    metrics = json.loads((tmp_path / "streamed" / "two" / "results" / "eval.json").read_text())
    assert metrics["n"] == 301
    assert metrics["loss"] == pytest.approx(torch.nn.functional.cross_entropy(net(ex), ey).item(), rel=1e-5)

    # killed at step 5, restarted from the step-3 checkpoint: replayed (no state_dict) or restored (state_dict)
    for kind in ("stateful", "hf"):
        _run(
            tmp_path,
            kind,
            kind,
            "trainer.max_epochs=2",
            "trainer.checkpoint_every=3",
            "fault.die_at_step=5",
            "--max-restarts",
            "1",
        )
        assert torch.equal(
            torch.cat([v.flatten() for v in _end(tmp_path, kind)["params"].values()]),
            torch.cat([v.flatten() for v in _end(tmp_path, "two")["params"].values()]),
        ), kind
    # from its state: steps 4 to 16, nothing read twice
    assert _end(tmp_path, "stateful")["yielded"] == 13 * 64
    hf = load_state(str(tmp_path / "streamed" / "hf" / "checkpoints" / "step-00000015"))["data"]
    # Hugging Face's own state, per rank
    assert len(hf) == 2 and hf[0] == hf[1] and hf[0]["examples_iterable"]

    # two ranks to step 5 (mid-epoch), then one rank to the end, replaying the stream: the one-rank run's batches
    _run(tmp_path, "moved", "stream", "trainer.max_steps=5")
    out = _run(tmp_path, "moved", "stream", "trainer.max_steps=16", n=1).stdout
    assert "resumed from" in out and _steps_seen(tmp_path, "moved", 1) == one[5:]
    # 5 steps read and dropped, 11 trained on
    assert _end(tmp_path, "moved")["yielded"] == 16 * 64
    assert _close(_end(tmp_path, "one")["params"], _end(tmp_path, "moved")["params"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_own_loaders_of_uneven_length_end_each_epoch_together_and_a_stateful_one_resumes_bitwise(tmp_path):
    # rank 1's part is 40 samples short: 7 micro-batches against rank 0's 8, so 7 steps an epoch; killed at
    # step 5 and restarted from step 3: a StatefulDataLoader restores its state, a DataLoader is read again
    for name, kind in (("straight", "loader"), ("restored", "stateful_loader"), ("replayed", "loader")):
        kill = (
            ["trainer.checkpoint_every=3", "fault.die_at_step=5", "--max-restarts", "1"] if name != "straight" else []
        )
        _run(tmp_path, name, kind, "data.short_rank1=40", "trainer.max_epochs=2", *kill)
        assert _end(tmp_path, name)["step"] == 14 and (tmp_path / "streamed" / name / "died-once").exists() == bool(
            kill
        )
    straight = _end(tmp_path, "straight")["params"]
    assert all(
        torch.equal(straight[k], v) for n in ("restored", "replayed") for k, v in _end(tmp_path, n)["params"].items()
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_without_data_and_streams_that_differ_between_ranks_are_one_line(tmp_path):
    err = _run(tmp_path, "empty", "loader", "data.short_rank1=256", "trainer.max_steps=4", expect=2).stderr
    assert (
        "Streamed.train_loader() yielded less than one step (1 micro-batch(es) of trainer.accumulate) on rank(s) [1]"
        " of 2"
        in err
        and "Traceback" not in err
    )
    err = _run(tmp_path, "skewed", "skewed", "trainer.max_epochs=1", expect=2).stderr
    assert "Streamed.train_dataset() gave the ranks different streams (samples read: [512, 502])" in err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_shards_give_the_seeded_global_order_at_1_2_and_4_ranks_and_continue_it_on_another_world_size(tmp_path):
    x, y = _source().tensors
    index = lib.write_shards(({"x.pth": x[i], "cls": int(y[i])} for i in range(512)), str(tmp_path / "data"), 100)
    args = [f"data.shards={index}", "trainer.max_steps=12", "seed=7"]
    _run(tmp_path, "one", "shards", *args, n=1)
    one = _steps_seen(tmp_path, "one", 1)
    # 8 steps of 64 an epoch
    order = torch.cat([epoch_order(512, 7, 0)[:512], epoch_order(512, 7, 1)])
    assert one == [x[order[s * 64 : (s + 1) * 64], 0].tolist() for s in range(12)]
    # two ranks, mid-epoch 0
    _run(tmp_path, "moved", "shards", *args[:1], "trainer.max_steps=5", "seed=7")
    assert _steps_seen(tmp_path, "moved", 2) == one[:5]
    # then four ranks, into epoch 1
    _run(tmp_path, "moved", "shards", *args, n=4)
    assert _steps_seen(tmp_path, "moved", 4) == one[5:]
    assert _close(_end(tmp_path, "one")["params"], _end(tmp_path, "moved")["params"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_missing_on_one_node_or_corrupt_is_one_line(tmp_path):
    x, y = _source().tensors
    for rank in (0, 1):
        lib.write_shards(({"x.pth": x[i], "cls": int(y[i])} for i in range(512)), str(tmp_path / f"r{rank}"), 100)
    (tmp_path / "r1" / "shard-000003.tar").unlink()
    index = str(tmp_path / "r{rank}" / "index.json")
    err = _run(tmp_path, "missing", "shards", f"data.shards={index}", "trainer.max_steps=2", expect=2).stderr
    assert f"1 of 6 shards of {tmp_path}/r1/index.json are missing on node " in err and "(rank 1)" in err
    assert "copy the whole dataset to every node" in err and "Traceback" not in err
    lib.write_shards(({"x.pth": x[i], "cls": int(y[i])} for i in range(512)), str(tmp_path / "r1"), 100)
    with open(tmp_path / "r1" / "shard-000002.tar", "r+b") as f:
        # the same size, bytes of its samples overwritten
        f.seek(4096)
        f.write(b"\xff" * 4096)
    err = _run(
        tmp_path, "corrupt", "shards", f"data.shards={index}", "trainer.max_steps=8", "trainer.num_workers=1", expect=2
    ).stderr
    assert f"shard {tmp_path}/r1/shard-000002.tar is corrupt: sample " in err and "cannot be decoded" in err, err
    assert "Traceback" not in err and "(rank 1)" in err


def test_shards_read_back_what_was_written_and_refuse_what_they_cannot_read(tmp_path):
    x = torch.arange(30.0).reshape(10, 3)
    index = lib.write_shards(({"x.pth": x[i], "cls": i, "txt": f"s{i}"} for i in range(10)), str(tmp_path / "d"), 4)
    data = lib.ShardedDataset(index)
    assert len(data) == 10 and [s["nsamples"] for s in data.shards] == [4, 4, 2]
    assert all(
        torch.equal(data[i]["x.pth"], x[i]) and data[i]["cls"] == i and data[i]["txt"] == f"s{i}" for i in range(10)
    )
    assert lib.ShardedDataset(index, transform=lambda s: s["cls"])[7] == 7
    again = lib.index_shards(sorted(str(p) for p in (tmp_path / "d").glob("*.tar")), str(tmp_path / "again.json"))
    # any webdataset tars
    assert [lib.ShardedDataset(again)[i]["cls"] for i in range(10)] == list(range(10))

    spec = json.loads(Path(index).read_text())
    with open(tmp_path / "v2.json", "w") as f:
        json.dump({**spec, "__kind__": "wids-shard-index-v2"}, f)
    with pytest.raises(lib.DdplabError, match=r"is format 'wids-shard-index-v2', which ddplab cannot read"):
        lib.ShardedDataset(str(tmp_path / "v2.json"))
    size = (tmp_path / "d" / "shard-000001.tar").stat().st_size
    with open(tmp_path / "d" / "shard-000001.tar", "ab") as f:
        # grown, e.g. rewritten by another tool
        f.write(b"\0" * 512)
    with pytest.raises(
        lib.DdplabError, match=rf"shard-000001.tar is corrupt: {size + 512} bytes, its index says {size}"
    ):
        lib.ShardedDataset(index)
    headers = lib.write_shards(({"cls": i} for i in range(3)), str(tmp_path / "h"))
    # then its tar headers are read, and checked
    (tmp_path / "h" / "shard-000000.tar.members.json").unlink()
    with open(tmp_path / "h" / "shard-000000.tar", "r+b") as f:
        f.write(b"\xff" * 512)
    with pytest.raises(lib.DdplabError, match=r"shard-000000.tar is corrupt or unreadable"):
        lib.ShardedDataset(headers)[0]
    pickled = lib.write_shards([{"x.pyd": [1, 2]}], str(tmp_path / "p"))
    with pytest.raises(lib.DdplabError, match=r"field 'x.pyd' is pickled, and ddplab does not unpickle data"):
        lib.ShardedDataset(pickled)[0]


def test_stream_evaluation_puts_every_rank_s_rows_back_in_stream_order():
    from ddplab.train.evaluation import StreamShard

    for n, size, world in [(10, 3, 3), (7, 2, 4), (5, 8, 2), (12, 4, 3)]:
        shards = [StreamShard(range(n), size, r, world, torch.tensor) for r in range(world)]
        rows = torch.cat(
            [torch.cat(list(s)) if n > s.rank * size else torch.empty(0, dtype=torch.long) for s in shards]
        )
        assert torch.equal(rows[shards[0].order()], torch.arange(n)), (n, size, world)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_streaming_example_writes_its_shards_once_and_evaluates_every_held_out_molecule(tmp_path):
    res = ddplab_here("run", "smiles_lm", "-n", "2", f"run.dir={tmp_path}", "trainer.max_steps=3", *COMMON[:2])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "molecules 205" in res.stdout and (tmp_path / "shards" / "smiles_lm" / "train" / "index.json").is_file()


FD_SHARING = """
import multiprocessing, os, socket, sys, time
import multiprocessing.resource_sharer as resource_sharer
from multiprocessing.connection import Client
from ddplab.train.sources import quiet_fd_sharing_thread

if sys.argv[1] == "quiet":
    quiet_fd_sharing_thread()
    quiet_fd_sharing_thread()
# offering a file descriptor to another process starts the fd-sharing thread, as a batch's shared memory does
offered = resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))
address = resource_sharer._resource_sharer._address
# the other process dies mid-handshake: the serving side's connection is lost
client = socket.socket(socket.AF_UNIX)
client.connect(address)
client.close()
time.sleep(0.5)
# a request the thread cannot serve is its own error
with Client(address, authkey=multiprocessing.current_process().authkey) as connection:
    connection.send((("no", "such"), os.getpid()))
time.sleep(0.5)
# a lost connection of the program's own, raised anywhere else, is shown
raise ConnectionResetError(104, "the program's own reset")
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hooked", [True, False])
def test_a_dead_loader_workers_lost_fd_sharing_connection_prints_nothing_and_the_threads_other_errors_still_show(
    hooked,
):
    """A DataLoader worker killed mid-handover (test_bad_input's dying worker) left a traceback of
    multiprocessing's fd-sharing thread above the run's one error line."""
    import subprocess
    import sys

    how = "quiet" if hooked else "as-is"
    res = subprocess.run([sys.executable, "-c", FD_SHARING, how], capture_output=True, text=True, timeout=25)
    assert res.returncode == 1, res.stderr
    assert "ConnectionResetError: [Errno 104] the program's own reset" in res.stderr
    shown = [line for line in res.stderr.splitlines() if line and not line.startswith(" ") and "own reset" not in line]
    lost = [line for line in shown if line.startswith(("BrokenPipeError", "ConnectionResetError", "EOFError"))]
    assert any(line.startswith("KeyError") for line in shown), res.stderr
    # without the hook the lost connection is shown: the check sees what it drops
    assert (lost == []) if hooked else (len(lost) == 1), res.stderr


@pytest.mark.parametrize("device", ["cpu", cuda_case()])
def test_batches_reach_the_device_one_copy_ahead_in_order_and_none_is_lost(device):
    """A Dataset's batches (sources.CountedSteps): on CUDA each is copied from pinned memory on a side
    stream one step ahead; on the CPU they pass through. Either way, in order, all of them, then the end."""
    from ddplab.train.sources import CountedSteps

    batches = [{"x": torch.full((1024, 256), float(i)), "i": torch.tensor([i])} for i in range(5)]
    if device == "cuda":
        batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
    feed = CountedSteps(batches, 5, torch.device(device))
    assert all(feed.has_step(step) for step in range(5)) and not feed.has_step(5)
    got = [next(feed) for _ in range(5)]
    with pytest.raises(StopIteration):
        next(feed)
    assert [b["x"].device.type for b in got] == [device] * 5
    assert [int(b["i"]) for b in got] == [0, 1, 2, 3, 4] and all(float(b["x"].mean()) == i for i, b in enumerate(got))
