"""`ddplab doctor`: torch, backends, CUDA devices, CPU cores and the detected cluster environment,
then a real 2-process gloo all_reduce on loopback through the launcher: does this machine work?"""

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
    code = launch_function("ddplab.experiments.commbench:doctor_probe", ["dist.backend=gloo", "dist.timeout_s=30"], 2, 30)
    verdict = "pass" if code == 0 else f"FAIL (exit code {code})"
    _line("2-process gloo", f"{verdict}, {time.perf_counter() - started:.1f} s from launch to exit")
    return 0 if code == 0 else 1


def _line(key: str, value: str) -> None:
    print(f"{key:>16}  {value}", flush=True)
