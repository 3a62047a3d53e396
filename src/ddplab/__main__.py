"""`python -m ddplab …` is `ddplab …` (this is what workers and `torchrun -m ddplab run` use)."""

import sys

from .launch.cli import main

sys.exit(main())
