"""Where training stands: one small record, saved in every checkpoint and restored as a whole."""

from dataclasses import asdict, dataclass


@dataclass
class TrainProgress:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # whole epochs done
    step_in_epoch: int = 0  # optimizer steps done in the current epoch: where its data order resumes
    samples_seen: int = 0  # training samples consumed, over all ranks

    def advance(self, samples: int) -> None:
        self.step += 1
        self.step_in_epoch += 1
        self.samples_seen += samples

    def next_epoch(self) -> None:
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, saved: dict[str, int], global_batch: int) -> None:
        """Older checkpoints have no samples_seen: every step took one global batch."""
        self.step, self.epoch, self.step_in_epoch = saved["step"], saved["epoch"], saved["step_in_epoch"]
        self.samples_seen = saved.get("samples_seen", self.step * global_batch)
