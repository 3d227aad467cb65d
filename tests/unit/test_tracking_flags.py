"""Tracking flags: they land in TrackingConfig, and `miles train --help` gives every flag a help line
with its default, grouped by concern."""

from __future__ import annotations

import re

from miles.config.flags import FLAGS, GROUP_TITLES, REQUIRED, build_parser, help_line, parse_flags

def base(tmp_path):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"input": "1+1="}\n')
    return ["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "p.jsonl"),
            "--rollout-batch-size", "1", "--num-rollout", "1", "--n-samples-per-prompt", "8"]


def test_tracking_flags_build_the_tracking_config(tmp_path, monkeypatch):
    # the config alone: --use-tensorboard's package (an extra, not in the dev install) counted as installed
    from miles.config import packages

    real = packages.installed
    monkeypatch.setattr(packages, "installed", lambda module: module == "tensorboard" or real(module))
    cfg, _ = parse_flags(base(tmp_path) + ["--use-tensorboard", "--tensorboard-dir", "tb", "--progress", "plain",
                                 "--wandb-project", "proj", "--wandb-mode", "offline", "--worker-log-level", "debug"])
    t = cfg.tracking
    assert (t.use_tensorboard, t.tensorboard_dir, t.progress, t.wandb_project, t.wandb_mode, t.worker_log_level) == (
        True, "tb", "plain", "proj", "offline", "debug")
    assert parse_flags(base(tmp_path))[0].tracking.use_wandb is False


def test_every_flag_has_a_help_line_and_its_default():
    for f in FLAGS:
        line = help_line(f)
        assert f.help.strip(), f"--{f.name} has no help"
        assert re.search(r"\(required\)|default", line), f"--{f.name}: {line!r} states no default"
    assert help_line(next(f for f in FLAGS if f.name == "wandb-project")).endswith("(default: miles)")
    assert help_line(next(f for f in FLAGS if f.name == "use-tensorboard")).endswith("(default: off)")
    assert all(help_line(next(f for f in FLAGS if f.name == n)).endswith("(required)") for n in REQUIRED)


def test_help_is_grouped_by_concern_and_shows_defaults():
    text = build_parser().format_help()
    positions = [text.index(f"\n{title}:\n") for title in GROUP_TITLES.values()]
    assert positions == sorted(positions)             # every group, in the table's order
    tracking = " ".join(text[text.index("\ntracking ("):].split())
    assert "--use-wandb" in tracking and "pip install miles[wandb]" in tracking
    assert "--n-samples-per-prompt N" in text and "(default: 8)" in text
