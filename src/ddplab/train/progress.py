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
        self.epoch += 1
        self.step_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.step = saved["step"]
        self.epoch = saved["epoch"]
        self.step_in_epoch = saved["step_in_epoch"]
        self.samples_seen = saved["samples_seen"]
