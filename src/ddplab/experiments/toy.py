"""A tiny linear regression trained with DDP: the placeholder main job until BBBP lands.

Each rank takes its slice of every global batch; DDP averages the gradients, so all ranks hold the
same weights, which the run checks at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddplab


def main(cfg) -> None:
    rt = ddplab.current()
    torch.manual_seed(cfg.seed)
    true_w = torch.randn(8, 1)
    x = torch.randn(4096, 8)
    y = x @ true_w + 0.01 * torch.randn(4096, 1)
    model = nn.Linear(8, 1).to(rt.device)
    ddp = DistributedDataParallel(model) if rt.distributed else model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batch = cfg.trainer.global_batch_size
    per_rank = cfg.trainer.global_batch_size // rt.world_size
    steps = cfg.trainer.max_steps or 200
    ddplab.print0(f"toy: placeholder job, linear regression on {rt.world_size} process(es), {steps} steps")
    for step in range(steps):
        start = (step * batch) % (len(x) - batch) + rt.rank * per_rank
        xb = x[start : start + per_rank].to(rt.device)
        yb = y[start : start + per_rank].to(rt.device)
        loss = nn.functional.mse_loss(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            ddplab.print0(f"toy: step {step:4d}  loss {loss.item():.5f}")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rt.distributed:
        spread = weights.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        assert torch.equal(spread, weights), "ranks disagree on the weights"
    error = (model.weight.detach().cpu().T - true_w).abs().max().item()
    ddplab.print0(f"toy: done; weights identical on all {rt.world_size} ranks; max |w - w_true| = {error:.4f}")
