"""Never a silent fresh start (miles.checkpoint.resume): what a --load folder holds, and which
folders a run refuses to start from."""

from __future__ import annotations

import json

import pytest

from miles.checkpoint.resume import (UnusableLoadFolder, check_load_folder, classify_load_folder, refuse_fresh_start,
                                     skipped_line)
from miles.checkpoint.store import LATEST_FILE, CheckpointStore
from miles.runtime.runlock import LOCK_FILE


def save(store: CheckpointStore, rollout_id: int) -> None:
    with store.saving(rollout_id) as tmp:
        (tmp / "model.bin").write_bytes(b"weights")


def test_a_missing_or_empty_folder_starts_fresh_as_in_miles(tmp_path):
    assert classify_load_folder(tmp_path / "nope").kind == "missing"
    assert check_load_folder(str(tmp_path / "nope"), allow_fresh_start=False).reason == "no such directory yet"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / LOCK_FILE).write_text("")          # a run holding --save here: still nothing
    (tmp_path / "empty" / ".tmp-iter_0000000-abc").mkdir()    # an interrupted first save: not a checkpoint
    folder = check_load_folder(str(tmp_path / "empty"), allow_fresh_start=False)
    assert folder.kind == "empty" and folder.starts_fresh
    assert check_load_folder(None, allow_fresh_start=False) is None


def test_a_folder_of_files_but_no_checkpoint_is_refused_naming_what_it_holds(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / LATEST_FILE).write_text("7")
    with pytest.raises(UnusableLoadFolder) as refused:
        check_load_folder(str(tmp_path), allow_fresh_start=False)
    msg = str(refused.value)
    assert f"--load {tmp_path} holds files but no checkpoint ({LATEST_FILE}, model.safetensors)" in msg
    assert "names a checkpoint that is not there" in msg and "--allow-fresh-start" in msg
    assert check_load_folder(str(tmp_path), allow_fresh_start=True).kind == "no_checkpoint"


def test_a_folder_whose_checkpoints_all_fail_is_refused_listing_each_and_why(tmp_path):
    store = CheckpointStore(tmp_path)
    for i in range(3):
        save(store, i)
    (tmp_path / "iter_0000002" / "model.bin").write_bytes(b"short")          # size differs
    (tmp_path / "iter_0000001" / "manifest.json").unlink()
    folder = check_load_folder(str(tmp_path), allow_fresh_start=False)       # iter 0 passes the cheap check
    assert [c.rollout_id for c in folder.candidates] == [2, 1, 0]
    assert [c.usable for c in folder.candidates] == [False, False, True]
    (tmp_path / "iter_0000000" / "manifest.json").write_text("{not json")
    with pytest.raises(UnusableLoadFolder) as refused:
        check_load_folder(str(tmp_path), allow_fresh_start=False)
    lines = str(refused.value).splitlines()
    assert lines[0].startswith(f"--load {tmp_path}: none of its 3 checkpoints can be loaded")
    assert lines[1] == f"  iter_0000002: {tmp_path / 'iter_0000002' / 'model.bin'} has 5 bytes, the manifest says 7"
    assert lines[2] == f"  iter_0000001: {tmp_path / 'iter_0000001' / 'manifest.json'} is missing"
    assert lines[3].startswith(f"  iter_0000000: {tmp_path / 'iter_0000000' / 'manifest.json'} is unreadable")
    assert check_load_folder(str(tmp_path), allow_fresh_start=True).kind == "miles"


def test_the_deep_checks_findings_are_listed_too_and_a_skip_names_the_next_one(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 0)
    save(store, 1)
    folder = classify_load_folder(tmp_path)
    newest, older = folder.candidates
    sha = f"{newest.path / 'model.bin'} does not match its sha256 in the manifest"
    assert skipped_line(newest, [sha], [older]) == f"checkpoint iter_0000001 skipped: {sha}; trying iter_0000000 instead"
    assert skipped_line(older, ["a", "b"], []) == "checkpoint iter_0000000 skipped: a (and 1 more); no older checkpoint is left"
    msg = str(refuse_fresh_start(folder, {newest.path: [sha], older.path: ["x", "y"]}))
    assert f"  iter_0000001: {sha}" in msg and "  iter_0000000: x (and 1 more)" in msg
    assert json.loads((tmp_path / "iter_0000000" / "manifest.json").read_text())["rollout_id"] == 0


# ---- the sha256 check before Ray starts (miles.checkpoint.restore.hash_before_start) -------------------

def trainer_checkpoint(store: CheckpointStore, rollout_id: int) -> None:
    with store.saving(rollout_id) as tmp:
        (tmp / "trainer").mkdir()
        (tmp / "trainer" / "model.safetensors").write_bytes(b"weights-%d" % rollout_id)
        (tmp / "rollout.json").write_text("{}")
        (tmp / "hf").mkdir()
        (tmp / "hf" / "export.bin").write_bytes(b"not read by a load")


def flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01                                   # same size: only the sha256 tells
    path.write_bytes(bytes(data))


@pytest.fixture
def ctx_for(tmp_path):
    from miles.config import CheckpointConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig
    from miles.phases.context import TrainingContext
    from miles.runtime import Disposer, Tracer
    made = []

    def make(load, **checkpoint):
        cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"),
                        rollout=RolloutConfig(batch_size=1), num_rollout=1,
                        checkpoint=CheckpointConfig(load=str(load), **checkpoint))
        tracer = Tracer(tmp_path / f"t{len(made)}.jsonl", run_id="g", machine="sync", console="off")
        made.append(tracer)
        return TrainingContext(cfg, run_id="g", run_dir=tmp_path, tracer=tracer, disposer=Disposer())

    yield make
    for t in made:
        t.close()


def test_checkpoints_that_all_fail_their_sha256_are_refused_before_ray_starts(tmp_path, ctx_for):
    from miles.checkpoint.restore import hash_before_start
    ckpt = tmp_path / "ckpt"
    store = CheckpointStore(ckpt)
    for i in range(3):
        trainer_checkpoint(store, i)
    flip(ckpt / "iter_0000002" / "trainer" / "model.safetensors")
    flip(ckpt / "iter_0000001" / "hf" / "export.bin")             # a file the load does not read
    ctx = ctx_for(ckpt)
    hash_before_start(ctx, check_load_folder(str(ckpt), allow_fresh_start=False))
    newest, second = ckpt / "iter_0000002", ckpt / "iter_0000001"
    assert ctx.load_checked == {newest: [f"{newest / 'trainer' / 'model.safetensors'} does not match its sha256 "
                                         "in the manifest"], second: []}     # stops at the first that checks out
    for i in (1, 0):
        flip(ckpt / f"iter_000000{i}" / "trainer" / "model.safetensors")
    ctx = ctx_for(ckpt)
    with pytest.raises(UnusableLoadFolder) as refused:
        hash_before_start(ctx, check_load_folder(str(ckpt), allow_fresh_start=False))
    lines = str(refused.value).splitlines()
    assert lines[0].startswith(f"--load {ckpt}: none of its 3 checkpoints can be loaded")
    assert [line.split(":")[0] for line in lines[1:]] == ["  iter_0000002", "  iter_0000001", "  iter_0000000"]
    assert all("does not match its sha256 in the manifest" in line for line in lines[1:])
    allowed = ctx_for(ckpt, allow_fresh_start=True)
    hash_before_start(allowed, check_load_folder(str(ckpt), allow_fresh_start=True))    # said later, not refused
    assert len(allowed.load_checked) == 3 and all(allowed.load_checked.values())
    unverified = ctx_for(ckpt)
    object.__setattr__(unverified.cfg.reliability, "verify_load", False)                # --no-verify-load
    hash_before_start(unverified, check_load_folder(str(ckpt), allow_fresh_start=False))
    assert unverified.load_checked == {}
