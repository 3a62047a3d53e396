"""`python -m ddplab …` is `ddplab …` (this is what workers and `torchrun -m ddplab run` use)."""

import sys

from .environment import working_folder_last

working_folder_last()
from .launch.cli import main  # noqa: E402 (after the working folder moves to the end of sys.path)

sys.exit(main())
