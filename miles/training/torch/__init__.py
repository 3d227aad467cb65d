"""The torch backend (`TRAIN_BACKENDS["torch"]`): the `Trainer` and PPO's `Critic` on one process, their
shared shell (device, dtype, AdamW, schedule, save/load), the forward, LoRA, offload, the weight
shadows, the micro-batch plan and the memory plan; `fsdp/` runs the same trainer on several ranks. The
shared seam (protocol, TrainBatch, loss terms, ranks) stays in `miles.training`."""
