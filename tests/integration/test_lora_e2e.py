"""LoRA end to end on real parts (local Ray, embedded engine, torch trainer, tiny model): the policy learns
through its adapters while the base stays bit for bit, the engine holds the merged weights
(--check-weight-update-equal), a resume continues bit-identically, and the HF export is the trainer's model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from miles.checkpoint.store import CheckpointStore
from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.runtime import read_trace
from miles.metrics.jsonl import untimed
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import load_causal_lm, model_weights
from tests.conftest import base_flags
from tests.integration.test_algorithms_e2e import all_ones_logprob, ones_reward, run  # noqa: F401
from tests.unit.test_trainer import SAMPLES

pytestmark = pytest.mark.ray

LORA = dict(lora_rank=4, lora_alpha=8, target_modules="q_proj,v_proj,up_proj,down_proj", lora_dropout=0.1, lr=5e-2,
            advantage_estimator="grpo", use_kl_loss=True, kl_loss_coef=0.01, rollout_shuffle=False, num_rollout=2,
            save_interval=1)


@pytest.fixture(scope="module")
def lora_run(ray_cluster, tiny_task, ones_reward, tmp_path_factory):
    """One uninterrupted LoRA GRPO run of 2 rollouts, saving after each, its weight syncs checked."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora")
    result = run(base_flags(tiny_task, root / "run", custom_rm_path=ones_reward, save=root / "ck",
                            check_weight_update_equal=True, **LORA))
    return result, root / "ck"


def test_lora_grpo_learns_through_adapters_and_engines_hold_the_merged_weights(lora_run, tiny_task):
    result, ck = lora_run
    prompts = [json.loads(x)["input"] for x in open(tiny_task["train"]).read().splitlines()[:8]]
    assert result.final_state == "shutdown"
    synced = read_trace(result.run_dir).of("weights_synced")
    assert [e.get("version") for e in synced] == [0, 1, 2]        # each checked against the trainer's merged weights
    final = CheckpointStore(ck).latest()[1]
    exported = final / "hf"
    gain = (all_ones_logprob(str(exported), prompts) - all_ones_logprob(tiny_task["model"], prompts)).mean()
    assert gain > 0.5, gain                                        # the policy moved toward the reward
    base = model_weights(load_causal_lm(tiny_task["model"], device=torch.device("cpu"), dtype=torch.float32))
    merged = load_file(str(exported / "model.safetensors"))
    adapted = {n for n in base if any(f".{m}.weight" in n for m in ("q_proj", "v_proj", "up_proj", "down_proj"))}
    assert all(torch.equal(merged[n], base[n]) for n in base if n not in adapted)    # the rest is the base, bit for bit
    assert all(not torch.equal(merged[n], base[n]) for n in adapted)
    assert state_dict_checksum(merged) == synced[-1].get("checksum")   # the engine's weights are the export's
    trainer_files = sorted(p.name for p in (final / "trainer").iterdir())
    assert "model.safetensors" not in trainer_files and "adapter_model.safetensors" in trainer_files
    assert (exported / "adapter" / "adapter_config.json").is_file()
    # the export gives the trainer's logprobs: a trainer resumed from the checkpoint vs. transformers on the export
    from transformers import AutoModelForCausalLM

    trainer = Trainer(tiny_task["model"], device="cpu", rollout=RolloutConfig(batch_size=1),
                      algorithm=AlgorithmConfig(loss_agg_mode="token_mean"),
                      train=TrainConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.1,
                                        target_modules=LORA["target_modules"]))
    trainer.load(final / "trainer")
    batch = trainer.prepare(make_train_batch(SAMPLES, trainer.pad_id))
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits[:, :-1].float()
    hf = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    torch.testing.assert_close(hf[mask], batch.old_logprobs[:, 1:][mask], rtol=0, atol=1e-5)


def test_lora_resume_matches_an_uninterrupted_run(lora_run, tiny_task, ones_reward, tmp_path):
    # the uninterrupted run's checkpoint after rollout 0 is where a run stopped there would resume from
    full, ck_full = lora_run
    resumed = run(base_flags(tiny_task, tmp_path / "second", custom_rm_path=ones_reward, save=tmp_path / "ck",
                             load=ck_full, **LORA) + ["--ckpt-step", "0"])
    event = read_trace(resumed.run_dir).of("resumed")[0]
    assert (event.rollout_id, event.get("next_rollout")) == (0, 1)
    full_rows = {r["step"]: untimed(r) for r in full.metrics if r.get("kind") == "train"}
    resumed_rows = {r["step"]: untimed(r) for r in resumed.metrics if r.get("kind") == "train"}
    assert sorted(resumed_rows) == [1]
    assert resumed_rows[1] == full_rows[1]
    a = load_file(str(CheckpointStore(ck_full).latest()[1] / "trainer" / "adapter_model.safetensors"))
    b = load_file(str(CheckpointStore(tmp_path / "ck").latest()[1] / "trainer" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)      # dropout and AdamW's moments too
