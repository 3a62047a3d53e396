"""`ddplab doctor`: what this machine offers for distributed training, and whether it works.

Prints the torch version, available backends, CUDA devices, CPU cores and the detected cluster
environment, then runs a real 2-process gloo all_reduce on loopback through the launcher."""

import os, platform, time

import torch
import torch.distributed as dist

from ..distributed.cluster import detect
from ..errors import DdplabError


def doctor(launch_function) -> int:
    """`launch_function` is the launcher's (launch/launcher.py): the check starts real processes."""
    _line("python", platform.python_version())
    _line("torch", torch.__version__)
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    _line("backends", ", ".join(backends) or "none (torch.distributed unavailable)")
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]  # none without CUDA
    _line("cuda devices", f"{len(gpus)}: {', '.join(gpus)}" if gpus else "none")
    _line("cpu cores", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))
    try:
        c = detect(os.environ)
        _line("environment", f"{c.source} (rank {c.rank} of {c.world_size}, master {c.master_addr}:{c.master_port})")
    except DdplabError as e:
        _line("environment", f"inconsistent: {e}")
    started = time.perf_counter()
    code = launch_function("ddplab.tools.doctor:allreduce_probe", ["dist.backend=gloo", "dist.timeout_s=30"], 2, 30)
    verdict = "pass" if code == 0 else f"FAIL (exit code {code})"
    _line("2-process gloo", f"{verdict}, {time.perf_counter() - started:.1f} s from launch to exit")
    return 0 if code == 0 else 1


def allreduce_probe(cfg) -> None:
    """Runs on each of the 2 ranks: checks the sum, then a short `ddplab bench comm` of all_reduce."""
    from ..experiments.commbench import measure

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    if t.item() != expected:
        raise RuntimeError(f"all_reduce gave {t.item()}, expected {expected}")
    small, big = (measure("all_reduce", size, torch.device("cpu"), iters=20) for size in (1024, 4 * 2**20))
    if rank == 0:
        _line("all_reduce", f"sum correct; 1 KiB median {small['time_us']:.0f} us; "
                            f"4 MiB busbw {big['busbw_GBps']:.2f} GB/s (ddplab bench comm for more)")


def _line(key: str, value: str) -> None:
    print(f"{key:>16}  {value}", flush=True)
