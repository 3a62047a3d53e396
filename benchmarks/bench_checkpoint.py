"""Checkpoints: how long training is blocked per save (ddplab synchronous, ddplab asynchronous, a
plain torch.save of the same state), and how long a load takes.

    python benchmarks/bench_checkpoint.py [--rounds 10]

The state is the BBBP model at its default size (embedding 128, 3-layer bidirectional LSTM 128)
with its AdamW state after one step, plus the RNG states: what `ddplab run bbbp` saves. ddplab's
synchronous save writes to a temporary folder, fsyncs, renames and prunes; the asynchronous one
blocks only to copy the state to CPU memory and writes in a background thread (its previous
write is awaited before each measurement, outside the timing).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from common import interleaved, save, table
from ddplab.checkpoint.store import CheckpointManager, load_state
from ddplab.experiments import smiles
from ddplab.experiments.bbbp import SmilesClassifier
from ddplab.seeding import gather as gather_rng


def bbbp_state() -> dict:
    torch.manual_seed(0)
    model = SmilesClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = smiles.collate([(torch.randint(1, smiles.VOCAB_SIZE, (60,)), 1.0) for _ in range(8)])
    torch.nn.functional.binary_cross_entropy_with_logits(
        model(batch["tokens"], batch["lengths"]), batch["label"]
    ).backward()
    opt.step()
    return {
        "models": {"net": model.state_dict()},
        "optimizers": [opt.state_dict()],
        "rng": gather_rng(),
        "progress": {"step": 1, "epoch": 0, "step_in_epoch": 1},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    state = bbbp_state()
    with tempfile.TemporaryDirectory() as tmp:
        sync = CheckpointManager(os.path.join(tmp, "sync"), keep_last=2)
        background = CheckpointManager(os.path.join(tmp, "async"), keep_last=2, async_save=True)
        counter = {"step": 0}

        def timed(fn):
            def measure() -> float:
                # the previous background write, outside the timing
                background.wait()
                counter["step"] += 1
                t = time.perf_counter()
                fn(counter["step"])
                return time.perf_counter() - t

            return measure

        saves = interleaved(
            {
                "torch.save": timed(lambda s: torch.save(state, os.path.join(tmp, "plain.pt"))),
                "ddplab sync": timed(lambda s: sync.save(state, s, 0, None)),
                "ddplab async": timed(lambda s: background.save(state, s, 0, None)),
            },
            args.rounds,
        )
        background.wait()
        latest = sync.list()[-1].path
        loads = interleaved(
            {
                "torch.load": timed(lambda s: torch.load(os.path.join(tmp, "plain.pt"), weights_only=False)),
                "ddplab load_state (weights_only)": timed(lambda s: load_state(latest)),
            },
            args.rounds,
        )
        size = os.path.getsize(os.path.join(tmp, "plain.pt"))
    save(
        "checkpoint",
        {
            "rounds": args.rounds,
            "state_bytes": size,
            "blocked_per_save": table(saves, "ddplab sync"),
            "load": table(loads, "torch.load"),
        },
    )


if __name__ == "__main__":
    main()
