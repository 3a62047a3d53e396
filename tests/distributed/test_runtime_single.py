"""A world of one: no process group, yet every helper works the same way."""

import torch

import ddplab
from ddplab import runtime


def test_single_process_runtime_and_helpers(capsys):
    with ddplab.init(env={}) as rt:
        assert (rt.rank, rt.world_size, rt.is_main, rt.is_local_main, rt.distributed) == (0, 1, True, True, False)
        assert rt.device == torch.device("cpu") and rt.backend == "gloo"
        # idempotent
        assert ddplab.init() is rt
        rt.barrier()
        ddplab.print0("from rank zero")
        ddplab.print_rank("no prefix in a world of one")
        assert ddplab.rank_zero_only(lambda: 42)() == 42
        assert ddplab.local_rank_zero_only(lambda: 7)() == 7
    out = capsys.readouterr().out
    assert "from rank zero\n" in out and "no prefix in a world of one\n" in out and "[rank" not in out
    assert runtime._current is None


def test_current_without_init_is_a_single_process():
    rt = ddplab.current()
    assert (rt.rank, rt.world_size, rt.is_main) == (0, 1, True)
