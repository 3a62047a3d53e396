"""PowerSGD's state (distributed/powersgd.py) in this process, on a real gloo group of one rank with
DDP and torch's PowerSGD hook: the state taken apart by parameter and put back gives bitwise the
training that never saved, a restore continues it bitwise, and a restore on another world size or
matrix rank keeps what still fits. Two ranks killed and resumed are test_scaling.py's; these are the
fast tests the mutation run of the module uses (scripts/mutation.py)."""

import copy
import itertools
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab.config import DistConfig
from ddplab.distributed import comm_hooks, powersgd
from ddplab.distributed.powersgd import PowerSGDStates

pytestmark = pytest.mark.timeout(60)
# compression from the third step; the 8x16 and 16x16 matrices are compressed, the biases are not
START = 2


def _network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


class Job:
    """A network under DDP with PowerSGD registered as ddplab registers it, and its SGD."""

    def __init__(self, weights: dict, cap_mb: float = 0.0005, rank: int = 1, one_at_a_time: bool = True):
        network = _network()
        network.load_state_dict(weights)
        self.ddp = DDP(network, bucket_cap_mb=cap_mb)
        cfg = DistConfig(comm_hook="powersgd", powersgd_rank=rank, powersgd_start_iter=START)
        backend = "gloo" if one_at_a_time else "nccl"
        self.compressors = comm_hooks.register({"net": self.ddp}, cfg, backend)
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.1)

    def train(self, first: int, last: int) -> None:
        for step in range(first, last):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(6, 8, generator=g)
            self.optimizer.zero_grad()
            self.ddp(x).square().mean().backward()
            self.optimizer.step()

    def weights(self) -> dict:
        return copy.deepcopy(self.ddp.module.state_dict())


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_several_buckets_each_compressed_and_the_state_is_kept_by_parameter(gloo_group):
    job = Job(_network().state_dict())
    job.train(0, 5)
    compressor = job.compressors["net"]
    # the tiny buckets hold one or two parameters each
    assert len(compressor.layout) >= 3
    assert sorted(i for members in compressor.layout.values() for i in members) == list(range(6))
    saved = compressor.state_dict()
    assert saved["iter"] == 5 and saved["matrix_approximation_rank"] == 1
    assert sorted(saved["error"]) == list(range(6))
    # the matrices' factors: weights 0 (16x8) and 2 (16x16), and the last layer's 1x16 row is not worth it
    assert sorted(saved["p"]) == sorted(saved["q"]) == [0, 2]
    assert saved["p"][0].shape == (16,) and saved["q"][0].shape == (8,) and saved["q"][2].shape == (16,)
    assert all(saved["error"][i].numel() == p.numel() for i, p in enumerate(job.ddp.module.parameters()))


def _saving_trains_as_never_saving(cap_mb: float, one_at_a_time: bool) -> bool:
    start = _network().state_dict()
    straight = Job(start, cap_mb=cap_mb, one_at_a_time=one_at_a_time)
    straight.train(0, 8)
    saving = Job(start, cap_mb=cap_mb, one_at_a_time=one_at_a_time)
    for step in range(8):
        saving.train(step, step + 1)
        saving.compressors["net"].state_dict()
    return _equal(saving.weights(), straight.weights())


def test_taking_the_state_apart_and_back_trains_bitwise_as_never_saving(gloo_group):
    assert _saving_trains_as_never_saving(cap_mb=0.0005, one_at_a_time=True)


# NCCL's way (each bucket's future handed to DDP) on gloo runs torch's hook inside callbacks on gloo's
# own threads: on one bucket only (several in flight can take every thread and hang even one rank,
# the reason gloo gets each bucket finished first), and in a process of its own, since a future freed
# on the gloo thread that runs it can abort the process ("Resource deadlock avoided"), seen once in
# a thousand tests: the suite's process must not be the one that dies.
def test_nccls_way_taking_the_state_apart_and_back_trains_bitwise_as_never_saving(tmp_path):
    child = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "store")], capture_output=True, text=True, timeout=50
    )
    assert child.returncode == 0, child.stdout + child.stderr


@pytest.mark.parametrize("cut_at", [1, 3, 5])
def test_a_restored_state_continues_bitwise(gloo_group, cut_at):
    start = _network().state_dict()
    straight = Job(start)
    straight.train(0, 8)
    killed = Job(start)
    killed.train(0, cut_at)
    saved = killed.compressors["net"].state_dict()
    resumed = Job(killed.weights())
    resumed.compressors["net"].load_state_dict(saved, keep_errors=True)
    resumed.train(cut_at, 8)
    assert _equal(resumed.weights(), straight.weights())
    # without the state (a fresh PowerSGD) it would not be the same training
    fresh = Job(killed.weights())
    fresh.compressors["net"].state.iter = saved["iter"]
    fresh.train(cut_at, 8)
    assert cut_at < START or not _equal(fresh.weights(), straight.weights())


def test_a_restore_into_another_bucket_layout_gives_each_parameter_its_own_state(gloo_group):
    start = _network().state_dict()
    killed = Job(start, cap_mb=0.0005)
    killed.train(0, 4)
    saved = killed.compressors["net"].state_dict()
    resumed = Job(killed.weights(), cap_mb=25.0)
    compressor = resumed.compressors["net"]
    compressor.load_state_dict(saved, keep_errors=True)
    resumed.train(4, 5)
    # one bucket now (in parameter order): every parameter's error and factors went into it
    assert list(compressor.layout.values()) == [[0, 1, 2, 3, 4, 5]]
    assert compressor.waiting == {"error": {}, "p": {}, "q": {}}
    again = compressor.state_dict()
    assert sorted(again["error"]) == list(range(6)) and sorted(again["p"]) == [0, 2]


def test_state_saved_by_other_ranks_keeps_the_shared_part_and_starts_the_errors_from_zero(gloo_group):
    job = Job(_network().state_dict())
    job.train(0, 4)
    saved = job.compressors["net"].state_dict()
    resumed = Job(job.weights())
    states = PowerSGDStates(resumed.compressors, rank=0, world_size=1)
    states.load_state_dict([{"net": saved}, {"net": saved}])
    compressor = resumed.compressors["net"]
    assert compressor.waiting["error"] == {} and sorted(compressor.waiting["p"]) == [0, 2]
    assert compressor.state.iter == 4
    assert states.resume_note == (
        "PowerSGD's state was saved by 2 ranks and this run has 1: its step count and factors continue, each "
        "rank's compression error starts from zero"
    )
    # the generator continues: the next factors PowerSGD draws are the killed run's
    assert compressor.state.rng.randint(1_000_000) == job.compressors["net"].state.rng.randint(1_000_000)
    # and it trains on, the factors back in their buckets, the errors from zero
    resumed.train(4, 6)
    assert compressor.waiting == {"error": {}, "p": {}, "q": {}}


def test_each_rank_takes_back_its_own_errors_and_a_larger_world_starts_them_from_zero(gloo_group):
    job = Job(_network().state_dict())
    job.train(0, 4)
    mine = job.compressors["net"].state_dict()
    other = {**mine, "error": {i: t + 1 for i, t in mine["error"].items()}}
    # rank 1 of 2 (the state's objects take the rank and size they are given)
    second = Job(job.weights())
    PowerSGDStates(second.compressors, rank=1, world_size=2).load_state_dict([{"net": mine}, {"net": other}])
    errors = second.compressors["net"].waiting["error"]
    assert all(torch.equal(errors[i], other["error"][i]) for i in range(6))
    # saved by one rank, resumed on two: the errors of the one do not belong to either
    grown = Job(job.weights())
    states = PowerSGDStates(grown.compressors, rank=0, world_size=2)
    states.load_state_dict([{"net": mine}])
    assert grown.compressors["net"].waiting["error"] == {}
    assert states.resume_note.startswith("PowerSGD's state was saved by 1 ranks and this run has 2")


@pytest.mark.parametrize(("saved_rank", "rank"), [(1, 2), (2, 1)])
def test_factors_of_another_matrix_rank_are_not_restored(gloo_group, saved_rank, rank):
    job = Job(_network().state_dict(), rank=saved_rank)
    job.train(0, 4)
    saved = job.compressors["net"].state_dict()
    resumed = Job(job.weights(), rank=rank)
    resumed.compressors["net"].load_state_dict(saved, keep_errors=True)
    waiting = resumed.compressors["net"].waiting
    assert sorted(waiting["error"]) == list(range(6)) and waiting["p"] == {} and waiting["q"] == {}
    resumed.train(4, 6)
    # the first bucket holds the 16x8 weight alone: P is 16 x rank, Q 8 x rank, and so they are saved
    assert resumed.compressors["net"].state.p_memory_dict[0].numel() == 16 * rank
    again = resumed.compressors["net"].state_dict()
    assert again["p"][0].numel() == 16 * rank and again["q"][0].numel() == 8 * rank
    assert again["q"][2].numel() == 16 * rank


def test_a_checkpoint_without_powersgd_or_without_a_network_says_so(gloo_group):
    job = Job(_network().state_dict())
    states = PowerSGDStates(job.compressors, rank=0, world_size=1)
    states.load_state_dict(None)
    assert states.resume_note.startswith("the checkpoint holds no PowerSGD state (it was trained without dist.comm")
    states.load_state_dict([{"other": {}}])
    assert states.resume_note == "the checkpoint holds no PowerSGD state of network 'net': it starts afresh"
    saved = states.state_dict()
    assert isinstance(saved, list) and len(saved) == 1 and set(saved[0]) == {"net"}
    assert saved[0]["net"]["iter"] == 0
    assert PowerSGDStates({}, 0, 1).state_dict() is None
    nothing = PowerSGDStates({}, 0, 1)
    nothing.load_state_dict(None)
    assert nothing.resume_note is None


def test_gloo_gets_each_bucket_finished_and_nccl_its_future(gloo_group):
    one = Job(_network().state_dict(), one_at_a_time=True)
    assert one.compressors["net"].one_bucket_at_a_time
    assert not Job(_network().state_dict(), one_at_a_time=False).compressors["net"].one_bucket_at_a_time


@pytest.mark.parametrize(("shape", "matrix"), [((), (1, 1)), ((5,), (5, 1)), ((4, 3), (4, 3)), ((4, 3, 2), (4, 6))])
def test_a_gradient_is_compressed_as_a_matrix_of_its_first_dimension_by_the_rest(shape, matrix):
    assert powersgd._matrix_shape(torch.zeros(shape)) == matrix


def _interleaved_network():
    """Compressed matrices of one shape (16 x 8) with others between them: torch lays out their
    factors grouped by shape, not in the bucket's order."""
    torch.manual_seed(0)
    widths = [8, 16, 16, 8, 16]
    layers = [layer for a, b in itertools.pairwise(widths) for layer in (nn.Linear(a, b), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(16, 1))


def _compressed(one_at_a_time: bool) -> tuple[list[bool], powersgd.Compressor, nn.Module]:
    """Plain all_reduces, then compressed ones, under ddplab's hook: whether each future DDP got was
    finished when handed over, the compressor and the network."""
    network = _interleaved_network()
    ddp = DDP(network, bucket_cap_mb=25.0)
    # rank 2: a Q of one column reads the same whichever way round it is laid out
    cfg = DistConfig(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=START)
    compressor = powersgd.Compressor(list(network.parameters()), cfg, one_bucket_at_a_time=one_at_a_time)
    finished = []

    def recording(state, bucket):
        future = powersgd.Compressor.hook(state, bucket)
        finished.append(future.done())
        return future

    ddp.register_comm_hook(compressor, recording)
    for step in range(START + 3):
        ddp(torch.randn(6, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
    return finished, compressor, network


def test_on_gloo_every_bucket_is_finished_before_ddp_gets_it_and_computed_as_torchs_hook_does(gloo_group):
    """Finished futures are what keep two gloo ranks from starting a bucket's all_reduces in different
    orders. A test that waited for the hang would pass whenever the threads happened to line up, so
    the futures DDP gets on gloo must be finished when handed over. What they hold is what torch's
    hook (NCCL's) computes, up to the order of the sums in Q = M^T P."""
    finished, ours, network = _compressed(one_at_a_time=True)
    _, torchs, torch_network = _compressed(one_at_a_time=False)
    assert finished == [True] * (START + 3)
    for kept in ("error_dict", "p_memory_dict", "q_memory_dict"):
        mine, theirs = getattr(ours.state, kept), getattr(torchs.state, kept)
        assert mine.keys() == theirs.keys() == {0}
        assert torch.allclose(mine[0], theirs[0], atol=1e-6), kept
    for mine, theirs in zip(network.parameters(), torch_network.parameters(), strict=True):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6)
    assert ours.state.iter == torchs.state.iter == START + 3
    assert ours.state.total_numel_after_compression == torchs.state.total_numel_after_compression


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    sys.exit(0 if _saving_trains_as_never_saving(cap_mb=25.0, one_at_a_time=False) else 1)
