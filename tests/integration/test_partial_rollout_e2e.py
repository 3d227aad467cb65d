"""--partial-rollout through the whole loop (local Ray, two embedded engines, the torch trainer, a tiny
model): dynamic sampling aborts the engine still generating once the batch is full, its group waits in
the buffer, the buffer filter (by file path) hands it to a later rollout, which continues it, and the
trainer trains on it; the checkpoint holds the buffer."""

from __future__ import annotations

import json

import pytest

from miles.checkpoint.checkpointer import ROLLOUT_FILE
from miles.checkpoint.store import CheckpointStore
from tests.conftest import base_flags, miles_actors
from tests.integration.test_main_job import run

pytestmark = pytest.mark.ray

HOOKS = '''
import json

def keep_all(group):
    return True

def oldest_first(ctx, rollout_id, buffer, num_groups):
    with open(FILTER_LOG, "a") as f:
        f.write(json.dumps({"rollout": rollout_id, "buffered": len(buffer), "asked": num_groups}) + "\\n")
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken

def record(ctx, groups):
    with open(LOG, "a") as f:
        f.write(json.dumps({"rollout": ctx.rollout_id, "samples": [
            {"start": s.metadata.get("start_rollout_id"), "versions": s.metadata.get("weight_versions"),
             "length": s.response_length, "trained": sum(s.mask())} for g in groups for s in g]}) + "\\n")
'''


def test_an_aborted_group_is_continued_by_a_later_rollout_and_trained(ray_cluster, tiny_task, tmp_path):
    hooks, log, filter_log = tmp_path / "hooks.py", tmp_path / "batches.jsonl", tmp_path / "filter.jsonl"
    hooks.write_text(f"LOG = {str(log)!r}\nFILTER_LOG = {str(filter_log)!r}\n" + HOOKS)   # the executor actor appends
    # one prompt a rollout out of two per round: the engine that answers first fills the batch, the other is cut
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=4, rollout_num_engines=2, rollout_batch_size=1,
                            n_samples_per_prompt=2, over_sampling_batch_size=2, rollout_max_response_len=24,
                            dynamic_sampling_filter_path=f"{hooks}:keep_all", partial_rollout=True, use_tis=True,
                            buffer_filter_path=f"{hooks}:oldest_first", rollout_sample_filter_path=f"{hooks}:record",
                            save=tmp_path / "ckpt", save_interval=4))
    assert result.final_state == "shutdown"
    rows = [r for r in result.metrics if "partial_rollout_aborted_groups" in r]
    # a round's two engine calls may come back together (nothing left to cut), so not every rollout aborts one
    assert len(rows) == 4 and sum(r["partial_rollout_aborted_groups"] for r in rows) >= 1, rows
    for before, row in zip(rows, rows[1:]):                  # each rollout continues what the one before buffered
        assert row["partial_rollout_resumed_groups"] == before["partial_rollout_buffer_groups"] <= 1
    # the buffer filter (by file path, in the executor actor) picked for each rollout that found a group buffered
    picks = [json.loads(line) for line in filter_log.read_text().splitlines()] if filter_log.exists() else []
    assert picks == [{"rollout": r + 1, "buffered": 1, "asked": 2} for r, row in enumerate(rows[:-1])
                     if row["partial_rollout_buffer_groups"]]
    batches = [json.loads(line) for line in log.read_text().splitlines()]
    carried = [(b["rollout"], s) for b in batches for s in b["samples"] if s["start"] is not None]
    assert carried, batches                                   # a trained batch holds a continued sample
    for rollout, s in carried:      # begun on older weights (cut mid-way, or done just before the abort landed)
        assert s["start"] < rollout and s["versions"][0] < rollout and s["versions"] == sorted(s["versions"])
    # the trainer trained on every response token of each batch, the continued samples' old parts included
    for b, row in zip(batches, rows):
        assert row["train_tokens"] == sum(s["trained"] for s in b["samples"]) == sum(s["length"] for s in b["samples"])
    # the last checkpoint holds what the last rollout left in the buffer
    _, folder = CheckpointStore(tmp_path / "ckpt").latest()
    buffered = json.loads((folder / ROLLOUT_FILE).read_text())["partial_buffer"]
    assert [len(g) for g in buffered] == [2] * int(rows[-1]["partial_rollout_buffer_groups"])
    assert miles_actors() == []
