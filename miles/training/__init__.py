"""The training side: `TrainBatch` packing and the torch `Trainer` (a plain class; the composition
root makes it a Ray actor)."""

from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.trainer import Trainer

__all__ = ["TrainBatch", "Trainer", "make_train_batch", "split"]
