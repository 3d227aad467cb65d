"""Rollouts saved to disk for debugging: `--save-debug-rollout-data`, `--load-debug-rollout-data`.

A saved rollout is one `.pt` file (`torch.save` of plain lists and dicts, read back with
`weights_only=True`): the rollout id, its samples (prompt, response ids, rollout logprobs, reward,
advantage, ...) and the executor's metrics. Saving them lets a training step be replayed without
engines (`--machine train_only`), and a rollout be looked at sample by sample:

    python -c "from miles.rollout.debug_data import load_rollout_data as l; print(l('d/rollout_3.pt').samples[0])"

PATH is a template with `{rollout_id}` (miles' convention, `dump/{rollout_id}.pt`), or a folder, in
which case files are `PATH/rollout_<id>.pt`.
"""

from __future__ import annotations

import errno
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from miles.config import ConfigError
from miles.runtime.files import NEARLY_FULL_BYTES, WriteFailed, free_space, is_disk_full
from miles.types import Prompt, Sample, routing_as_lists

FORMAT = "miles-rollout-v1"


@dataclass
class SavedRollout:
    rollout_id: int
    samples: list[Sample]
    metrics: dict[str, Any]


def rollout_data_path(template: str, rollout_id: int) -> Path:
    if "{rollout_id}" in template:
        return Path(template.format(rollout_id=rollout_id))
    return Path(template) / f"rollout_{rollout_id}.pt"


WHAT = "the saved rollout (--save-debug-rollout-data)"


def save_rollout_data(path: Path, rollout_id: int, samples: list[Sample], metrics: dict[str, Any]) -> Path:
    """Write one rollout (atomically: a reader never sees half a file)."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": FORMAT, "rollout_id": rollout_id, "samples": [_plain(s) for s in samples],
                    "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}}, tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as exc:      # torch.save on a full disk: RuntimeError("... unexpected pos ...")
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WriteFailed(WHAT, path, exc)
        free = free_space(path.parent)
        if is_disk_full(exc) or (free is not None and free < NEARLY_FULL_BYTES):
            raise WriteFailed(WHAT, path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        raise
    return path


def _plain(s: Sample) -> dict[str, Any]:
    """The sample as lists and dicts: the fast engine's routing arrays as lists (weights_only loads no numpy)."""
    return asdict(replace(s, rollout_routed_experts=routing_as_lists(s.rollout_routed_experts)))


def load_rollout_data(path: str | Path, *, expect_rollout_id: int | None = None) -> SavedRollout:
    """Read a saved rollout; a missing file or another rollout's file is a ConfigError naming it."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--load-debug-rollout-data: no saved rollout at {p}; save them first with "
                          f"--save-debug-rollout-data (e.g. with --debug-rollout-only), or lower --num-rollout")
    raw = torch.load(p, weights_only=True)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"--load-debug-rollout-data: {p} is not a rollout saved by miles ({FORMAT})")
    if expect_rollout_id is not None and raw["rollout_id"] != expect_rollout_id:
        raise ConfigError(f"--load-debug-rollout-data: {p} holds rollout {raw['rollout_id']}, "
                          f"not {expect_rollout_id}: check the {{rollout_id}} in the path")
    samples = [Sample(**{**s, "prompt": Prompt(**s["prompt"])}) for s in raw["samples"]]
    return SavedRollout(rollout_id=raw["rollout_id"], samples=samples, metrics=dict(raw["metrics"]))
