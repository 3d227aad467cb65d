"""On-policy distillation: the advantage adjustment (pure math, by hand), where it sits in the trainer's
preparation (after the estimator, before whitening; miles' order), the teacher logprobs a batch packs,
and the config's refusals (a teacher with another tokenizer, the backends that do not take OPD)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from miles.algorithms import normalize_advantages, opd_advantages
from miles.config import AlgorithmConfig, ConfigError, RolloutConfig
from miles.config.flags import parse_flags
from miles.config.schema import parse_opd_teachers
from miles.training.batch import make_train_batch
from miles.training.terms import PolicyObjective
from miles.types import Prompt, Sample
from tests.conftest import base_flags, write_addition_task
from tests.tiny_model import make_tiny_model


def test_opd_advantages_subtract_the_weighted_reverse_kl_on_the_mask():
    adv = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    student = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    teacher = torch.tensor([[0.0, -1.5, -1.0, -9.0]])
    mask = torch.tensor([[False, True, True, False]])
    out, kl = opd_advantages(adv, student, teacher, mask, kl_coef=2.0)
    # reverse KL on the mask: -1.0 - (-1.5) = 0.5, -2.0 - (-1.0) = -1.0; 0 off it (the -9 is never read)
    assert kl.tolist() == [[0.0, 0.5, -1.0, 0.0]]
    # 0.5 - 2 * 0.5 = -0.5; 0.5 - 2 * (-1.0) = 2.5; off the mask the advantage stays as given
    assert out.tolist() == [[0.0, -0.5, 2.5, 0.0]]


def test_opd_advantages_refuse_tensors_of_other_shapes():
    with pytest.raises(ValueError, match="one shape"):
        opd_advantages(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3, dtype=torch.bool), 1.0)


def sample(response: list[int], teacher: list[float] | None, logprobs: list[float], advantage: float = 0.0) -> Sample:
    return Sample(prompt=Prompt(index=0, text="1+1=", prompt_ids=(5, 6)), group=0, response_ids=response,
                  rollout_logprobs=logprobs, finish_reason="stop", weight_version=0, advantage=advantage,
                  teacher_logprobs=teacher)


SAMPLES = [sample([7, 2], [-0.5, -1.0], [-0.25, -0.5], advantage=1.0),
           sample([8, 9, 2], [-2.0, -0.125, -0.25], [-1.0, -0.5, -0.75], advantage=-1.0)]


def prepared(samples=SAMPLES, train_lp: torch.Tensor | None = None, **algorithm):
    obj = PolicyObjective(AlgorithmConfig(use_opd=True, opd_type="sglang", **algorithm),
                          RolloutConfig(batch_size=1, n_samples_per_prompt=2))
    batch = make_train_batch(samples, 0)
    _, metrics = obj.prepare(batch, batch.rollout_logprobs if train_lp is None else train_lp, None, None)
    return batch, metrics


def test_the_batch_packs_the_teacher_logprobs_under_the_response_tokens():
    batch = make_train_batch(SAMPLES, 0)
    # prompt (2 tokens) then the response; 0 on the prompt and the padding
    assert batch.teacher_logprobs.tolist() == [[0, 0, -0.5, -1.0, 0], [0, 0, -2.0, -0.125, -0.25]]
    assert make_train_batch([sample([7], None, [-0.5])], 0).teacher_logprobs is None
    with pytest.raises(ValueError, match="no teacher logprobs"):
        make_train_batch([SAMPLES[0], sample([7], None, [-0.5])], 0)


def test_prepare_adds_the_reverse_kl_of_the_student_to_the_estimators_advantages():
    batch, metrics = prepared(opd_kl_coef=1.0)
    # student = the trainer's logprobs (here the rollout's, passed as train_lp):
    # row 0: adv 1 - (-0.25 - -0.5) = 0.75, 1 - (-0.5 - -1.0) = 0.5
    # row 1: -1 - (-1.0 - -2.0) = -2.0, -1 - (-0.5 - -0.125) = -0.625, -1 - (-0.75 - -0.25) = -0.5
    assert batch.advantages.tolist() == [[0, 0, 0.75, 0.5, 0], [0, 0, -2.0, -0.625, -0.5]]
    # the mean reverse KL over the 5 trained tokens: (0.25 + 0.5 + 1.0 - 0.375 - 0.5) / 5 = 0.175
    assert metrics["opd_reverse_kl"] == pytest.approx(0.175)


def test_the_student_is_the_engine_with_use_rollout_logprobs_and_whitening_comes_after():
    train_lp = torch.zeros(2, 5)            # ignored: --use-rollout-logprobs makes the engine's the student's
    batch, _ = prepared(train_lp=train_lp, opd_kl_coef=1.0, use_rollout_logprobs=True, normalize_advantages=True)
    raw, _ = prepared(opd_kl_coef=1.0)
    # whitening the OPD-adjusted advantages (miles: compute_advantages, then OPD, then normalize)
    assert torch.allclose(batch.advantages, normalize_advantages(raw.advantages, raw.loss_mask))


def test_opd_keeps_the_old_logprob_pass_and_refuses_a_batch_without_teacher_logprobs():
    obj = PolicyObjective(AlgorithmConfig(use_opd=True, opd_type="megatron"), RolloutConfig(batch_size=1))
    assert not obj.may_skip_old_pass
    batch = make_train_batch([sample([7], None, [-0.5])], 0)
    with pytest.raises(ValueError, match="teacher's logprobs"):
        obj.prepare(batch, batch.rollout_logprobs, None, None)


def test_teacher_urls_name_their_teachers_and_a_bare_url_is_the_default():
    assert parse_opd_teachers(("math=http://a:1/generate", "http://b:2", "q=http://c:3/generate?x=1")) == {
        "math": "http://a:1/generate", "default": "http://b:2", "q": "http://c:3/generate?x=1"}
    for bad, match in ((("math=a:1",), "expected NAME=URL"), (("x=http://a", "x=http://b"), "twice")):
        with pytest.raises(ValueError, match=match):
            parse_opd_teachers(bad)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    train, _ = write_addition_task(root, n_train=8, n_eval=1)
    return {"model": make_tiny_model(root / "model"), "train": str(train), "root": root}


def problems(task, tmp_path, **flags) -> str:
    with pytest.raises(ConfigError) as err:
        parse_flags(base_flags(task, tmp_path / "run", **flags))
    return str(err.value)


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_starts(task, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(task["model"], teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]       # same size, two ids swapped
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    text = problems(task, tmp_path, use_opd=True, opd_type="megatron", opd_teacher_load=teacher)
    assert "--opd-teacher-load" in text and "vocabulary" in text and "policy's tokenizer" in text
    parse_flags(base_flags(task, tmp_path / "run", use_opd=True, opd_type="megatron",
                           opd_teacher_load=task["model"]))     # the same tokenizer passes


@pytest.mark.parametrize("flags, match", [
    (dict(use_opd=True), "needs --opd-type"),
    (dict(opd_type="sglang"), "no effect without --use-opd"),
    (dict(use_opd=True, opd_type="megatron"), "needs --opd-teacher-load"),
    (dict(use_opd=True, opd_type="sglang"), "needs --opd-teacher-urls"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_urls=["http://a:1"], opd_teacher_load="x"),
     "is for --opd-type megatron"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_urls=["http://a:1"], opd_kl_coef=-1), "finite number >= 0"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_urls=["http://a:1"], skip_actor_forward_only=True),
     "add --use-rollout-logprobs"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_urls=["http://a:1"], train_backend="megatron"),
     "--train-backend megatron does not take on-policy distillation"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_urls=["http://a:1"], actor_num_gpus_per_node=2),
     "on 2 ranks does not take on-policy distillation"),
])
def test_opd_flags_are_checked_with_a_line_that_names_the_fix(task, tmp_path, flags, match):
    assert match in problems(task, tmp_path, **flags)
