"""`python -m ddplab …` is `ddplab …` (this is what workers and `torchrun -m ddplab run` use)."""

import sys

from .cli import main

sys.exit(main())
