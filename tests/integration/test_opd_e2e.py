"""On-policy distillation end to end on real parts (local Ray, embedded engine, torch trainer with the
teacher inside it, tiny models): the student samples, the trainer's teacher scores the sampled tokens,
and the advantages carry -opd_kl_coef x (student - teacher logprob).

(a) A teacher equal to the policy: the reverse KL of the first rollout is 0 (the same weights score the
    same tokens). (b) Pure OPD (a constant reward: GRPO's advantages are 0, only the teacher moves the
    student) towards a different tiny model: the student's reverse KL to the teacher falls, both as the
    train rows report it and as the exact KL(student || teacher) of the next-token distributions on the
    training prompts, before and after.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from miles.api.launch import train
from miles.checkpoint.store import CheckpointStore
from miles.config.flags import parse_flags
from miles.runtime import with_disposer
from tests.conftest import base_flags
from tests.tiny_model import make_tiny_model

pytestmark = pytest.mark.ray

CONSTANT_REWARD = "def zero(prompt, response, label):\n    return 0.0\n"


def run(argv):
    cfg, machine = parse_flags(argv)
    return asyncio.run(with_disposer(train, cfg, machine=machine or "sync"))


def train_rows(result) -> list[dict]:
    return [r for r in result.metrics if r.get("kind") == "train"]


def reverse_kl(student_dir: str, teacher_dir: str, prompts: list[str]) -> float:
    """Mean over `prompts` of KL(student || teacher) of the first response token's distribution (exact)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student_dir)
    student, teacher = (AutoModelForCausalLM.from_pretrained(d).eval() for d in (student_dir, teacher_dir))
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    kls = []
    with torch.no_grad():
        for x in ids:
            s, t = (torch.log_softmax(m(input_ids=torch.tensor([x])).logits[0, -1].float(), -1)
                    for m in (student, teacher))
            kls.append(float((s.exp() * (s - t)).sum()))
    return sum(kls) / len(kls)


def test_a_teacher_equal_to_the_policy_gives_zero_reverse_kl(ray_cluster, tiny_task, tmp_path):
    torch.set_num_threads(1)
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=1, use_opd=True, opd_type="megatron",
                            opd_teacher_load=tiny_task["model"]))
    (row,) = train_rows(result)
    assert abs(row["opd_reverse_kl"]) < 1e-6
    assert row["logprob_passes"] == 2.0                  # the student's old logprobs and the teacher's


def test_pure_opd_pulls_the_student_towards_the_teacher(ray_cluster, tiny_task, tmp_path):
    torch.set_num_threads(1)
    teacher = make_tiny_model(tmp_path / "teacher", seed=1)       # the policy's tokenizer, other weights
    reward = tmp_path / "zero_reward.py"
    reward.write_text(CONSTANT_REWARD)
    # 64 samples a rollout: the sampled-token KL is a noisy estimate, its gradient too (one step a rollout)
    result = run(base_flags(tiny_task, tmp_path / "run", num_rollout=4, rollout_batch_size=16, use_opd=True,
                            opd_type="megatron", opd_teacher_load=teacher, opd_kl_coef=1.0,
                            custom_rm_path=f"{reward}:zero", lr=5e-2, rollout_shuffle=False, save=tmp_path / "ckpt",
                            save_interval=4))
    rows = train_rows(result)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["reward_mean"] == 0.0 for r in rows)    # the rewards contribute nothing
    kls = [r["opd_reverse_kl"] for r in rows]
    # on the CPU: 2.69, 2.47, 1.99, 1.80 nats
    assert kls[0] > 1.0 and kls[-1] < 0.8 * kls[0] and kls[-1] == min(kls), kls
    prompts = [json.loads(x)["input"] for x in open(tiny_task["train"]).read().splitlines()[:16]]
    final = str(CheckpointStore(tmp_path / "ckpt").latest()[1] / "hf")
    before, after = reverse_kl(tiny_task["model"], teacher, prompts), reverse_kl(final, teacher, prompts)
    assert after < 0.8 * before, (before, after)      # on the CPU: 2.88 -> 1.75 nats
