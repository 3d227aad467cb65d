"""Resuming a run from --load, the driver's half: which checkpoint is taken, its sha256 checked where
it is read, and what the trainer, the critic and the data position get back from it. `init` calls
`hash_before_start` while it checks the inputs (before Ray starts) and `resume` once every component
is ready; what a --load folder holds and the rule that a run never starts fresh by accident are
`miles.checkpoint.resume`'s, a Megatron-LM checkpoint is `miles.checkpoint.megatron_resume`'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from miles.checkpoint.checkpointer import CRITIC_DIR, ROLLOUT_FILE, TRAINER_DIR, read_data_position
from miles.checkpoint.megatron_format import megatron_checkpoint_info
from miles.checkpoint.megatron_resume import resume_from_megatron
from miles.checkpoint.resume import LoadFolder, classify_load_folder, pick_step, refuse_fresh_start, skipped_line
from miles.checkpoint.store import manifest_files, verify_files
from miles.cluster.memory import trainer_offloads
from miles.metrics.ci_gates import CICheckFailed
from miles.metrics.watch import ci_check_model_hash

if TYPE_CHECKING:
    from miles.phases.context import TrainingContext

MAX_TRACED_PROBLEMS = 10       # a checkpoint_skipped event names at most this many bad files


async def resume(ctx: TrainingContext) -> None:
    """Restore trainer (weights, optimizer, RNG), data position and counters from the newest checkpoint
    under --load that checks out: complete (manifest, sizes) and, unless --no-verify-load, every file
    the load reads matching its sha256, checked where it is read. Each one passed over is traced and
    said (`checkpoint_skipped`: which, why, which is tried instead); with none left the run is refused
    (miles.checkpoint.resume) unless the folder had nothing yet or --allow-fresh-start. --ckpt-step N
    takes rollout N's checkpoint only (no fallback, no fresh start)."""
    step = ctx.cfg.checkpoint.ckpt_step
    root, allow = ctx.cfg.checkpoint.load, ctx.cfg.checkpoint.allow_fresh_start and step is None
    if (megatron := megatron_checkpoint_info(root)) is not None:    # miles' saves / converter (megatron backend)
        return await resume_from_megatron(ctx, megatron)     # --ckpt-step was checked against it at start-up
    folder = pick_step(classify_load_folder(root), step)
    found: dict[Path, list[str]] = {}
    for i, c in enumerate(folder.candidates):
        problems = list(c.problems)
        verified = not problems and ctx.cfg.reliability.verify_load
        if verified:                        # hashed before Ray started (`hash_before_start`), else where read
            problems = (list(ctx.load_checked[c.path]) if c.path in ctx.load_checked
                        else await _verify_where_read(ctx, c.path))
        if problems:
            found[c.path] = problems
            ctx.tracer.emit("checkpoint_skipped", rollout_id=c.rollout_id, path=str(c.path), check="sha256" if verified
                            else "manifest and sizes", problems=problems[:MAX_TRACED_PROBLEMS],
                            message=skipped_line(c, problems, list(folder.candidates[i + 1:])))
            continue
        await _load_checkpoint(ctx, c.path)
        await ci_check_model_hash(ctx, c.path)
        finetune = ctx.cfg.checkpoint.finetune      # the weights alone: the run starts over from them
        ctx.start_rollout = ctx.next_rollout = 0 if finetune else c.rollout_id + 1
        ctx.resumed = True
        ctx.weight_version = 0              # the engines hold the disk weights until the first sync
        ctx.tracer.emit("resumed", rollout_id=c.rollout_id, path=str(c.path), next_rollout=ctx.next_rollout,
                        verified=verified, **_fresh_parts(ctx.cfg.checkpoint.load_parts()))
        return
    if not (folder.starts_fresh or allow):
        raise refuse_fresh_start(folder, found)
    if ctx.ci.model_hash_checked:
        raise CICheckFailed(f"--ci-check-model-hash: --load {root} held no checkpoint to load, so there are no "
                            "loaded weights to check; point --load at a run saved with --ci-save-model-hash")
    # --load X --save X before X holds anything: the auto-resume launch script's first run
    reason = folder.reason or "nothing loadable, and --allow-fresh-start"
    ctx.tracer.emit("resume_skipped", reason=reason, root=root)


async def _load_checkpoint(ctx: TrainingContext, path: Path) -> None:
    """The trainer's (and critic's) folder, the parts --no-load-optim / --no-load-rng / --finetune leave
    (`CheckpointConfig.load_parts`), and the data position unless --finetune."""
    parts = ctx.cfg.checkpoint.load_parts()
    if trainer_offloads(ctx):
        # offloaded first (a fresh optimizer: nothing moves), so the load puts the optimizer state
        # straight into host memory instead of whole on a GPU the colocated engines already share
        await ctx.c.trainer.handle.offload.remote()
    await ctx.c.folders.load(ctx.c.trainer, "load", path / TRAINER_DIR, **parts)
    if not ctx.cfg.checkpoint.finetune:
        await ctx.c.executor.handle.load_state_dict.remote(read_data_position(path))
    # a critic kept under --critic-save comes back through --critic-load instead
    if ctx.c.critic is not None and (path / CRITIC_DIR).is_dir():
        await ctx.c.folders.load(ctx.c.critic, "load", path / CRITIC_DIR, **parts)


def _fresh_parts(parts: dict[str, bool]) -> dict:
    """The `resumed` event's `fresh`: what the resume did not take from the checkpoint (none: no field)."""
    names = {"optimizer": "optimizer", "rng": "rng", "step": "step_count_and_data_position"}
    fresh = [names[k] for k, taken in parts.items() if not taken]
    return {"fresh": fresh} if fresh else {}


def hash_before_start(ctx: TrainingContext, folder: LoadFolder | None) -> None:
    """--load's checkpoints that pass the cheap check, hashed here before anything starts, newest first
    until one checks out (the sha256 of every file the load reads against its manifest): when none
    does, the run is refused now (exit 2), not after Ray and the actors have started. What each one
    hashed to is kept (`ctx.load_checked`): `resume` reads it instead of hashing again. The driver
    reads what the actors load: the same path on a shared filesystem, or the copy it sends them."""
    cfg = ctx.cfg
    if folder is None or folder.kind != "miles" or folder.starts_fresh or not cfg.reliability.verify_load:
        return
    for c in folder.candidates:
        if c.problems:
            continue
        files = {**manifest_files(c.path, f"{TRAINER_DIR}/"), **manifest_files(c.path, ROLLOUT_FILE)}
        if cfg.algorithm.needs_critic and (c.path / CRITIC_DIR).is_dir():
            files.update(manifest_files(c.path, f"{CRITIC_DIR}/"))
        ctx.load_checked[c.path] = verify_files(c.path, files)
        if not ctx.load_checked[c.path]:
            return
    if not (cfg.checkpoint.allow_fresh_start and cfg.checkpoint.ckpt_step is None):
        raise refuse_fresh_start(folder, ctx.load_checked)


async def _verify_where_read(ctx: TrainingContext, path: Path) -> list[str]:
    """The sha256 of every file the load reads, each checked where it is read: `trainer/` (and
    `critic/`) in their actors, or here when the folders travel through Ray (miles.checkpoint.folders);
    `rollout.json` here."""
    readers = [(ctx.c.trainer, TRAINER_DIR)]
    if ctx.c.critic is not None and (path / CRITIC_DIR).is_dir():
        readers.append((ctx.c.critic, CRITIC_DIR))
    found = await asyncio.gather(*(ctx.c.folders.verify(actor, path, manifest_files(path, f"{folder}/"))
                                   for actor, folder in readers))
    return [p for problems in found for p in problems] + verify_files(path, manifest_files(path, ROLLOUT_FILE))
