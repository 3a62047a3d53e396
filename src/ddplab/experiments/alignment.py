"""Alignment: how much of a layer's input variance lies along each neuron's weight direction.

For a layer with input covariance C (over a batch; centred, N-1) and a neuron with weights w:

    alignment(w) = (wᵀ C w / wᵀ w) / trace(C)

1 means the neuron reads only along the input's directions of largest variance relative to the
total; a random direction scores about 1/D. Convolutions use unfolded input patches as the
input, and each output channel's kernel as w.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class AlignmentNet(nn.Module):
    """A network whose layers' inputs can be captured, and whose neurons can be switched off.

    `forward(x, capture=True)` also returns each alignment layer's input as a 2-D matrix
    (samples x features); `neuron_masks[l]` (ones, zeros for removed neurons) multiplies layer
    l's output; `input_transforms[l]` replaces layer l's input (for eigenfeature dropout).
    """

    def alignment_weights(self) -> list[torch.Tensor]:
        return [layer.weight.flatten(1) for layer in self.alignment_layers]

    def layer_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x

    def run_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        capture: bool = False,
        neuron_masks: dict | None = None,
        input_transforms: dict | None = None,
    ):
        inputs = []
        for i in range(len(self.alignment_layers)):
            if input_transforms and i in input_transforms:
                x = input_transforms[i](x)
            if capture:
                inputs.append(self.layer_input(i, x))
            x = self.run_layer(i, x)
            if neuron_masks and i in neuron_masks:
                shape = (1, -1) + (1,) * (x.dim() - 2)
                x = x * neuron_masks[i].view(shape)
        return (x, inputs) if capture else x


class AlignmentMLP(AlignmentNet):
    def __init__(self, inputs: int, outputs: int, hidden=(100, 100, 50)):
        super().__init__()
        sizes = [inputs, *hidden, outputs]
        self.alignment_layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def layer_input(self, i, x):
        return x.flatten(1)

    def run_layer(self, i, x):
        out = self.alignment_layers[i](x.flatten(1))
        return out if i == len(self.alignment_layers) - 1 else F.relu(out)


class AlignmentCNN(AlignmentNet):
    """conv(1->8, 3x3) -> conv(8->16, 3x3) -> linear: conv alignment over unfolded patches."""

    def __init__(self, side: int, outputs: int, channels=(8, 16)):
        super().__init__()
        c1, c2 = channels
        self.side = side
        self.alignment_layers = nn.ModuleList(
            [nn.Conv2d(1, c1, 3, padding=1), nn.Conv2d(c1, c2, 3, padding=1), nn.Linear(c2 * side * side, outputs)]
        )

    def _image(self, x):
        return x.view(x.shape[0], 1, self.side, self.side) if x.dim() == 2 else x

    def layer_input(self, i, x):
        layer = self.alignment_layers[i]
        if isinstance(layer, nn.Conv2d):
            # (B, C*k*k, L) -> (B*L, C*k*k)
            patches = F.unfold(self._image(x), layer.kernel_size, padding=layer.padding)
            return patches.transpose(1, 2).reshape(-1, patches.shape[1])
        return x.flatten(1)

    def run_layer(self, i, x):
        layer = self.alignment_layers[i]
        if isinstance(layer, nn.Conv2d):
            return F.relu(layer(self._image(x)))
        return layer(x.flatten(1))


def covariance(x: torch.Tensor) -> torch.Tensor:
    """Covariance of the rows of x (centred, N-1), in float64."""
    x = x.double()
    xc = x - x.mean(0, keepdim=True)
    return xc.T @ xc / max(x.shape[0] - 1, 1)


def alignment(weights: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Per neuron (row of weights): (wᵀ C w / wᵀ w) / trace(C)."""
    w = weights.detach().double()
    return ((w @ cov) * w).sum(1) / (w * w).sum(1) / torch.trace(cov).clamp_min(1e-12)


class DistributedMoments:
    """Exact covariance of a layer's input over a dataset split across ranks: Σx, ΣxxT and n are
    summed over ranks in one all_reduce, so no sample is counted twice and nothing is averaged."""

    def __init__(self, dim: int, device: torch.device):
        self.n = 0
        self.s1 = torch.zeros(dim, dtype=torch.float64, device=device)
        self.s2 = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        self.s1 += x.sum(0)
        self.s2 += x.T @ x
        self.n += x.shape[0]

    def covariance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, covariance) over every rank's samples. Every rank must call it."""
        d = self.s1.numel()
        packed = torch.cat(
            [self.s1, self.s2.flatten(), torch.tensor([float(self.n)], dtype=torch.float64, device=self.s1.device)]
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
        s1 = packed[:d]
        s2 = packed[d : d + d * d].view(d, d)
        n = packed[-1]
        mean = s1 / n
        return mean, (s2 - n * torch.outer(mean, mean)) / (n - 1)
