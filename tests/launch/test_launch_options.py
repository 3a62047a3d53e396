"""How `ddplab run` decides to launch, the torchrun command line it builds, and the launch flags it
refuses before any worker starts."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import pytest
import torch.distributed as dist

import ddplab
from ddplab.distributed.runtime import check_distinct_devices, choose_backend, cpu_threads_per_rank
from ddplab.errors import LaunchError
from ddplab.experiments import REGISTRY
from ddplab.launch.launcher import (
    LaunchOptions,
    check_options,
    ensure_port_free,
    launch_flags,
    options_from_args,
    platform_options,
    should_launch,
    torchrun_argv,
)
from helpers import clean_env, ddplab_here, finish, free_port, start, summary_of


def test_single_node_gets_a_free_loopback_port():
    argv = torchrun_argv(LaunchOptions(nproc_per_node="2"))
    host, port = argv[argv.index("--rdzv-endpoint") + 1].split(":")
    assert host == "127.0.0.1" and int(port) > 0
    # fresh rendezvous per restart
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    # each worker reads the run plan from its environment
    assert argv[-2:] == ["-m", "ddplab.launch.worker"]


def test_the_workers_records_go_in_the_launchs_folder_unless_the_user_keeps_them():
    """Without --log-dir torch's agent would make a folder of its own for every job and leave it."""
    argv = torchrun_argv(LaunchOptions(nproc_per_node="2"), records="/scratch/records")
    assert argv[argv.index("--log-dir") + 1] == "/scratch/records" and "--tee" not in argv
    argv = torchrun_argv(LaunchOptions(nproc_per_node="2", log_dir="/mine"), records="/scratch/records")
    assert argv[argv.index("--log-dir") + 1] == "/mine" and argv[argv.index("--tee") + 1] == "3"
    assert "/scratch/records" not in argv


def test_multi_node_with_endpoint_uses_c10d_and_passes_the_timeout():
    opts = LaunchOptions(nproc_per_node="2", nnodes="2", rdzv_endpoint="10.0.0.1:29400")
    argv = torchrun_argv(opts, timeout_s=30)
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert "join_timeout=30" in argv[argv.index("--rdzv-conf") + 1]


@pytest.mark.parametrize(
    ("timeout_s", "conf", "last_call"),
    [(600, "", "last_call_timeout=30"), (20, "", "last_call_timeout=10"), (20, "last_call_timeout=5", None)],
)
def test_an_elastic_jobs_last_call_for_nodes_ends_within_its_join_timeout(timeout_s, conf, last_call):
    """With MIN nodes in, the agents wait torch's 30 s for more: past a shorter dist.timeout_s, a job
    whose minimum had joined timed out ("fewer than the 1:2 nodes joined")."""
    opts = LaunchOptions(nproc_per_node="1", nnodes="1:2", rdzv_endpoint="10.0.0.1:29400", rdzv_conf=conf or None)
    argv = torchrun_argv(opts, timeout_s=timeout_s)
    given = argv[argv.index("--rdzv-conf") + 1]
    assert f"join_timeout={timeout_s}" in given
    if last_call:
        assert last_call in given.split(",")
    else:
        assert given.count("last_call_timeout") == 1 and "last_call_timeout=5" in given


def test_multi_node_static_needs_a_master_address():
    with pytest.raises(LaunchError, match=r"--master-addr"):
        torchrun_argv(LaunchOptions(nnodes="2"))
    argv = torchrun_argv(LaunchOptions(nnodes="2", master_addr="n0", master_port=1234, node_rank=1))
    assert argv[argv.index("--node-rank") + 1] == "1"


def test_busy_port_is_reported_before_anything_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"port {port} is already in use.*--master-port"):
            ensure_port_free(port)
        with pytest.raises(LaunchError):
            torchrun_argv(LaunchOptions(nproc_per_node="2", master_port=port))


@pytest.mark.parametrize(
    "flags,env,by_hand,expected",
    [
        # plain single process: run in place
        (False, {}, False, False),
        # -n given: launch
        (True, {}, False, True),
        # inside torchrun: never nest agents
        (True, {"TORCHELASTIC_RUN_ID": "x"}, False, False),
        # srun started us
        (False, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, False, False),
        # mpirun started us
        (False, {"OMPI_COMM_WORLD_RANK": "0"}, False, False),
        # dist.rank=… : started by hand
        (True, {}, True, False),
    ],
)
def test_when_to_launch(flags, env, by_hand, expected):
    opts = LaunchOptions(nproc_per_node="2" if flags else "1")
    assert should_launch(flags, opts, env, by_hand) is expected


def test_backend_auto_takes_the_gpus_and_refuses_too_few_instead_of_training_on_the_cpu():
    # the tests see no GPU (conftest)
    assert choose_backend("auto", 2) == "gloo"
    assert choose_backend("auto", 2, gpus=0) == "gloo"
    assert choose_backend("auto", 2, gpus=2) == ("nccl" if dist.is_nccl_available() else "gloo")
    with pytest.raises(
        LaunchError,
        match=r"^2 processes on this node but only 1 GPU\(s\) are visible; pass -n 1 to "
        "train on the GPUs, or dist.backend=gloo to train on the CPU on purpose$",
    ):
        choose_backend("auto", 2, gpus=1)
    # the CPU, on purpose
    assert choose_backend("gloo", 2, gpus=1) == "gloo"
    with pytest.raises(LaunchError, match=r"dist.backend=gloo or dist.backend=auto"):
        choose_backend("nccl", 1, gpus=0)
    with pytest.raises(LaunchError, match=r"unknown backend"):
        choose_backend("ucc2", 1)


def test_two_ranks_on_one_physical_gpu_are_refused():
    check_distinct_devices([("h0", "gpu-a"), ("h0", "gpu-b"), ("h1", "gpu-a")])
    with pytest.raises(LaunchError, match=r"ranks 0 and 2 use the same GPU"):
        check_distinct_devices([("h0", "gpu-a"), ("h0", "gpu-b"), ("h0", "gpu-a")])


def test_cpu_threads_are_split_between_local_ranks():
    # the cores this process may use, as the OS says
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads_per_rank(1) == cores
    assert cpu_threads_per_rank(2) == max(1, cores // 2)
    assert cpu_threads_per_rank(10_000) == 1


def test_sagemaker_hosts_become_the_launch_of_nodes():
    """Host i of SM_HOSTS (sorted) is node i; the first host is where the nodes meet."""
    from ddplab.distributed.cluster import detect, sagemaker_procs_per_host
    from ddplab.launch.launcher import sagemaker_options

    env = {
        "SM_HOSTS": '["algo-2", "algo-1", "algo-3"]',
        "SM_CURRENT_HOST": "algo-3",
        "SM_NUM_GPUS": "4",
        "MASTER_PORT": "7000",
    }
    opts = sagemaker_options(LaunchOptions(), detect(env), sagemaker_procs_per_host(env))
    assert (opts.nnodes, opts.node_rank, opts.nproc_per_node) == ("3", 2, "4")
    assert (opts.master_addr, opts.master_port) == ("algo-1", 7000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["-n", "0"], "-n 0: workers per node must be a whole number above 0"),
        (["-n", "-1"], "-n -1: workers per node must be a whole number above 0"),
        (["-n", "abc"], "-n abc: workers per node must be a whole number above 0"),
        (["--nnodes", "0"], "--nnodes 0: the number of nodes must be N, or MIN:MAX with 1 <= MIN <= MAX"),
        (["--nnodes", "3:2"], "--nnodes 3:2: the number of nodes must be N, or MIN:MAX"),
        (["-n", "2", "--max-restarts", "-1"], "--max-restarts -1 is below 0"),
        (["-n", "2", "--master-port", "70000"], "--master-port: port 70000 is not between 1 and 65535"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "--node-rank 2 is not one of the 2"),
        (["-n", "2", "--local-ranks-filter", "5"], "--local-ranks-filter 5 names no local rank of -n 2"),
        (["-n", "2", "dist.world_size=3"], "launch flags start the ranks and connect them, and dist.world_size"),
        (["-n", "2", "dist.init_method=env://"], "and dist.init_method says they are started by hand"),
        (
            ["--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:1", "trainer.global_batch_size=8"],
            "--nnodes 1:3 with -n 1 may run on 3 ranks, where trainer.global_batch_size=8 does not divide into 3 ranks",
        ),
        (
            ["--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:1", "trainer.global_batch_size=8"],
            "use trainer.global_batch_size=12 (it serves",
        ),
        (["-n", "2", "trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
        (["-n", "4", "trainer.global_batch_size=2"], "smaller than the world size (4 ranks)"),
    ],
)
def test_every_launch_flag_is_checked_before_any_worker_starts(tmp_path, flags, message):
    res = ddplab_here("run", "tests/fixtures/experiments.py:Classifier", *flags, f"run.dir={tmp_path}")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert message in lines[0]
    assert not (tmp_path / "classifier").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_static_rendezvous_waits_for_missing_nodes_no_longer_than_the_timeout(tmp_path):
    port = str(free_port())
    flags = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port]
    started = time.monotonic()
    res = ddplab_here(
        "run", "tests/fixtures/experiments.py:Classifier", *flags, "dist.timeout_s=2", f"run.dir={tmp_path}"
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and time.monotonic() - started < 60, res.stdout + res.stderr
    assert "rendezvous timed out after 2 s (dist.timeout_s): 1 of the 2 nodes asked for" in lines[0]


def test_an_elastic_job_restarts_after_a_failure_by_default_and_a_fixed_one_does_not():
    from ddplab.launch.launcher import check_options

    for nnodes, restarts in (("1:2", 3), ("2", 0), ("2:2", 0), ("1", 0)):
        opts = LaunchOptions(nnodes=nnodes, rdzv_endpoint="127.0.0.1:29400")
        check_options(opts)
        assert opts.max_restarts == restarts, nnodes
    given = LaunchOptions(nnodes="1:2", max_restarts=0)
    check_options(given)
    assert given.max_restarts == 0


def test_the_resume_command_keeps_the_launch_flags_it_was_given():
    from ddplab.launch.launcher import check_options, launch_flags

    opts = LaunchOptions(nproc_per_node="2", nnodes="1:4", rdzv_endpoint="head:29400", rdzv_conf="last_call_timeout=5")
    check_options(opts)
    flags = launch_flags(opts)
    # the default restarts of an elastic job are left out: the same command gets them again
    assert flags == [
        "-n",
        "2",
        "--nnodes",
        "1:4",
        "--rdzv-endpoint",
        "head:29400",
        "--rdzv-conf",
        "last_call_timeout=5",
    ]
    opts.max_restarts = 7
    assert launch_flags(opts) == [*flags[:8], "--max-restarts", "7"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_rendezvous_store_refuses_a_bad_or_busy_port():
    res = ddplab_here("rendezvous", "--port", "70000")
    assert res.returncode == 2 and "--port 70000 is not between 1 and 65535" in res.stderr, res.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = ddplab_here("rendezvous", "--host", "127.0.0.1", "--port", str(port))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], res.stderr


def test_torchruns_environment_from_a_platform_is_read_and_flags_win():
    """Kubeflow's PyTorchJob hands torchrun its flags as PET_* variables on each pod."""
    pod = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0"}
    found = platform_options({**pod, "PET_MASTER_PORT": "23456", "PET_RDZV_ID": "job"}, given={})
    assert found == {
        "nnodes": "2", "nproc_per_node": "4", "node_rank": 1, "master_addr": "job-master-0", "master_port": 23456,
        "rdzv_id": "job",
    }  # fmt: skip
    assert platform_options({"PET_NPROC_PER_NODE": "4"}, given={"nproc_per_node": "2"}) == {"nproc_per_node": "4"}
    with pytest.raises(LaunchError, match="PET_NODE_RANK='one' is not a whole number"):
        platform_options({"PET_NODE_RANK": "one"}, given={})
    with pytest.raises(LaunchError, match="--nnodes 3 contradicts PET_NNODES=2:4"):
        platform_options({"PET_NNODES": "2:4"}, given={"nnodes": "3"})


@pytest.mark.parametrize(
    ("pod", "flags", "cause"),
    [
        ({"PET_NNODES": "0"}, {}, "PET_NNODES=0: the number of nodes must be N"),
        ({"PET_NPROC_PER_NODE": "many"}, {}, "PET_NPROC_PER_NODE=many: workers per node must be a whole number"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, {}, "PET_NODE_RANK=2 is not one of the 2 node(s) of PET_NNODES=2"),
        ({"PET_MAX_RESTARTS": "-1"}, {}, "PET_MAX_RESTARTS=-1 is below 0"),
        (
            {"PET_RDZV_BACKEND": "zookeeper"},
            {},
            "PET_RDZV_BACKEND=zookeeper: torch's agent knows the rendezvous backends",
        ),
        ({"PET_NNODES": "2"}, {"node_rank": 3}, "--node-rank 3 is not one of the 2 node(s) of PET_NNODES=2"),
        ({}, {"rdzv_backend": "zookeeper"}, "--rdzv-backend zookeeper: torch's agent knows"),
    ],
)
def test_a_refusal_names_the_variable_or_flag_the_user_actually_set(pod, flags, cause):
    """A platform's PET_* value is named as that variable, never as a flag the user did not type."""
    args = argparse.Namespace(**{**dict.fromkeys(LaunchOptions.__dataclass_fields__), **flags})
    with pytest.raises(LaunchError) as refused:
        check_options(options_from_args(args, pod)[0])
    assert refused.value.cause.startswith(cause), refused.value.cause
    fix = refused.value.fix
    assert fix.startswith("pass --" if flags else "set PET_") or fix.startswith("number the nodes 0 to"), fix


def test_the_command_that_continues_a_pod_leaves_out_what_its_platform_sets():
    """On each pod the platform sets PET_* again: "To continue" repeats only the flags typed."""
    args = argparse.Namespace(**dict.fromkeys(LaunchOptions.__dataclass_fields__))
    args.max_restarts = 2
    opts, explicit = options_from_args(args, {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1"})
    assert explicit and (opts.nnodes, opts.nproc_per_node, opts.node_rank) == ("2", "4", 1)
    assert launch_flags(opts) == ["--max-restarts", "2"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pod_with_pet_variables_launches_as_they_say_and_a_contradiction_is_one_line(tmp_path):
    common = ["run", "tests/fixtures/experiments.py:Classifier", f"run.dir={tmp_path}", "trainer.max_steps=2"]
    pod = clean_env(PET_NNODES="1", PET_NPROC_PER_NODE="2")
    res = ddplab_here(*common, "trainer.progress=false", env=pod)
    assert res.returncode == 0 and "2 process(es) on cpu" in res.stdout, res.stdout + res.stderr
    res = ddplab_here(*common, "-n", "1", "run.name=one", env=pod)
    assert res.returncode == 0 and "1 process(es) on cpu" in res.stdout, res.stdout + res.stderr
    res = ddplab_here(*common, "--nnodes", "2", env=pod)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "--nnodes 2 contradicts PET_NNODES=1" in lines[0], res.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_torchx_dist_ddp_command_line_runs_an_experiment(tmp_path):
    """What `torchx run -s local_cwd dist.ddp -j 1x2 -m ddplab run NAME ...` starts (TorchX 0.7's
    dist.ddp component, whose bash -c line this is, with the environment it sets): torchrun under
    TorchX's flags. TorchX itself cannot be installed beside ddplab's pins (it needs urllib3 < 1.27)."""
    torchx = [
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--rdzv_id", "ddplab-x1y2z3", "--nnodes", "1",
        "--nproc_per_node", "2", "--tee", "3", "--role", "", "-m", "ddplab", "run",
    ]  # fmt: skip
    target = ["tests/fixtures/experiments.py:Classifier", f"run.dir={tmp_path}", "run.name=tx", "trainer.max_steps=4"]
    env = clean_env(TORCHX_TRACKING_EXPERIMENT_NAME="default-experiment", LOGLEVEL="WARNING")
    code, out, err = finish(start(*torchx, *target, module="torch.distributed.run", env=env), 100, "torchx")
    # the workers are ddplab's, which leave by os._exit: no abort at exit to allow for
    assert code == 0, out + err
    summary = summary_of(tmp_path / "classifier" / "tx")
    assert summary["status"] == "finished" and summary["plan"]["world_size"] == 2 and summary["step"] == 4


def _failure(tmp_path, rank: int, said: str, mtime_ns: int):
    """A rank's failure as torch's agent reads it back: its error file, written at `mtime_ns`."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error_{rank}.json"
    stamp = 1795705784
    path.write_text(json.dumps({"message": {"message": said, "extraInfo": {"timestamp": str(stamp)}}}))
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def test_the_first_recorded_failure_is_named_even_within_the_same_second_and_equal_ones_as_rank_0(tmp_path):
    """torch's failure timestamps are whole seconds: a cause on rank 1 and a consequence on rank 0
    recorded 0.2 s later (its DataLoader worker dying as the job was torn down) used to be named as
    rank 0's. The files' own times order them; the same error on both ranks is rank 0's."""
    from ddplab.launch.failures import root_cause

    t = 1795705784 * 10**9
    cause = _failure(tmp_path, 1, "DdplabError: shard 2 is corrupt", t)
    consequence = _failure(tmp_path, 0, "DdplabError: a DataLoader worker of rank 0 died", t + 2 * 10**8)
    assert root_cause({0: consequence, 1: cause})[0] == 1
    same = [_failure(tmp_path, r, "DdplabError: no compiler", t + (1 - r) * 10**8) for r in (0, 1)]
    assert root_cause({0: same[0], 1: same[1]})[0] == 0


def test_a_rank_that_only_lost_contact_is_named_last_after_any_failure_of_its_own():
    """Nothing recorded: a rank that failed on its own (exit 1) is the cause before one that lost
    contact (PEER_LOST_EXIT_CODE), which in turn comes before one the agent SIGTERMed as it stopped
    the job."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddplab.errors import PEER_LOST_EXIT_CODE
    from ddplab.launch.failures import root_cause

    def failed(rank, code):
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="/nonexistent/error.json")

    lost, own, stopped = failed(0, PEER_LOST_EXIT_CODE), failed(1, 1), failed(2, -signal.SIGTERM)
    assert root_cause({0: lost, 1: own, 2: stopped})[0] == 1
    assert root_cause({0: lost, 2: stopped})[0] == 0


@pytest.mark.timeout(30)
def test_the_command_lines_help_answers_without_importing_torch():
    # `ddplab --help` and each command's took 2.6 s of importing torch and the training loop
    listing = "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'optuna'})"
    code = (
        "import sys\nfrom ddplab.launch.cli import main\n"
        "for argv in (['--help'], ['--version'], ['run', '--help'], ['sweep', '--help'], ['lighthouse', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
        f"print({listing})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=25)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-300:]
    # run's help names the experiments that ship with ddplab
    assert "experiments that ship with ddplab: " in done.stdout and all(name in done.stdout for name in REGISTRY)
    # the version, and torch's, from the installed packages' records

    assert f"ddplab {ddplab.__version__} (torch {version('torch')})" in done.stdout
