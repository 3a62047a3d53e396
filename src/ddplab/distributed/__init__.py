"""This process's place in the job: cluster detection, process group and device (runtime), the
collectives users call, DDP wrapping, and hang diagnosis. Imports only ddplab's root modules."""
