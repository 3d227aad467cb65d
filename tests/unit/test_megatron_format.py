"""Megatron-LM checkpoint folders are recognized (without megatron-core), refused by the torch backend
with the fix, and --save-retain-interval keeps what miles keeps."""

from __future__ import annotations

import json

import pytest

from miles.checkpoint.megatron_format import megatron_checkpoint_info
from miles.checkpoint.store import CheckpointStore
from miles.config import ConfigError
from miles.config.flags import parse_flags
from tests.unit.test_tracking_flags import base


def dist(folder, backend="torch_dist"):
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": backend, "sharded_backend_version": 1}))
    (folder / "__0_0.distcp").write_bytes(b"")
    return folder


def test_miles_saves_the_converters_release_and_a_bare_dist_folder_are_recognized(tmp_path):
    saves = tmp_path / "saves"
    dist(saves / "iter_0000019")
    dist(saves / "iter_0000039")
    (saves / "latest_checkpointed_iteration.txt").write_text("39\n")
    info = megatron_checkpoint_info(saves)
    assert (info.iteration, info.dist_dir) == (39, saves / "iter_0000039")
    (saves / "latest_checkpointed_iteration.txt").unlink()            # no tracker: the newest iter_*
    assert megatron_checkpoint_info(saves).iteration == 39
    release = tmp_path / "Qwen3-4B_torch_dist"
    dist(release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    assert (megatron_checkpoint_info(release).iteration, megatron_checkpoint_info(release).dist_dir) == (
        None, release / "release")
    assert megatron_checkpoint_info(saves / "iter_0000019").iteration == 19     # a dist folder given directly


def test_our_own_checkpoints_and_other_folders_are_not_megatron(tmp_path):
    ours = tmp_path / "ours"
    store = CheckpointStore(ours)
    with store.saving(3) as tmp:
        (tmp / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert megatron_checkpoint_info(ours) is None                      # a manifest.json makes it ours
    assert megatron_checkpoint_info(dist(tmp_path / "zarr", backend="zarr")) is None
    assert megatron_checkpoint_info(tmp_path / "missing") is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert megatron_checkpoint_info(tmp_path / "hf") is None


def test_the_torch_backend_refuses_a_megatron_folder_naming_the_fix(tmp_path):
    ckpt = tmp_path / "Qwen3-4B_torch_dist"
    dist(ckpt / "iter_0000000")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    with pytest.raises(ConfigError) as info:
        parse_flags(base(tmp_path) + ["--load", str(ckpt), "--use-kl-loss", "--ref-load", str(ckpt)])
    assert sorted(p.split(" ", 2)[0] for p in info.value.problems) == ["--load", "--ref-load"]
    assert all("is a Megatron torch_dist checkpoint, which --train-backend torch cannot read: use --train-backend "
               "megatron, or start from the HF weights with --hf-checkpoint" in p for p in info.value.problems)


def test_save_retain_interval_keeps_every_nth_rollouts_checkpoint_and_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, retain_interval=4)
    for rollout_id in range(1, 12, 2):                 # --save-interval 2: rollouts 1, 3, 5, 7, 9, 11
        with store.saving(rollout_id):
            pass
        kept = [i for i, _ in store.list()]
    # miles keeps the checkpoint after every 4 rollouts (ids 3, 7: 4 and 8 rollouts done) and the newest
    assert kept == [3, 7, 11]
    with pytest.raises(ConfigError):
        parse_flags(base(tmp_path) + ["--save", str(tmp_path / "s"), "--save-interval", "3",
                                      "--save-retain-interval", "4"])
    cfg, _ = parse_flags(base(tmp_path) + ["--save", str(tmp_path / "s"), "--save-interval", "2",
                                           "--save-retain-interval", "4"])
    assert cfg.checkpoint.retain_interval == 4
