"""What a checkpoint holds, and how a training run is put back exactly as it was.

Only tensors, numbers, strings, lists and dicts: it loads with `torch.load(weights_only=True)`. Every rank's
random state is gathered (one collective), so each continues its own stream."""

from typing import Any

import torch

from .. import __version__, seeding
from ..distributed import collectives
from ..distributed.wrapping import unwrap
from ..errors import DdplabError


def capture(t) -> dict[str, Any]:
    from omegaconf import OmegaConf

    p = t.progress
    return {"models": {name: model.state_dict() for name, model in t.models.items()},
            "optimizers": [opt.state_dict() for opt in t.optimizers], "schedulers": [s.state_dict() for s in t.schedulers],
            "scaler": t.precision.scaler.state_dict() if t.precision.scaler else None, "progress": p.state_dict(),
            "sampler": {"epoch": p.epoch, "step_in_epoch": p.step_in_epoch, "seed": int(t.cfg.seed),
                        "global_batch": t.plan.global_batch},
            "rng": collectives.gather_object(seeding.capture()), "data": t.data.state(),  # every rank's, in order
            "world_size": t.rt.world_size, "loggers": {"wandb_id": t.run_log.wandb_id},
            "eval_metrics": dict(t.last_eval), "early_stop": dict(t.early_stop), "kinds": _kinds(t),
            "ema": t.ema.state_dict() if t.ema else None, "config": OmegaConf.to_yaml(t.cfg, resolve=True),
            "versions": {"ddplab": __version__, "torch": str(torch.__version__)}}


def restore(t, state: dict[str, Any]) -> str | None:
    """Put the run back to the saved state. Returns a note for the user when something could not
    be restored exactly (another world size), else None."""
    for key, now in _kinds(t).items():  # what only this experiment, with these optimizers, can continue
        if state.get("kinds", {}).get(key, now) != now:
            raise DdplabError(f"the checkpoint was trained by {key} {state['kinds'][key]}, this run has {now}",
                              "resume from a checkpoint of this experiment and optimizers, or start a new run")
    load_weights(t, state)
    _load_list("optimizer", t.optimizers, state["optimizers"])
    _load_list("scheduler", t.schedulers, state["schedulers"])
    if t.precision.scaler and state.get("scaler"):
        t.precision.scaler.load_state_dict(state["scaler"])
    saved_batch = state["sampler"]["global_batch"]
    for key, saved, now in (("trainer.global_batch_size", saved_batch, t.plan.global_batch),
                            ("seed", state["sampler"]["seed"], int(t.cfg.seed))):  # data order and streams follow both
        if saved != now:
            raise DdplabError(f"the checkpoint was trained with {key}={saved}, this run asks for {now}",
                              f"resume with {key}={saved}, or start a new run (another run.name)")
    t.progress.load_state_dict(state["progress"], saved_batch)
    t.last_eval = dict(state.get("eval_metrics") or {})
    t.early_stop = dict(state.get("early_stop") or t.early_stop)
    data_note, rngs = t.data.restore(state.get("data"), t.progress), state["rng"]
    if len(rngs) == t.rt.world_size:
        seeding.restore(rngs[t.rt.rank])
        return data_note
    seeding.seed_rank(t.cfg.seed, t.rt.rank, t.progress.step)
    return data_note or (f"the checkpoint was written by {len(rngs)} ranks and this run has {t.rt.world_size}: the "
                         "data order continues exactly, random streams (dropout, augmentation) are re-seeded per rank")


def load_weights(t, state: dict[str, Any], source: str = "the checkpoint") -> None:
    """The networks' weights, and with trainer.ema_decay their average (none saved: the weights themselves)."""
    load_networks(t.models, state.get("models", {}), source)
    if t.ema:
        t.ema.load_state_dict(state.get("ema"))


def load_networks(models: dict[str, torch.nn.Module], saved: dict[str, Any], source: str = "the checkpoint") -> None:
    """Load each network's saved tensors, by name; an error names what is missing or does not fit."""
    missing = sorted(set(models) - set(saved))
    if missing:
        raise DdplabError(f"{source} has no network named {missing} (it has {sorted(saved)})",
                          "load a checkpoint of this experiment, or start a new run (another run.name)")
    for name, model in models.items():
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


def _kinds(t) -> dict[str, Any]:
    return {"experiment": t.identity, **{kind: [type(o).__name__ for o in objs] for kind, objs in
            (("models", t.models.values()), ("optimizers", t.optimizers), ("schedulers", t.schedulers))}}


def _load_list(kind: str, objs: list, saved: list) -> None:
    if len(objs) != len(saved):
        raise DdplabError(f"the checkpoint has {len(saved)} {kind}(s), this experiment {len(objs)}",
                          "resume from a checkpoint of this experiment")
    for obj, s in zip(objs, saved):
        obj.load_state_dict(s)
