"""The training loop (loop.py) and its parts: the optimizer step, the log interval and its
heartbeat, data order, metrics, evaluation, logs, the run directory. Imports distributed/ and
checkpoint/, never launch/ or tools/."""
