"""`ddplab doctor`: torch, backends, CUDA devices, CPU cores and the detected cluster environment,
then a real 2-process gloo all_reduce on loopback through the launcher: does this machine work?"""

import importlib
import importlib.util
import os
import platform
import time

import torch
import torch.distributed as dist

from ..distributed.cluster import detect
from ..errors import DdplabError
from .commbench import measure


def doctor(launch_function) -> int:
    """`launch_function` is the launcher's (launch/launcher.py): the check starts real processes."""
    _line("python", platform.python_version())
    _line("torch", torch.__version__)
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    backends = [name for name, ok in available.items() if ok]
    _line("backends", ", ".join(backends) or "none (torch.distributed unavailable)")
    # none without CUDA
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    _line("cuda devices", f"{len(gpus)}: {', '.join(gpus)}" if gpus else "none")
    _line("cpu cores", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))
    try:
        found = detect(os.environ)
        where = f"rank {found.rank} of {found.world_size}, master {found.master_addr}:{found.master_port}"
        _line("environment", f"{found.source} ({where})")
    except DdplabError as e:
        _line("environment", f"inconsistent: {e}")
    for name, state in companions().items():
        _line(name, state)
    started = time.perf_counter()
    code = launch_function("ddplab.tools.doctor:probe", ["dist.backend=gloo", "dist.timeout_s=30"], 2, 30)
    verdict = "pass" if code == 0 else f"FAIL (exit code {code})"
    _line("2-process gloo", f"{verdict}, {time.perf_counter() - started:.1f} s from launch to exit")
    return 0 if code == 0 else 1


def companions(names: tuple[str, ...] = ("torchvision", "torchaudio")) -> dict[str, str]:
    """torch's companion packages that are installed, and whether they import with this torch: the
    package index's torchvision is a CUDA build that cannot load beside a CPU torch, and transformers
    then fails to import its models with an unrelated message."""
    found = {}
    for name in names:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            module = importlib.import_module(name)
            found[name] = f"{getattr(module, '__version__', '?')}, imports"
        except Exception as e:
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            found[name] = (
                f"cannot be imported with torch {torch.__version__} ({cause}): a build for another torch; "
                "install the one that matches it (docs/models.md)"
            )
    return found


def _line(key: str, value: str) -> None:
    print(f"{key:>16}  {value}", flush=True)


def probe(cfg) -> None:
    """The 2-process check, on each rank of the job the doctor launches: the sum is right, then a
    short all_reduce benchmark."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    if total.item() != expected:
        raise RuntimeError(f"all_reduce gave {total.item()}, expected {expected}")
    cpu = torch.device("cpu")
    small = measure("all_reduce", 1024, cpu, iters=20)
    big = measure("all_reduce", 4 * 2**20, cpu, iters=20)
    if rank == 0:
        _line(
            "all_reduce",
            f"sum correct; 1 KiB median {small['time_us']:.0f} us; 4 MiB busbw {big['busbw_GBps']:.2f} GB/s "
            "(ddplab bench comm for more)",
        )
