"""Random state, in one place: seed every generator, capture it, restore it.

Weights come from the run seed alone: every rank builds the same networks; from the first step each rank
has its own stream (`seed_rank`: dropout differs between ranks), kept in checkpoints for every rank so a
resume continues each (on another world size each rank is re-seeded)."""

import os
import random
from typing import Any

import numpy as np
import torch
import torch.utils.deterministic

from . import environment
from .config_rules import switch_value


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    # torch takes 64 bits: a larger seed (seed_rank adds to it) wraps, the same on every call
    torch.manual_seed(seed % 2**64)


def deterministic(mode: bool | str) -> None:
    """trainer.deterministic. Seeds make CPU runs repeat bit for bit; on CUDA, cuDNN autotuning and
    atomic adds do not repeat, so `warn`/`true` ask torch for deterministic kernels (an op without
    one warns / fails, naming itself); `false` takes the fastest ones, which differ in the last bits."""
    mode = switch_value(mode)
    on = mode is not False
    if on:
        # read when cuBLAS starts
        os.environ.setdefault(environment.CUBLAS_WORKSPACE, ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=mode == "warn")
    # a NaN fill of every torch.empty: no help here
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    """This rank's own stream, from step `step` on."""
    seed_everything(int(seed) + 7919 * (rank + 1) + 104729 * step)


def capture() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_python(saved: list) -> None:
    version, internal, gauss = saved
    random.setstate((version, tuple(internal), gauss))


def _set_cuda(saved: list) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved)


# Each random stream a checkpoint keeps, by the name capture() gives it, and how it is set back
# (a test skips one at a time and the resumed run must differ: tests/checkpoint/test_restores.py)
STREAM_SETTERS = {
    "python": _set_python,
    "numpy": lambda saved: np.random.set_state(numpy_generator_state(saved)),
    "torch": torch.set_rng_state,
    "cuda": _set_cuda,
}


def restore(state: dict[str, Any]) -> None:
    """Set every stream back, from CPU copies: torch sets a generator, CUDA's included, only from a
    CPU ByteTensor, and a state may arrive on a GPU (a checkpoint read with map_location=device)."""
    for name, saved in state.items():
        STREAM_SETTERS[name](_on_cpu(saved))


def _on_cpu(saved: Any) -> Any:
    if isinstance(saved, torch.Tensor):
        return saved.cpu()
    if isinstance(saved, list | tuple):
        return type(saved)(_on_cpu(item) for item in saved)
    return saved


def numpy_state(generator_state: tuple) -> list:
    """A numpy generator's state (`get_state()`) in types a checkpoint loads with weights_only."""
    kind, keys, pos, has_gauss, cached = generator_state
    return [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]


def numpy_generator_state(saved: list) -> tuple:
    """The inverse of `numpy_state`: what numpy's `set_state()` takes."""
    kind, keys, pos, has_gauss, cached = saved
    return kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached
