"""What a checkpoint holds, and how an experiment is put back exactly as it was.

Everything is tensors, numbers, strings, lists and dicts, so it loads with
`torch.load(weights_only=True)`: no code is unpickled. The RNG states of every rank are gathered
(one collective) so each rank continues its own random stream after a resume; on a different
world size they cannot match, and each rank's stream is re-seeded from (seed, step, rank) instead.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import DdplabError
from .wrapping import unwrap


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective: every rank must call it)."""
    mine = capture_rng()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def experiment_state(exp) -> dict[str, Any]:
    from . import __version__

    return {
        "models": {name: model.state_dict() for name, model in exp.models.items()},
        "optimizers": [opt.state_dict() for opt in exp.optimizers],
        "schedulers": [s.state_dict() for s in exp.schedulers],
        "scaler": exp.precision.scaler.state_dict() if exp.precision.scaler else None,
        "progress": {"step": exp.step, "epoch": exp.epoch, "step_in_epoch": exp.step_in_epoch},
        "sampler": {"epoch": exp.epoch, "step_in_epoch": exp.step_in_epoch, "seed": int(exp.cfg.seed),
                    "global_batch": exp.plan.global_batch},
        "rng": gather_rng(),
        "world_size": exp.rt.world_size,
        "loggers": {"wandb_id": exp._log.wandb_id},
        "eval_metrics": dict(exp.last_eval),
        "config": _config_yaml(exp.cfg),
        "versions": {"ddplab": __version__, "torch": str(torch.__version__)},
    }


def restore_experiment(exp, state: dict[str, Any]) -> str | None:
    """Put `exp` back to the saved state. Returns a note for the user when something could not be
    restored exactly (another world size), else None."""
    _load_models(exp, state["models"])
    _load_list("optimizer", exp.optimizers, state["optimizers"])
    _load_list("scheduler", exp.schedulers, state["schedulers"])
    if exp.precision.scaler and state.get("scaler"):
        exp.precision.scaler.load_state_dict(state["scaler"])
    saved_batch = state["sampler"]["global_batch"]
    if saved_batch != exp.plan.global_batch:
        raise DdplabError(
            f"the checkpoint was trained with trainer.global_batch_size={saved_batch}, this run asks for "
            f"{exp.plan.global_batch}", f"resume with trainer.global_batch_size={saved_batch}, or start fresh with run.resume=never")
    exp.step, exp.epoch, exp.step_in_epoch = (state["progress"][k] for k in ("step", "epoch", "step_in_epoch"))
    exp.last_eval = dict(state.get("eval_metrics") or {})
    rngs = state["rng"]
    if len(rngs) == exp.rt.world_size:
        restore_rng(rngs[exp.rt.rank])
        return None
    from .experiment import seed_everything

    seed_everything(int(exp.cfg.seed) + 7919 * (exp.rt.rank + 1) + 104729 * exp.step)
    return (f"the checkpoint was written by {len(rngs)} ranks and this run has {exp.rt.world_size}: the data order "
            "continues exactly, random streams (dropout, augmentation) are re-seeded per rank")


def _load_models(exp, saved: dict[str, Any]) -> None:
    missing = sorted(set(exp.models) - set(saved))
    if missing:
        raise DdplabError(f"the checkpoint has no network named {missing} (it has {sorted(saved)})",
                          "resume from a checkpoint of this experiment, or start fresh with run.resume=never")
    for name, model in exp.models.items():
        load_matching(unwrap(model), saved[name], name)


def load_matching(model: torch.nn.Module, saved: dict[str, torch.Tensor], name: str = "model") -> None:
    """load_state_dict with an error that names the mismatched keys and shapes."""
    own = model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in saved and tuple(saved[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = [f"missing {missing[:4]}" if missing else "", f"unexpected {unexpected[:4]}" if unexpected else "",
                 f"shape mismatch {shapes[:3]}" if shapes else ""]
        raise DdplabError(f"the checkpoint does not fit network '{name}': " + "; ".join(p for p in parts if p),
                          "load a checkpoint of the same model and model.* settings")
    model.load_state_dict(saved)


def _load_list(kind: str, objs: list, saved: list) -> None:
    if len(objs) != len(saved):
        raise DdplabError(f"the checkpoint has {len(saved)} {kind}(s), this experiment {len(objs)}",
                          "resume from a checkpoint of this experiment")
    for obj, s in zip(objs, saved):
        obj.load_state_dict(s)


def _config_yaml(cfg) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)
