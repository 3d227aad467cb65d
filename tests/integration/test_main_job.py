"""The whole loop on real parts: local Ray, the embedded engine, the torch trainer, a tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest
from safetensors.torch import load_file

from miles.checkpoint.store import CheckpointStore
from miles.weights.checksum import state_dict_checksum
from miles.config.flags import parse_flags
from miles.api.launch import train
from miles.runtime.procs import usable_cores
from miles.runtime import read_trace, with_disposer
from miles.metrics.jsonl import untimed
from miles.cli.train import main as train_main
from tests.conftest import base_flags, miles_actors

pytestmark = pytest.mark.ray



def run(argv):
    cfg, machine = parse_flags(argv)
    return asyncio.run(with_disposer(train, cfg, machine=machine or "sync"))


def comparable(row):
    return untimed(row)


def test_three_rollouts_end_to_end(ray_cluster, tiny_task, tmp_path):
    result = run(base_flags(tiny_task, tmp_path / "run", save=tmp_path / "ckpt", save_interval=2,
                            eval_prompt_data=["arith", tiny_task["eval"]], eval_interval=2,
                            check_weight_update_equal=True))
    assert result.final_state == "shutdown"
    trace = read_trace(result.run_dir)
    assert trace.events[-1].event == "run_end" and trace.events[-1].get("outcome") == "ok"
    states = [e.state for e in trace.of("phase_start")]
    assert states.count("rollout") == 3 and states.count("train") == 3
    assert states[:3] == ["init", "weight_sync", "eval"] and states[-1] == "draining"
    # every registered resource disposed, in reverse order
    registered = [e.get("resource") for e in trace.of("registered")]
    disposed = [e.get("resource") for e in trace.of("disposed")]
    assert disposed == list(reversed(registered)) and all(e.get("outcome") == "ok" for e in trace.of("disposed"))
    assert {"engine-0", "trainer", "rollout-executor", "ray_cluster", "metrics_writer"} <= set(registered)
    # weights reached the engine with versions 0..3, and the checksums matched
    assert [e.get("version") for e in trace.of("weights_synced")] == [0, 1, 2, 3]
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [0, 1, 2]
    for key in ("reward_mean", "reward_std", "response_len_mean", "loss", "kl", "entropy", "clip_frac",
                "grad_norm", "gen_tokens_per_s", "train_time_s"):
        assert key in train_rows[0], key
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 3]
    # checkpoints after rollouts 1 and 2, each with an HF export transformers loads
    store = CheckpointStore(tmp_path / "ckpt")
    assert [rid for rid, _ in store.list()] == [1, 2]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(store.latest()[1] / "hf")
    assert model.config.vocab_size == 32
    assert miles_actors() == []


@pytest.mark.extended   # out of the default run (CI budget): tests/faults/test_driver_kill.py resumes after kill -9 and matches an uninterrupted run
def test_resume_matches_an_uninterrupted_run(ray_cluster, tiny_task, tmp_path):
    # with the default engine count: two engines on a CPU of two or more cores, each its own part of the
    # batch and its own seed, so the runs below are reproducible with two engines as with one
    flags = dict(num_rollout=4, save_interval=2, rollout_num_engines=None)
    full = run(base_flags(tiny_task, tmp_path / "full", save=tmp_path / "ck_full", **flags))
    placement = read_trace(full.run_dir).of("placement")[0]
    two = usable_cores() >= 2
    assert len(placement.get("engines")) == (2 if two else 1)
    assert ("--rollout-num-engines 1" in placement.get("auto_engines")) if two else placement.get("auto_engines") is None
    # the same run, stopped after 2 rollouts (it saves on the way out), then resumed from its checkpoint
    run(base_flags(tiny_task, tmp_path / "first", save=tmp_path / "ck", debug_exit_after_rollout=2, **flags))
    resumed = run(base_flags(tiny_task, tmp_path / "second", save=tmp_path / "ck", load=tmp_path / "ck", **flags))
    assert read_trace(resumed.run_dir).of("resumed")[0].rollout_id == 1
    full_rows = {r["step"]: comparable(r) for r in full.metrics if r.get("kind") == "train"}
    resumed_rows = {r["step"]: comparable(r) for r in resumed.metrics if r.get("kind") == "train"}
    assert sorted(resumed_rows) == [2, 3]
    for step in (2, 3):
        assert resumed_rows[step] == full_rows[step], step
    a = load_file(str(CheckpointStore(tmp_path / "ck_full").latest()[1] / "trainer" / "model.safetensors"))
    b = load_file(str(CheckpointStore(tmp_path / "ck").latest()[1] / "trainer" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_async_save_writes_the_synchronous_checkpoints_while_the_run_goes_on(ray_cluster, tiny_task, tmp_path):
    # the same run saving after every rollout, synchronously and with --async-save: the same checkpoints,
    # file for file; each background save committed before the next one starts, the last one at draining
    flags = dict(num_rollout=3, save_interval=1)
    run(base_flags(tiny_task, tmp_path / "sync", save=tmp_path / "ck_sync", **flags))
    result = run(base_flags(tiny_task, tmp_path / "bg", save=tmp_path / "ck_bg", async_save=True, **flags))
    assert result.final_state == "shutdown"
    trace = read_trace(result.run_dir)
    snapshots, saved = trace.of("checkpoint_snapshot"), trace.of("checkpoint_saved")
    assert [e.rollout_id for e in snapshots] == [e.rollout_id for e in saved] == [0, 1, 2]
    assert all(e.get("background") for e in saved)
    assert snapshots[0].seq < saved[0].seq < snapshots[1].seq < saved[1].seq < snapshots[2].seq < saved[2].seq
    assert saved[2].seq < trace.of("drained")[0].seq
    registered = [e.get("resource") for e in trace.of("registered")]
    assert registered.index("background_save") > registered.index("trainer")      # settled before the trainer goes
    sync, background = CheckpointStore(tmp_path / "ck_sync"), CheckpointStore(tmp_path / "ck_bg")
    assert [rid for rid, _ in background.list()] == [rid for rid, _ in sync.list()] == [0, 1, 2]
    for (_, a), (_, b) in zip(sync.list(), background.list()):
        files_a, files_b = (json.loads((p / "manifest.json").read_text())["files"] for p in (a, b))
        assert files_a.keys() == files_b.keys()
        for name in files_a:
            if name.endswith(".safetensors") or name.endswith(".json") and "trainer_state" in name:
                assert files_a[name]["sha256"] == files_b[name]["sha256"], (a.name, name)
        assert (a / "rollout.json").read_text() == (b / "rollout.json").read_text()
    assert miles_actors() == []


def test_finetune_ckpt_step_and_no_load_optim_take_only_their_parts_of_the_checkpoint(ray_cluster, tiny_task,
                                                                                      tmp_path):
    # a 2-rollout run with a 2-step warmup saves after each rollout (its --load is its --save, not there yet:
    # it starts fresh, traced); --finetune starts over from the newest's weights (rollout 0, step 0: the
    # warmup again); --ckpt-step 0 --no-load-optim --no-load-rng continues after the first checkpoint
    # (rollout 1, step 1) with a fresh AdamW
    flags = dict(num_rollout=2, lr_warmup_iters=2)
    first = run(base_flags(tiny_task, tmp_path / "first", save=tmp_path / "ck", load=tmp_path / "ck", save_interval=1,
                           **flags))
    skipped = read_trace(first.run_dir).of("resume_skipped")
    assert len(skipped) == 1 and skipped[0].get("reason") == "no checkpoint there yet"    # its --save lock made it
    assert (tmp_path / "ck" / "iter_0000000" / "manifest.json").is_file()                # and it saved there
    saved = CheckpointStore(tmp_path / "ck").latest()[1] / "trainer" / "model.safetensors"
    lrs = [r["lr"] for r in first.metrics if r.get("kind") == "train"]
    assert lrs[0] < lrs[1]                                      # warming up
    tuned = run(base_flags(tiny_task, tmp_path / "ft", load=tmp_path / "ck", check_weight_update_equal=True, **flags)
                + ["--finetune"])
    trace = read_trace(tuned.run_dir)
    resumed = trace.of("resumed")[0]
    assert (resumed.rollout_id, resumed.get("next_rollout")) == (1, 0)
    assert resumed.get("fresh") == ["optimizer", "rng", "step_count_and_data_position"]
    rows = [r for r in tuned.metrics if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [0, 1] and [r["lr"] for r in rows] == pytest.approx(lrs)
    # the engines' first weights are the checkpoint's (the trainer's after the load), not --hf-checkpoint's
    assert trace.of("weights_synced")[0].get("checksum") == state_dict_checksum(load_file(str(saved)))
    fresh = run(base_flags(tiny_task, tmp_path / "fresh", load=tmp_path / "ck", **{**flags, "num_rollout": 3})
                + ["--ckpt-step", "0", "--no-load-optim", "--no-load-rng"])
    resumed = read_trace(fresh.run_dir).of("resumed")[0]
    assert (resumed.rollout_id, resumed.get("next_rollout")) == (0, 1)
    assert resumed.get("fresh") == ["optimizer", "rng"]
    rows = [r for r in fresh.metrics if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["lr"] == pytest.approx(lrs[1])     # step count kept
    assert load_file(str(saved)).keys()        # the checkpoint both read is still whole
    assert miles_actors() == []


def test_rollout_engine_fast_runs_the_loop_with_its_options_and_checked_weights(ray_cluster, tiny_task, tmp_path):
    # FastEngine through the whole loop (on CPU: eager, the CUDA path minus graphs and compilation):
    # its options reach the actor, weights land in place, and their checksums match the trainer's. The
    # reward is a custom async one given by file path (the rest of the run does not depend on it)
    rm = tmp_path / "my_reward.py"
    rm.write_text(
        "async def length_reward(prompt, response, label):\n"
        "    return float(len(response))\n")
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=2, rollout_engine="fast",
                            rollout_max_batch_size=8, check_weight_update_equal=True,
                            custom_rm_path=f"{rm}:length_reward"))
    assert result.final_state == "shutdown"
    trace = read_trace(result.run_dir)
    picked, = trace.of("engine_picked")
    assert (picked.get("engine"), picked.get("cls")) == ("fast", "FastEngine")
    # mem_fraction unset: the engine's own default (its spec's), not a config copy of it
    assert picked.get("options") == dict(max_batch_size=8, cuda_graph=True, torch_compile=True, attention_kernel=True)
    assert [e.get("version") for e in trace.of("weights_synced")] == [0, 1, 2]
    assert result.metrics[0]["response_len_mean"] > 0
    # the reward is the response length in characters; every char token decodes to one char (EOS to none)
    assert result.metrics[0]["reward_mean"] > 0
    assert miles_actors() == []


def test_rollout_engine_fast_refuses_a_model_it_does_not_implement_before_any_actor(ray_cluster, tiny_task,
                                                                                     tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32)).save_pretrained(tmp_path / "gpt2")
    code = train_main(base_flags({**tiny_task, "model": str(tmp_path / "gpt2")}, tmp_path / "run",
                                 rollout_engine="fast"))
    err = capsys.readouterr().err
    assert code == 2
    assert "--rollout-engine fast cannot run" in err and "model_type 'gpt2' is not implemented" in err
    assert miles_actors() == []
    assert not (tmp_path / "run").exists()          # refused with the flags, before the run dir or Ray


def test_malformed_jsonl_names_file_and_line_and_starts_no_actor(ray_cluster, tiny_task, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": \n{"input": "3+3="}\n')
    code = train_main(base_flags({**tiny_task, "train": str(bad)}, tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 2
    assert f"{bad}" in err and "line 2" in err
    assert miles_actors() == []
    trace = read_trace(tmp_path / "run")
    assert trace.events[-1].get("outcome") == "failed" and trace.of("error")[0].state == "init"


def test_bad_flags_are_reported_together_before_anything_starts(tiny_task, tmp_path, capsys):
    code = train_main(base_flags(tiny_task, tmp_path / "run", rollout_batch_size=0, global_batch_size=5,
                                 micro_batch_size=2, rollout_top_p=1.5))
    err = capsys.readouterr().err
    assert code == 2
    for part in ("--rollout-batch-size 0", "--rollout-top-p 1.5", "--global-batch-size 5 is not a multiple of --micro-batch-size 2"):
        assert part in err
    assert not (tmp_path / "run").exists()
