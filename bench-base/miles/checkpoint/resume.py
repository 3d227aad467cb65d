"""What a `--load` folder holds, and the rule that a run never starts fresh by accident.

miles' meaning is kept: a `--load` folder that does not exist yet, or holds nothing (a first run of an
auto-resume script: `--load X --save X`), starts from `--hf-checkpoint`. Anything else must resume:

- a folder whose checkpoints are all unusable, or that holds files but no checkpoint, is refused
  (`UnusableLoadFolder`, exit 2) listing each checkpoint and why, unless `--allow-fresh-start`;
- a checkpoint passed over for an older one is said on the console (the `checkpoint_skipped` event:
  which one, why, which one is tried instead), not only written in the trace.

`classify_load_folder` is the one place a folder is recognised. Each entry of `KINDS` looks at the
folder and answers with its checkpoints (newest first) or None when the folder is not of its kind;
the first that answers wins. miles' own layout (`iter_<id>/manifest.json`, miles.checkpoint.store)
is one entry; Megatron-LM's `torch_dist` (`iter_<id>/` and `latest_checkpointed_iteration.txt`, no
manifest; miles.checkpoint.megatron_format) is the other, and goes first: miles' own would otherwise
answer with every folder unusable ("manifest missing").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from miles.checkpoint.megatron_format import megatron_checkpoint_info
from miles.checkpoint.store import LATEST_FILE, TMP_PREFIX, CheckpointStore
from miles.config import ConfigError
from miles.runtime.runlock import LOCK_FILE

NOT_CONTENT = (LOCK_FILE,)             # files that are no checkpoint and no sign of one: a run holding --save here


@dataclass(frozen=True)
class Candidate:
    """One checkpoint of the folder: its id, where it is, what the cheap check found wrong."""

    rollout_id: int
    path: Path
    problems: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class LoadFolder:
    root: Path
    kind: str                          # missing | empty | no_checkpoint | the KINDS entry's name ("miles")
    candidates: tuple[Candidate, ...] = ()       # newest first
    other: tuple[str, ...] = field(default=())   # what the folder holds besides checkpoints

    @property
    def starts_fresh(self) -> bool:
        """Nothing to resume from, as miles means it: no folder yet, or an empty one."""
        return self.kind in ("missing", "empty")

    @property
    def reason(self) -> str:
        return {"missing": "no such directory yet", "empty": "no checkpoint there yet"}.get(
            self.kind, "")


def miles_checkpoints(root: Path) -> tuple[Candidate, ...] | None:
    """miles' layout: `iter_<id>/` folders (each with a manifest, when complete)."""
    found = CheckpointStore(root).newest_first()
    return tuple(Candidate(i, p, tuple(problems)) for i, p, problems in found) if found else None


def megatron_checkpoints(root: Path) -> tuple[Candidate, ...] | None:
    """Megatron-LM's torch_dist layout (miles' converter and its saves): the one checkpoint its tracker
    names (the megatron backend reads it; the other backends' check refuses it before this runs)."""
    info = megatron_checkpoint_info(root)
    if info is None:
        return None
    return (Candidate(-1 if info.iteration is None else info.iteration, info.dist_dir),)


# name -> recogniser, tried in order; a recogniser returns the folder's checkpoints or None
KINDS: list[tuple[str, Callable[[Path], tuple[Candidate, ...] | None]]] = [
    ("megatron", megatron_checkpoints), ("miles", miles_checkpoints)]


def classify_load_folder(root: str | os.PathLike[str]) -> LoadFolder:
    """What `--load root` holds: nothing (missing, empty), checkpoints of a known kind, or files but
    no checkpoint. Partial saves (`.tmp-*`) and a run's lock file count as nothing."""
    root = Path(root)
    if not root.is_dir():
        return LoadFolder(root, "missing")
    for name, recognise in KINDS:
        found = recognise(root)
        if found:
            return LoadFolder(root, name, found)
    other = tuple(sorted(e.name for e in root.iterdir()
                         if not e.name.startswith(TMP_PREFIX) and e.name not in NOT_CONTENT))
    return LoadFolder(root, "no_checkpoint" if other else "empty", other=other)


class UnusableLoadFolder(ConfigError):
    """--load names a folder with something in it but nothing to resume from."""


def refuse_fresh_start(folder: LoadFolder, problems: dict[Path, list[str]] | None = None) -> UnusableLoadFolder:
    """The error for a folder nothing loads from: each checkpoint and why (`problems` adds what the
    deep check found), or what the folder holds instead of a checkpoint."""
    fix = "point --load at the right folder, or pass --allow-fresh-start to train from --hf-checkpoint anyway"
    if folder.kind == "no_checkpoint":
        shown = ", ".join(folder.other[:8]) + (f", ... ({len(folder.other)} in all)" if len(folder.other) > 8 else "")
        hint = (f"; {LATEST_FILE} names a checkpoint that is not there" if LATEST_FILE in folder.other else "")
        return UnusableLoadFolder(f"--load {folder.root} holds files but no checkpoint ({shown}){hint}: {fix}")
    problems = problems or {}
    lines = [f"--load {folder.root}: none of its {len(folder.candidates)} checkpoints can be loaded ({fix}):"]
    for c in folder.candidates:
        why = [*c.problems, *problems.get(c.path, [])] or ["not checked"]
        lines.append(f"  {c.path.name}: {why[0]}" + (f" (and {len(why) - 1} more)" if len(why) > 1 else ""))
    return UnusableLoadFolder("\n".join(lines))


def pick_step(folder: LoadFolder, step: int | None) -> LoadFolder:
    """`folder` with only the checkpoint of rollout `step` (--ckpt-step; None: all of them); raises
    UnusableLoadFolder when it has none."""
    if step is None:
        return folder
    chosen = tuple(c for c in folder.candidates if c.rollout_id == step)
    if not chosen:
        held = ", ".join(str(c.rollout_id) for c in sorted(folder.candidates, key=lambda c: c.rollout_id)) or "none"
        raise UnusableLoadFolder(f"--ckpt-step {step}: --load {folder.root} has no checkpoint of rollout {step} "
                                 f"(its checkpoints' rollouts: {held}); give one of them, or drop --ckpt-step for "
                                 "the newest")
    return replace(folder, candidates=chosen)


def check_load_folder(root: str | None, *, allow_fresh_start: bool, step: int | None = None,
                      exit_on_missing: bool = False) -> LoadFolder | None:
    """Before anything starts: the folder's kind; raises UnusableLoadFolder when it holds files but no
    checkpoint, or only checkpoints the cheap check (manifest, sizes) already refuses, or not the one
    --ckpt-step `step` names, or nothing at all with --exit-on-missing-checkpoint."""
    if not root:
        return None
    folder = classify_load_folder(root)
    if folder.starts_fresh and exit_on_missing:
        raise UnusableLoadFolder(f"--load {folder.root}: {folder.reason}, and --exit-on-missing-checkpoint stops the "
                                 "run instead of starting from --hf-checkpoint; check the path")
    folder = pick_step(folder, step)
    if (allow_fresh_start and step is None) or folder.starts_fresh:
        return folder
    if folder.kind == "no_checkpoint" or not any(c.usable for c in folder.candidates):
        raise refuse_fresh_start(folder)
    return folder


def skipped_line(c: Candidate, problems: list[str], rest: list[Candidate]) -> str:
    """One console line for a checkpoint passed over: which, why, which one is tried instead."""
    nxt = next((r for r in rest if r.usable), None)
    instead = f"trying {nxt.path.name} instead" if nxt is not None else "no older checkpoint is left"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"checkpoint {c.path.name} skipped: {problems[0]}{more}; {instead}"
