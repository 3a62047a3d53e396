"""Starting a job: the command line, the run plan, torch's elastic agent as launcher, and each
worker's life from plan to exit code. The top of the stack: may import every other package."""
