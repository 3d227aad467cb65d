"""Megatron-LM's checkpoint folders, as miles writes them, recognized without loading them.

miles' `--load` / `--ref-load` take Megatron-LM's layout: the `{model}_torch_dist` folder its
converter makes and its own saves, both

    root/
      latest_checkpointed_iteration.txt    "N" (or "release")
      iter_000000N/  (or release/)         a megatron-core dist checkpoint: metadata.json
                                           ({"sharded_backend": "torch_dist", ...}), *.distcp, common.pt

and a dist checkpoint folder given directly. This build's own checkpoints share the root layout but
every `iter_*` holds a `manifest.json` (`miles.checkpoint.store`); a Megatron folder has none.
`megatron_checkpoint_info` says which Megatron checkpoint a folder is (None: not one); the megatron
backend reads it through megatron-core's `dist_checkpointing` (`miles.training.megatron.worker`).
Pure: reads two small files; of miles it imports only the config's check registry, with which it
registers the --load / --ref-load checks below.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles.config.checks import check

if TYPE_CHECKING:
    from miles.config import RunConfig

TRACKER = "latest_checkpointed_iteration.txt"
DIST_METADATA = "metadata.json"
OURS = "manifest.json"            # what this build's own iter_* folders hold
RELEASE = "release"
_ITER = re.compile(r"iter_(\d{7,})")


@dataclass(frozen=True)
class MegatronCheckpoint:
    dist_dir: Path             # the megatron-core dist checkpoint (metadata.json, *.distcp)
    iteration: int | None      # the saved iteration (miles: the rollout id); None for a converter's release


def megatron_checkpoint_info(path: str | Path) -> MegatronCheckpoint | None:
    """The Megatron checkpoint `path` holds (the tracker's iteration, else the newest iter_*), or None."""
    root = Path(path)
    if _is_dist(root):
        match = _ITER.fullmatch(root.name)
        return MegatronCheckpoint(root, int(match.group(1)) if match else None)
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == RELEASE and _is_dist(root / RELEASE):
            return MegatronCheckpoint(root / RELEASE, None)
        if text.isdigit() and _is_dist(root / f"iter_{int(text):07d}"):
            return MegatronCheckpoint(root / f"iter_{int(text):07d}", int(text))
    saved = sorted((int(m.group(1)), p) for p in root.glob("iter_*") if (m := _ITER.fullmatch(p.name)) and _is_dist(p))
    return MegatronCheckpoint(saved[-1][1], saved[-1][0]) if saved else None


def _is_dist(folder: Path) -> bool:
    """A megatron-core torch_dist checkpoint, and not one of this build's own checkpoints."""
    meta = folder / DIST_METADATA
    if not meta.is_file() or (folder / OURS).exists():
        return False
    try:
        return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def megatron_load_problems(backend: str, load: str | None, ref_load: str | None) -> list[str]:
    """--load / --ref-load naming a Megatron checkpoint: the megatron backend reads it; the others cannot."""
    problems = []
    for flag, path in (("--load", load), ("--ref-load", ref_load)):
        if path and backend != "megatron" and megatron_checkpoint_info(path) is not None:
            problems.append(f"{flag} {path} is a Megatron torch_dist checkpoint, which --train-backend {backend} "
                            "cannot read: use --train-backend megatron, or start from the HF weights with "
                            f"--hf-checkpoint (and drop {flag})")
    return problems


@check
def _load_folders(cfg: RunConfig, problems: list[str]) -> None:
    """--ref-load is an HF model folder or a Megatron checkpoint; a Megatron one needs the megatron backend."""
    ref_load = cfg.algorithm.ref_load
    if ref_load and not (Path(ref_load) / "config.json").is_file() and megatron_checkpoint_info(ref_load) is None:
        problems.append(f"--ref-load {ref_load}: no config.json there; pass an HF-format model folder (or, with "
                        "--train-backend megatron, a Megatron torch_dist checkpoint)")
    problems += megatron_load_problems(cfg.train.backend, cfg.checkpoint.load, ref_load)
