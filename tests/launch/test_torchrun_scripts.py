"""A plain script written for torchrun (its own process group or ddplab.init(), its own DDP wrapping
and collectives) runs under `ddplab run` at every world size, one included, exactly as under torchrun."""

import json

import pytest

from helpers import FIXTURES, ddplab_here, finish, start

SCRIPT = str(FIXTURES / "ddp_tutorial.py")


# gloo can abort a worker at interpreter exit after a run that finished (docs/decisions.md): ddplab's
# workers leave by os._exit, torchrun's cannot, so torchrun's runs may end so once they printed
GLOO_EXIT_ABORT = "terminate called without an active exception"


def _result(*command: str, module: str) -> dict:
    """The script's RESULT line under torchrun (a process of its own) or ddplab (its launcher here)."""
    if module == "ddplab":
        res = ddplab_here(*command)
        code, out, err = res.returncode, res.stdout, res.stderr
    else:
        code, out, err = finish(start(*command, module=module), 80, " ".join(command))
    torchrun_exit_abort = module == "torch.distributed.run" and GLOO_EXIT_ABORT in err and "RESULT " in out
    assert code == 0 or torchrun_exit_abort, out + err
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_a_torchrun_script_runs_under_ddplab_as_under_torchrun(world):
    under_torchrun = _result("--nproc-per-node", str(world), SCRIPT, module="torch.distributed.run")
    assert under_torchrun["world"] == world
    # ddplab.init() in a world of one gives the script a group of one, as init_process_group does
    assert _result("--nproc-per-node", str(world), SCRIPT, "--ddplab-init", module="torch.distributed.run") == (
        under_torchrun
    )
    for init in ([], ["--ddplab-init"]):
        assert _result("run", SCRIPT, "-n", str(world), *init, module="ddplab") == under_torchrun


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_script_that_destroys_its_group_then_frees_its_model_or_makes_it_again_ends_every_time():
    """torch 2.13 can hang at both (runtime.mend_destroy_process_group): forty subgroups' endings in
    a row, then the default group's, then the default group made again and ended nineteen times,
    each rank to its last line."""
    script = str(FIXTURES / "group_teardown.py")
    res = ddplab_here("run", script, "-n", "2", "40", "20")
    code, out, err = res.returncode, res.stdout, res.stderr
    assert code == 0, out + err
    assert sorted(line.split()[-1] for line in out.splitlines() if "DONE" in line) == ["0", "1"], out + err
