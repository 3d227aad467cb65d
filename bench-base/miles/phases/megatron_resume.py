"""Resuming from a Megatron-LM checkpoint under --load (miles' saves and its converter's `*_torch_dist`
folder): the megatron trainer reads its weights, and the run continues from the iteration after the
saved one, as miles does (its iteration is the rollout id). What such a checkpoint does not hold in a
form this build reads starts fresh, and the trace's `resumed` event says so (`fresh`, `note`): the
optimizer state (Megatron-LM's distributed optimizer saves Adam's moments in its own gradient-bucket
layout, `dp_reshardable`, which this build's model does not reproduce bucket for bucket, so reading them
could pair moments with the wrong weights), hence the learning-rate schedule's step count too, and the
prompt order's position."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.checkpoint.megatron_format import MegatronCheckpoint
from miles.phases.watch import ci_check_model_hash

if TYPE_CHECKING:
    from miles.phases.context import TrainingContext


FRESH = ("optimizer", "lr_schedule", "data_position")
FRESH_NOTE = ("weights only: Megatron-LM's optimizer state is not read, so Adam's moments start at zero and the "
              "learning-rate schedule at step 0 (its warmup runs again); the prompt order starts over")


async def resume_from_megatron(ctx: TrainingContext, checkpoint: MegatronCheckpoint) -> None:
    """The trainer's weights from `checkpoint`; the next rollout is the one after its iteration (0 for
    a converter's release folder, or with --finetune)."""
    await ctx.c.folders.load(ctx.c.trainer, "load", checkpoint.dist_dir)
    await ci_check_model_hash(ctx, checkpoint.dist_dir)    # miles' own per-layer hash files are not read
    finetune = ctx.cfg.checkpoint.finetune or checkpoint.iteration is None    # --finetune: from rollout 0
    next_rollout = 0 if finetune else checkpoint.iteration + 1
    ctx.start_rollout = ctx.next_rollout = next_rollout
    ctx.resumed = True
    ctx.weight_version = 0              # the engines hold --hf-checkpoint's weights until the first sync
    ctx.tracer.emit("resumed", rollout_id=checkpoint.iteration, path=str(checkpoint.dist_dir),
                    next_rollout=next_rollout, verified=False, format="megatron_torch_dist",
                    fresh=list(FRESH), note=FRESH_NOTE)
