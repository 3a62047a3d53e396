"""dist.fault_tolerance=live (a capability): the step a replica takes with whichever replicas are there.

Each step: join the step's quorum (a replica behind its peers first copies a peer's whole training
state: a heal), read this replica's share of the step's global batch, forward and backward (the
gradients averaged over the quorum inside the backward), sum the loss over the quorum, and commit
only if every replica of the quorum got through; otherwise the gradients are dropped and the same
step is taken again with the replicas that are left. Nothing else crosses replicas: each evaluates
the whole eval set, writes its own checkpoints, logs and final/ in `<run>/replica-<id>/`, all the
same as its peers' because their weights are the same bit for bit.

What is kept per step, in `live.jsonl` beside the metrics: the quorum's size and this replica's place
in it, the samples (the global batch, this replica's share), the attempts, the seconds it took."""

import json
import os
import statistics
import time

import torch

from ..distributed.live import Replica
from .capability import Capability
from .step import StepParts, StepRecords, apply_gradients, check_rank_buffers, micro_batch
from .summary import load_run, record


class LiveRecovery(Capability):
    """This replica's steps, and what the replicas went through: new quorums (replicas lost, replaced or
    added), steps taken again and the seconds they stalled the job (kept in checkpoints and copied by
    heals), and this replica's own heals."""

    state_key = "live"

    @classmethod
    def join(cls, dist_cfg, device: torch.device, global_batch: int):
        """dist.fault_tolerance=live's replica, joined to the lighthouse; None when it is off."""
        if dist_cfg.fault_tolerance != "live":
            return None
        return cls(Replica(dist_cfg, device), device, global_batch)

    def __init__(self, replica: Replica, device: torch.device, global_batch: int):
        self.replica = replica
        self.device = device
        self.global_batch = global_batch
        self.counts = {"quorums": 0, "redone": 0, "healed": 0, "stalled_s": 0.0}
        # the last step's quorum: its id and size
        self.quorum_id: int | None = None
        self.size = 0
        # seconds of steps that nothing disturbed: what "stalled" is measured against
        self.calm: list[float] = []
        # the replica's run folder, and live.jsonl in it
        self.run_dir: str | None = None
        self.record: str | None = None
        self.say = print

    def attach(self, run_dir: str | None, serve_state, load_state, say) -> None:
        """Where the per-step records go, what a healing peer copies, and where notes are said."""
        self.replica.serve_state(serve_state, load_state)
        self.say = say
        self.run_dir = run_dir
        if run_dir is not None:
            self.record = os.path.join(run_dir, "live.jsonl")

    def before_training(self, step: int) -> None:
        # the banner counts this process alone: say how the batch is really cut
        self.say(
            f"replica {self.replica.replica_id} (dist.fault_tolerance=live): each step's global batch of "
            f"{self.global_batch} is shared by the replicas of its quorum, formed at {self.replica.lighthouse}"
        )

    def wrap(self, network: torch.nn.Module) -> torch.nn.Module:
        return self.replica.wrap(network)

    def step(self, parts: StepParts, records: StepRecords, batches, accumulate: int) -> None:
        """One optimizer step, taken again until the replicas of a quorum commit it."""
        progress = records.progress
        self._stop_when_a_peer_finished(progress.step)
        began = time.perf_counter()
        attempts = 0
        changed = False
        while True:
            attempts += 1
            before = (progress.step, progress.epoch)
            rank, size, quorum_id = self.replica.quorum(progress.step)
            if self.replica.too_few(size):
                attempts -= 1
                continue
            if (progress.step, progress.epoch) != before:
                self.counts["healed"] += 1
                self.say(f"replica {self.replica.replica_id} healed from a peer: now at step {progress.step}")
            changed |= self._membership(quorum_id, size, progress.step)
            shares, sizes = batches.share(rank, size, accumulate)
            loss_sum = self._micro_batches(parts, records, shares, sizes, size)
            samples = sum(sizes)
            count = torch.tensor(float(samples), dtype=torch.float64, device=self.device)
            total = torch.stack([loss_sum, count])
            # the loss travels beside the commit's vote, not before it: only the log reads it
            summed = self.replica.start_sum(total)
            if self.replica.commit():
                break
            summed.wait()
            for opt in parts.optimizers:
                opt.zero_grad()
            self.counts["redone"] += 1
            self.say(f"step {progress.step + 1} not committed by its {size} replica(s): taken again by those left")
        # the global batch's mean loss, the same on every replica (a peer lost after the commit:
        # this replica's own share's)
        if not summed.wait():
            total = torch.stack([loss_sum, count])
        records.interval.keep_loss(total[0] / total[1])
        check_rank_buffers(parts)
        apply_gradients(parts, records)
        disturbed = attempts > 1 or changed
        self._keep(progress.step + 1, rank, size, samples, attempts, time.perf_counter() - began, disturbed)

    def _stop_when_a_peer_finished(self, step: int) -> None:
        """Replicas of one quorum take the last step together: one that is still to take step `step + 1`
        after a peer finished is behind it (a replacement that came too late to heal), and no peer is
        left to heal from. Training the rest alone would hold the job for a second run whose weights
        differ from the finished one's, so it ends here, without a final model of its own."""
        if peers := self.replica.finished_peers():
            self.say(
                f"replica {self.replica.replica_id} ends at step {step} without training on: replica(s) {peers} "
                f"finished the run before it could rejoin them (their final/ holds the run's model)"
            )
            if self.run_dir is not None:
                # `ddplab runs` says so, rather than offering to resume a run that is over
                status = f"superseded (replica(s) {peers} finished the run)"
                facts = {**record(load_run(self.run_dir)), "status": status, "live": self.facts()}
                with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                    json.dump(facts, f, indent=1)
            raise SystemExit(0)

    def after_training(self, step: int) -> None:
        self.replica.finished()

    def _micro_batches(self, parts: StepParts, records: StepRecords, shares, sizes: list[int], size: int):
        """Forward and backward of this replica's micro-batches (the gradients' all_reduce in the last
        backward), each loss weighted by its samples' share of the global batch (times the quorum's
        size, which the all_reduce's mean divides by): the step's gradient is the global batch's mean
        however unevenly it was shared. Returns the losses summed over samples; they are kept out of
        the log until the step commits."""
        kept = len(records.interval.losses)
        last = len(sizes) - 1
        for i, (batch, samples) in enumerate(zip(shares, sizes, strict=True)):
            weight = samples * size / self.global_batch
            micro_batch(parts, records, iter([batch]), last=i == last, accumulate=len(sizes), weight=weight)
        losses = records.interval.losses[kept:]
        del records.interval.losses[kept:]
        return sum(loss.double() * samples for loss, samples in zip(losses, sizes, strict=True))

    def _membership(self, quorum_id: int, size: int, step: int) -> bool:
        """A new quorum (a replica lost, replaced or added) is said and counted; True when it is one."""
        new = self.quorum_id is not None and quorum_id != self.quorum_id
        if new:
            self.counts["quorums"] += 1
            self.say(f"step {step + 1}: a new quorum of {size} replica(s) (the last had {self.size})")
        self.quorum_id = quorum_id
        self.size = size
        return new

    def _keep(
        self, step: int, rank: int, size: int, samples: int, attempts: int, seconds: float, disturbed: bool
    ) -> None:
        """The step's record; a step that a new quorum or a redo slowed adds what it took beyond the usual."""
        if disturbed:
            self.counts["stalled_s"] += max(0.0, seconds - (statistics.median(self.calm) if self.calm else 0.0))
        else:
            self.calm = [*self.calm, seconds][-50:]
        if self.record is not None:
            line = {
                "step": step,
                "replicas": size,
                "place": rank,
                "samples": self.global_batch,
                "own_samples": samples,
                "attempts": attempts,
                "seconds": round(seconds, 4),
                "pid": os.getpid(),
            }
            with open(self.record, "a") as f:
                f.write(json.dumps(line) + "\n")

    def closing_line(self, step: int) -> str | None:
        c = self.counts
        return (
            f"live recovery: {c['quorums']} new quorum(s), {c['redone']} step(s) taken again, {c['stalled_s']:.1f} s "
            f"stalled; {self.size} replica(s) at the end; this replica healed {c['healed']} time(s) from a peer"
        )

    def facts(self) -> dict:
        """For summary.json: what the replicas went through, as this replica saw it."""
        return {**self.counts, "stalled_s": round(self.counts["stalled_s"], 2), "replicas_at_end": self.size}

    def state_dict(self) -> dict:
        return dict(self.counts)

    def load_state_dict(self, saved: dict | None) -> None:
        if saved:
            healed = self.counts["healed"]
            self.counts.update(saved)
            # this replica's own heals, not its peer's
            self.counts["healed"] = healed

    def close(self) -> None:
        self.replica.close()
