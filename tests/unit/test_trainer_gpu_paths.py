"""The trainer's GPU paths, run on the CPU in float32 against the plain path: chunked logprobs from
hidden states, token-budget micro-batches, the skipped old-logprob pass, activation recomputation,
and the optimizer offload. Each must change nothing but memory and time."""

import dataclasses

import pytest
import torch

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from tests.tiny_model import make_tiny_model
from tests.unit.test_trainer import SAMPLES, sample


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def trainer(path, *, hidden_forward=False, skip_old_logprobs=False, algorithm=None, **train) -> Trainer:
    return Trainer(path, train=TrainConfig(**{"lr": 1e-2, "micro_batch_size": 2, **train}),
                   algorithm=algorithm or AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", entropy_coef=0.01), rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1),
                   device="cpu", hidden_forward=hidden_forward, skip_old_logprobs=skip_old_logprobs)


def grads(t: Trainer, samples=SAMPLES) -> tuple[dict, dict[str, torch.Tensor]]:
    batch = t.prepare(make_train_batch(samples, t.pad_id))
    t._optimizer.zero_grad(set_to_none=True)
    terms = t.accumulate_gradients(batch)
    return terms, {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def assert_same(a, b, tol=1e-5):
    (terms_a, grads_a), (terms_b, grads_b) = a, b
    assert terms_a.keys() == terms_b.keys()
    for k in terms_a:
        assert terms_a[k] == pytest.approx(terms_b[k], abs=tol), k
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        torch.testing.assert_close(grads_a[n], grads_b[n], atol=tol, rtol=1e-4)


def test_hidden_forward_gives_the_logits_paths_logprobs_loss_and_gradients(model_path):
    plain, hidden = trainer(model_path), trainer(model_path, hidden_forward=True)
    batch = make_train_batch(SAMPLES, plain.pad_id)
    lp_plain, lp_hidden = plain.prepare(batch).old_logprobs, hidden.prepare(batch).old_logprobs
    torch.testing.assert_close(lp_hidden[batch.loss_mask], lp_plain[batch.loss_mask], atol=1e-5, rtol=1e-5)
    assert (lp_hidden[~batch.loss_mask] == 0).all()          # computed on the response tokens only
    assert_same(grads(plain), grads(hidden))


def test_token_budget_micro_batches_give_the_same_gradient(model_path):
    # lengths 8, 3, 11, 3: a budget of 16 tokens makes [11] [8] [3, 3 ...]; the normalizer is the global batch's
    fixed = grads(trainer(model_path))
    dynamic = grads(trainer(model_path, use_dynamic_batch_size=True, max_tokens_per_gpu=16))
    assert_same(fixed, dynamic)


def saved_bytes_of_a_step(t: Trainer) -> int:
    """What autograd keeps for the backward during the step's forwards."""
    batch = t.prepare(make_train_batch(SAMPLES, t.pad_id))
    saved = [0]

    def pack(x):
        saved[0] += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        t.accumulate_gradients(batch)
    return saved[0]


def test_recompute_activations_keeps_less_and_changes_nothing(model_path):
    plain, recompute = trainer(model_path), trainer(model_path, recompute_activations=True)
    assert_same(grads(plain), grads(recompute))
    assert saved_bytes_of_a_step(recompute) < 0.5 * saved_bytes_of_a_step(plain)


def weights_after_one_rollout(t: Trainer, samples=SAMPLES):
    metrics = t.train(samples, rollout_id=0)
    return metrics, {n: p.detach().clone() for n, p in t.model.named_parameters()}


def test_the_old_logprob_pass_is_skipped_only_when_it_equals_the_steps_own(model_path):
    with_pass, m_pass = trainer(model_path), None
    m_pass, w_pass = weights_after_one_rollout(with_pass)
    m_skip, w_skip = weights_after_one_rollout(trainer(model_path, skip_old_logprobs=True))
    assert m_pass["logprob_passes"] == 1.0 and m_skip["logprob_passes"] == 0.0
    for k in ("logprob_diff_rollout", "logprob_diff_rollout_max", "train_rollout_k3_kl", "pg_loss", "entropy"):
        assert m_skip[k] == pytest.approx(m_pass[k], abs=1e-5), k   # the step saw the same logprobs
    for n in w_pass:
        torch.testing.assert_close(w_skip[n], w_pass[n], atol=1e-6, rtol=1e-5)
    # two optimizer steps per rollout: the second step's old logprobs are not its own: no skip
    assert trainer(model_path, skip_old_logprobs=True, global_batch_size=2).train(SAMPLES, 0)["logprob_passes"] == 1


TIS = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", entropy_coef=0.01, use_tis=True,
                      tis_clip_low=0.7, tis_clip=1.5)


def off_policy(model_path) -> list:
    """SAMPLES with rollout logprobs = the trainer's own + noise in [-1, 1]: TIS weights in [e^-1, e], some
    under --tis-clip-low 0.7, some over --tis-clip 1.5, some between."""
    t = trainer(model_path)
    lp = t.prepare(make_train_batch(SAMPLES, t.pad_id)).old_logprobs
    noise = torch.rand(lp.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out = []
    for i, s in enumerate(SAMPLES):
        p, r = len(s.prompt.prompt_ids), len(s.response_ids)
        out.append(sample(list(s.prompt.prompt_ids), s.response_ids, s.advantage,
                          (lp[i, p:p + r] + noise[i, p:p + r]).tolist()))
    return out


@pytest.mark.parametrize("micro", [dict(micro_batch_size=2), dict(micro_batch_size=1),
                                   dict(use_dynamic_batch_size=True, max_tokens_per_gpu=16)],
                         ids=["rows2", "rows1", "tokens16"])
def test_tis_skips_the_old_logprob_pass_with_the_same_step_and_metrics(model_path, micro):
    samples = off_policy(model_path)
    m_pass, w_pass = weights_after_one_rollout(trainer(model_path, algorithm=TIS, **micro), samples)
    m_skip, w_skip = weights_after_one_rollout(trainer(model_path, skip_old_logprobs=True, algorithm=TIS, **micro),
                                               samples)
    assert (m_pass["logprob_passes"], m_skip["logprob_passes"]) == (1.0, 0.0)
    assert m_pass.keys() == m_skip.keys()
    assert 0.2 < m_pass["tis_clip_frac"] < 0.8       # the weights straddle the bounds
    for k in ("loss", "pg_loss", "entropy", "clip_frac", "tis_weight_mean", "tis_clip_frac", "logprob_diff_rollout",
              "logprob_diff_rollout_max", "train_rollout_k3_kl", "grad_norm"):
        assert m_skip[k] == pytest.approx(m_pass[k], abs=1e-6), k
    for n in w_pass:
        torch.testing.assert_close(w_skip[n], w_pass[n], atol=1e-6, rtol=1e-5)
    # the weights are in the step: without TIS the same samples train to other weights
    _, w_plain = weights_after_one_rollout(trainer(model_path, skip_old_logprobs=True, **micro), samples)
    assert any((w_plain[n] - w_pass[n]).abs().max() > 1e-4 for n in w_pass)


def test_tis_keeps_the_pass_for_a_custom_function_and_for_two_steps(model_path, tmp_path):
    samples = off_policy(model_path)
    assert trainer(model_path, skip_old_logprobs=True, algorithm=TIS, global_batch_size=2).train(
        samples, 0)["logprob_passes"] == 1
    (tmp_path / "batch_tis.py").write_text("def normalised(train_lp, rollout_lp, mask):\n"
                                           "    w = (train_lp - rollout_lp).exp() * mask\n"
                                           "    return w / w.sum() * mask.sum()\n")
    custom = dataclasses.replace(TIS, custom_tis_function_path=f"{tmp_path / 'batch_tis.py'}:normalised")
    m = trainer(model_path, skip_old_logprobs=True, algorithm=custom).train(samples, 0)
    assert m["logprob_passes"] == 1 and m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_a_skipped_pass_still_reports_the_reference_diff_that_ci_test_reads(model_path):
    kl = AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", use_kl_loss=True, kl_loss_coef=0.1)
    m_pass = trainer(model_path, algorithm=kl).train(SAMPLES, 0)
    m_skip = trainer(model_path, skip_old_logprobs=True, algorithm=kl).train(SAMPLES, 0)
    assert m_pass["logprob_passes"] == 2.0 and m_skip["logprob_passes"] == 1.0     # the reference's pass stays
    # before the first step the reference is the initial policy: the diff is 0 either way
    assert m_skip["ref_logprob_diff_max"] == pytest.approx(m_pass["ref_logprob_diff_max"], abs=1e-6)
    assert m_skip["ref_logprob_diff_max"] < 1e-5


def test_offload_between_rollouts_leaves_training_unchanged(model_path):
    a, b = trainer(model_path), trainer(model_path)
    more = [sample([5, 6], [7, 8, 2], 1.0), sample([9], [4, 4], -1.0)]
    a.train(SAMPLES, 0)
    b.train(SAMPLES, 0)
    assert all(p.grad is None for p in a.model.parameters())            # dropped after each step
    held = a.offload()
    assert held == 2 * sum(p.numel() * 4 for p in a.model.parameters())   # AdamW's two moments
    assert a.onload() == 0          # the optimizer state stays on the host: each step streams it
    a.train(more, 1)
    b.train(more, 1)
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), n
    assert a.offload() == held      # still there, not moved again
    a.dispose()                     # and frees the host state


def test_trainer_compile_flag_compiles_each_decoder_layer_in_place(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.config.flags import parse_flags
    from miles.training.torch.forward import compile_decoder_layers

    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", str(model_path), "--prompt-data", str(data), "--rollout-batch-size", "1",
            "--num-rollout", "1", "--n-samples-per-prompt", "8"]
    assert parse_flags(base + ["--trainer-compile"])[0].train.compile_layers is True
    assert parse_flags(base + ["--no-trainer-compile"])[0].train.compile_layers is False
    assert parse_flags(base)[0].train.compile_layers is None        # auto: compiled with the torch trainer on CUDA
    model = AutoModelForCausalLM.from_pretrained(model_path)
    names = list(model.state_dict())
    assert compile_decoder_layers(model) == model.config.num_hidden_layers
    assert list(model.state_dict()) == names       # in place: weight names (checkpoints, weight sync) unchanged
    assert all(layer._compiled_call_impl is not None for layer in model.get_decoder().layers)
