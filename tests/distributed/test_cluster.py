"""Cluster detection from faked environments: every path, no processes needed."""

import json

import pytest

from ddplab.config import DistConfig
from ddplab.distributed.cluster import agent_and_launcher_ports, detect, first_host, tasks_on_node
from ddplab.errors import LaunchError


def test_nothing_set_is_a_single_process():
    c = detect({})
    assert (c.source, c.rank, c.world_size, c.distributed) == ("single", 0, 1, False)


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RUN_ID": "x",
    }
    c = detect(env)
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size) == ("torchelastic", 3, 8, 1, 2)
    assert (c.node_rank, c.num_nodes, c.master_addr, c.master_port) == (1, 4, "10.0.0.5", 1234)
    assert c.init_method == "env://"


def test_workers_of_ddplabs_launcher_meet_in_its_store():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x", "MASTER_PORT": "1234"}
    assert not detect(env).shared_store
    c = detect({**env, "DDPLAB_STORE_PORT": "4321"})
    assert (c.master_addr, c.master_port, c.shared_store) == ("127.0.0.1", 4321, True)
    # torch's agent sharing its own store
    c = detect({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (c.master_port, c.shared_store) == (1234, True)
    # an address given in dist.* replaces the launcher's store
    c = detect({**env, "DDPLAB_STORE_PORT": "4321"}, DistConfig(master_port=5555))
    assert (c.master_port, c.shared_store) == (5555, False)
    # a plain script's own rendezvous: pointed from the agent's port to the launcher's store
    assert agent_and_launcher_ports({**env, "DDPLAB_STORE_PORT": "4321"}) == ("1234", "4321")
    assert agent_and_launcher_ports(env) is None
    # a variable left from a launch in a process not started by torch's agent
    assert agent_and_launcher_ports({"MASTER_PORT": "1234", "DDPLAB_STORE_PORT": "4321"}) is None


def test_plain_env_variables_without_torchrun():
    # on this machine: each rank is its own local rank
    c = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "5"})
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size, c.num_nodes) == ("env", 1, 2, 1, 2, 1)
    # a Kubeflow PyTorchJob without torchrun: one process a pod, the master a service name
    c = detect({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (3, 4, 0, 1)
    assert (c.node_rank, c.num_nodes, c.master_addr, c.master_port) == (3, 4, "job-master-0", 23456)


def test_slurm_environment_with_compressed_tasks_and_bracket_nodelist():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x3)",
        "SLURM_JOB_NODELIST": "node[01-04,07]",
        "SLURM_NNODES": "3",
        "SLURM_JOB_ID": "4242",
    }
    c = detect(env)
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size) == ("slurm", 5, 6, 1, 2)
    assert (c.node_rank, c.num_nodes, c.master_addr) == (2, 3, "node01")
    assert c.master_port == 15000 + 4242 % 20000


def test_slurm_step_values_win_over_job_values():
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NODELIST": "gpu-a17",
        "SLURM_JOB_NODELIST": "gpu-a[17-20]",
        "MASTER_PORT": "3333",
    }
    c = detect(env)
    assert (c.world_size, c.local_world_size, c.master_addr, c.master_port) == (2, 2, "gpu-a17", 3333)


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("node[01-04,07]", "node01"),
        ("node07", "node07"),
        ("a[3,5-6],b[1-2]", "a3"),
        ("rack1-[08-09]-gpu", "rack1-08-gpu"),
        ("c[1-2]n[3-4]", "c1n3"),
        ("gpu3,gpu4", "gpu3"),
    ],
)
def test_first_host_of_slurm_nodelists(nodelist, host):
    assert first_host(nodelist) == host


def test_tasks_per_node_expansion():
    assert [tasks_on_node("4(x2),3", i) for i in range(3)] == [4, 4, 3]
    with pytest.raises(LaunchError):
        tasks_on_node("four", 0)


def test_openmpi_environment():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "n0",
    }
    c = detect(env)
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == ("mpi", 3, 4, 1, 2, 1)
    assert c.master_addr == "n0"


def test_mpich_pmi_environment_on_one_node_defaults_to_loopback():
    c = detect({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (c.source, c.rank, c.world_size, c.master_addr) == ("mpi", 1, 2, "127.0.0.1")


def test_mpi_across_nodes_without_master_addr_is_a_clear_error():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match=r"MASTER_ADDR"):
        detect(env)


def test_sagemaker_environment():
    env = {"SM_HOSTS": json.dumps(["algo-2", "algo-1"]), "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "0"}
    c = detect(env)
    assert (c.source, c.node_rank, c.num_nodes, c.master_addr) == ("sagemaker", 1, 2, "algo-1")


def test_explicit_config_wins_over_every_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    c = detect(env, DistConfig(rank=1, world_size=2, master_addr="127.0.0.1", master_port=4000))
    assert (c.source, c.rank, c.world_size, c.local_rank, c.local_world_size) == ("config", 1, 2, 1, 2)
    assert c.master_port == 4000


def test_explicit_remote_master_means_one_process_per_host():
    c = detect({}, DistConfig(rank=1, world_size=2, master_addr="10.1.2.3"))
    assert (c.local_rank, c.local_world_size, c.node_rank) == (0, 1, 1)


def test_explicit_tcp_and_file_init_methods():
    c = detect({}, DistConfig(rank=1, world_size=2, init_method="tcp://10.0.0.1:2345"))
    assert (c.master_addr, c.master_port, c.init_method) == ("10.0.0.1", 2345, None)
    c = detect({}, DistConfig(rank=1, world_size=2, init_method="file:///tmp/rdzv"))
    assert c.init_method == "file:///tmp/rdzv"
    with pytest.raises(LaunchError, match=r"not understood"):
        detect({}, DistConfig(rank=0, world_size=2, init_method="udp://x:1"))


def test_master_address_override_applies_on_top_of_mpi():
    c = detect({"PMI_RANK": "0", "PMI_SIZE": "2"}, DistConfig(master_addr="10.9.9.9", master_port=7777))
    assert (c.source, c.master_addr, c.master_port) == ("mpi", "10.9.9.9", 7777)


def test_rank_beyond_world_size_is_rejected():
    with pytest.raises(LaunchError, match=r"rank 2 is out of range for world size 2"):
        detect({}, DistConfig(rank=2, world_size=2, master_addr="127.0.0.1"))


def test_nonzero_rank_without_master_address_is_rejected():
    with pytest.raises(LaunchError, match=r"dist.master_addr"):
        detect({}, DistConfig(rank=1, world_size=2))


def test_rank_without_world_size_is_rejected():
    with pytest.raises(LaunchError, match=r"dist.world_size"):
        detect({}, DistConfig(rank=0))


def test_an_explicit_env_init_method_reads_the_variables_torch_documents_for_it():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234", "LOCAL_RANK": "1"}
    c = detect(env, DistConfig(init_method="env://"))
    assert (c.rank, c.world_size, c.master_addr, c.master_port, c.local_rank) == (1, 2, "10.0.0.5", 1234, 1)
    c = detect(
        {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}, DistConfig(init_method="env://", rank=0, world_size=3)
    )
    assert (c.rank, c.world_size, c.master_port) == (0, 3, 1234)
    with pytest.raises(LaunchError, match=r"env:// reads RANK and WORLD_SIZE from the environment"):
        detect({}, DistConfig(init_method="env://"))
