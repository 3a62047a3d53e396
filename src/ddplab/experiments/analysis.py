"""Post-training analyses of alignment_stats, exact over a test set split across ranks.

Every quantity is a sum over samples that ranks add up (losses, correct counts, Σx, ΣxxT), so
the results are true weighted averages equal to a single-process run's — never means of
per-rank means, never a duplicated sample. Each analysis packs all its numbers into one
all_reduce.

- targeted dropout: remove the highest-, lowest- or randomly-aligned fraction of a layer's
  neurons (all hidden layers at once, then each alone; the classification layer never), and
  measure loss and accuracy;
- eigenfeatures: eigen-decomposition of each layer input's covariance over the whole test set;
- eigenfeature dropout: project a fully connected layer's input onto the kept eigenvectors
  (dropping the highest- or lowest-variance fraction), rescaled to keep the total variance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .alignment import DistributedMoments, alignment

DROPOUT_MODES = ("high", "low", "random")
EIGEN_MODES = ("high", "low")


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


@torch.no_grad()
def layer_moments(nets: list[nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple]]:
    """(mean, covariance) of every layer's input, per net, over every rank's test samples."""
    out = []
    for net in nets:
        dims = [w.shape[1] for w in net.alignment_weights()]
        device = batches[0][0].device if batches else next(net.parameters()).device
        moments = [DistributedMoments(d, device) for d in dims]
        for x, _ in batches:
            _, inputs = net(x, capture=True)
            for m, inp in zip(moments, inputs, strict=False):
                m.add(inp)
        out.append([m.covariance() for m in moments])
    return out


@torch.no_grad()
def _loss_and_correct(net, batches, **kwargs) -> torch.Tensor:
    """Local [Σ loss, Σ correct, n] of one configuration."""
    totals = torch.zeros(3, dtype=torch.float64)
    for x, y in batches:
        logits = net(x, **kwargs)
        totals += torch.tensor(
            [F.cross_entropy(logits, y, reduction="sum").item(), (logits.argmax(1) == y).sum().item(), len(y)],
            dtype=torch.float64,
        )
    return totals


def _finish(local: torch.Tensor) -> torch.Tensor:
    """[..., 3] local sums -> [..., 2] global (mean loss, accuracy)."""
    total = _all_reduce(local)
    n = total[..., 2].clamp_min(1)
    return torch.stack([total[..., 0] / n, total[..., 1] / n], dim=-1)


def targeted_dropout(nets, batches, moments, fractions, seed: int) -> tuple[torch.Tensor, list[str]]:
    """Array (modes, scopes, fractions, nets, [loss, accuracy]) and the scope names."""
    hidden = list(range(len(nets[0].alignment_layers) - 1))
    scopes = [hidden] + [[layer] for layer in hidden]
    names = ["all"] + [f"layer{layer}" for layer in hidden]
    local = torch.zeros(len(DROPOUT_MODES), len(scopes), len(fractions), len(nets), 3, dtype=torch.float64)
    for r, net in enumerate(nets):
        scores = [alignment(w, cov) for w, (_, cov) in zip(net.alignment_weights(), moments[r], strict=False)]
        for m, mode in enumerate(DROPOUT_MODES):
            for s, scope in enumerate(scopes):
                for f, frac in enumerate(fractions):
                    masks = {layer: _neuron_mask(scores[layer], frac, mode, (seed, r, layer, f)) for layer in scope}
                    local[m, s, f, r] = _loss_and_correct(net, batches, neuron_masks=masks)
    return _finish(local), names


def _neuron_mask(scores: torch.Tensor, fraction: float, mode: str, key: tuple) -> torch.Tensor:
    """Ones, with zeros for the removed neurons: the most aligned, the least, or random ones
    (drawn from a generator seeded by `key`, so every rank removes the same neurons)."""
    n = scores.numel()
    k = round(fraction * n)
    if mode == "random":
        g = torch.Generator().manual_seed(hash(key) % 2**62)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.argsort(scores.cpu(), descending=mode == "high", stable=True)
    mask = torch.ones(n, dtype=torch.float32)
    mask[order[:k]] = 0.0
    return mask.to(scores.device)


def eigenfeatures(moments) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per net, per layer: eigenvalues (descending) and eigenvectors (columns) of the input covariance."""
    out = []
    for per_layer in moments:
        row = []
        for _, cov in per_layer:
            values, vectors = torch.linalg.eigh(cov)
            row.append((values.flip(0).clamp_min(0), vectors.flip(1)))
        out.append(row)
    return out


def eigen_dropout(nets, batches, moments, eigen, fractions) -> tuple[torch.Tensor, list[int]]:
    """Array (modes, layers, fractions, nets, [loss, accuracy]) over the fully connected layers."""
    layers = [i for i, layer in enumerate(nets[0].alignment_layers) if isinstance(layer, nn.Linear)]
    local = torch.zeros(len(EIGEN_MODES), len(layers), len(fractions), len(nets), 3, dtype=torch.float64)
    for r, net in enumerate(nets):
        for m, mode in enumerate(EIGEN_MODES):
            for li, layer in enumerate(layers):
                mean, _ = moments[r][layer]
                values, vectors = eigen[r][layer]
                for f, frac in enumerate(fractions):
                    project = _projection(mean, values, vectors, frac, mode)
                    local[m, li, f, r] = _loss_and_correct(net, batches, input_transforms={layer: project})
    return _finish(local), layers


def _projection(mean, values, vectors, fraction: float, mode: str):
    """x -> mean + s * V_k V_kᵀ (x - mean), keeping all but `fraction` of the eigenvectors and
    scaling by s = sqrt(total variance / kept variance)."""
    d = values.numel()
    drop = round(fraction * d)
    keep = slice(drop, d) if mode == "high" else slice(0, d - drop)
    v = vectors[:, keep]
    kept = values[keep].sum().clamp_min(1e-12)
    scale = torch.sqrt(values.sum() / kept)

    def transform(x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1).double()
        centred = flat - mean
        return (mean + scale * (centred @ v) @ v.T).to(x.dtype).view_as(x)

    return transform
