"""What a checkpoint holds (state.py), how it is written and found (store.py), and the published
model (export.py). Imports distributed/ and the root modules, never train/."""
