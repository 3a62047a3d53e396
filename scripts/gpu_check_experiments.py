"""The bundled experiments as `make gpu-check` runs them (scripts/gpu_check.py): unchanged, except
that with GPU_CHECK_DIE_AT=N in the environment the last rank SIGKILLs itself before step N + 1,
once per run folder, so the check can compare a killed and resumed run with the straight one."""

import os
import signal

from ddplab.experiments.bbbp import BBBP
from ddplab.experiments.translation import Translation


class DiesOnce:
    def training_step(self, batch):
        at = int(os.environ.get("GPU_CHECK_DIE_AT", "0"))
        if at and self.step == at and self.rt.rank == self.rt.world_size - 1:
            marker = os.path.join(self.run_dir, "died-once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch)


class CheckedBBBP(DiesOnce, BBBP):
    name = "bbbp"


class CheckedTranslation(DiesOnce, Translation):
    name = "translation"
