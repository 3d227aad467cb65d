"""The training side: the seam (`protocol`: what a backend implements, the registry), the torch
`Trainer` and `Critic`, `TrainBatch` packing. Nothing loads torch at package import: the flag table
reads the registry without it."""
