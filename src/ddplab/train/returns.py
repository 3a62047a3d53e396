"""What the experiment's methods and its networks return, read the way users write them.

A network's forward may return a tensor, a tuple or list (nanoGPT's `(logits, loss)`, `transformers`
with `return_dict=False`), a dict, a dataclass, or a `transformers` `ModelOutput` (a dict and a
dataclass at once, with `loss` and `logits` fields). training_step may hand any of them on as it
is; evaluation_step and predict_step give named per-sample tensors. The rules:

- the loss of training_step's result: the tensor itself; the `loss` entry or field of a mapping or
  dataclass; the one one-element tensor of a tuple or list. A mapping's other numbers and tensors are
  logged beside it (a tensor as its mean), except a `ModelOutput`'s (logits, caches and hidden states
  are not metrics);
- the logits the default predict_step reads: the tensor itself, the `logits` entry or field, or the
  first tensor of a tuple or list;
- evaluation_step's and predict_step's outputs: a mapping or dataclass of per-sample tensors;
- what the default predict_step hands the network: a batch's inputs (a tuple's or list's first
  element), or a dict batch's entries by the names the network's forward takes (a tokenizer's
  `input_ids`, `attention_mask`), the others (labels under a name forward does not take) left out.

What fits no rule is one line that says what came back and what to return instead."""

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError


def fields_of(out: Any) -> dict[str, Any] | None:
    """A mapping's items or a dataclass's fields by name (a ModelOutput's set fields), else None."""
    if isinstance(out, Mapping):
        return dict(out.items())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return None


def is_model_output(out: Any) -> bool:
    """A `transformers` ModelOutput, known by its class's ancestry (transformers need not be installed)."""
    return any(klass.__name__ == "ModelOutput" for klass in type(out).__mro__)


def describe(out: Any) -> str:
    """What came back, in a few words: its type and its fields or shape."""
    named = fields_of(out)
    if named is not None:
        return f"a {type(out).__name__} with {', '.join(map(repr, named)) or 'no fields'}"
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {', '.join(describe_short(x) for x in out[:4])}"
    return f"{out!r:.60}"


def describe_short(x: Any) -> str:
    return f"tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _one_element(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.numel() == 1


def split_output(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """training_step's result as (loss, other values to log)."""
    named = fields_of(out)
    if named is not None:
        loss = named.get("loss")
        extra = {
            key: value
            for key, value in named.items()
            if key != "loss" and isinstance(value, (torch.Tensor, int, float)) and not is_model_output(out)
        }
    elif isinstance(out, (tuple, list)):
        scalars = [x for x in out if _one_element(x)]
        loss = scalars[0] if len(scalars) == 1 else None
        extra = {}
    else:
        loss, extra = out, {}
    if not _one_element(loss):
        raise ConfigError(
            f"training_step returned {describe(out)}: no one-element loss in it (a tensor, a 'loss' entry or "
            "field, or the one one-element tensor of a tuple)",
            "return the mean loss of the micro-batch, e.g. F.cross_entropy(logits, y), or {'loss': ..., 'acc': ...}",
        )
    if not loss.requires_grad:
        raise ConfigError(
            "training_step returned a loss with no gradient: it does not depend on any trainable parameter "
            "(computed under torch.no_grad(), detached, or converted with .item())",
            "return the loss as computed from the network's output, e.g. F.cross_entropy(self.net(x), y)",
        )
    return loss, extra


def logits_of(out: Any, network: str) -> torch.Tensor:
    """The logits in what `network` returned, for the default predict_step."""
    named = fields_of(out)
    if named is not None:
        found = named.get("logits")
    elif isinstance(out, (tuple, list)):
        found = next((x for x in out if isinstance(x, torch.Tensor)), None)
    else:
        found = out
    if not isinstance(found, torch.Tensor):
        raise ConfigError(
            f"the default predict_step reads logits from what network '{network}' returns, and it returned "
            f"{describe(out)}",
            "write the experiment's predict_step(batch), returning {name: one row per sample}, "
            "e.g. {'label': logits.argmax(-1)}",
        )
    return found


def per_sample(out: Any, name: str) -> dict[str, torch.Tensor]:
    """evaluation_step's or predict_step's result as {name: per-sample tensor}."""
    named = fields_of(out)
    if not named:
        raise ConfigError(
            f"{name} returned {describe(out)}, not a dict of per-sample tensors",
            "return e.g. {'loss': F.mse_loss(pred, y, reduction='none')}, one row per sample",
        )
    for key, value in named.items():
        if not (isinstance(value, torch.Tensor) and value.ndim):
            what = "one number for the whole batch" if _one_element(value) else describe(value)
            raise ConfigError(
                f"{name} returned {describe(out)}, and its {key!r} is {what}, not one row per sample",
                "return per-sample tensors, e.g. {'loss': F.cross_entropy(logits, y, reduction='none')}",
            )
    return named


def call_with_inputs(network: torch.nn.Module, batch: Any, name: str) -> Any:
    """The network run on a batch's inputs, as the default predict_step reads them (above)."""
    if not isinstance(batch, Mapping):
        return network(batch[0] if isinstance(batch, (list, tuple)) else batch)
    params = inspect.signature(network.forward).parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    inputs = {key: value for key, value in batch.items() if takes_any or key in named}
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing := [key for key in required if key not in inputs]:
        raise ConfigError(
            f"the default predict_step hands a dict batch to {name} ({type(network).__name__}) by the names its "
            f"forward takes, and forward needs {', '.join(missing)} while the batch has {', '.join(map(str, batch))}",
            "name the dataset's entries as forward's arguments, or write the experiment's predict_step(batch)",
        )
    return network(**inputs)
