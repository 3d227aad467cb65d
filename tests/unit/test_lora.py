"""LoRA (miles/training/torch/lora.py and the torch trainer under --lora-rank): the module, the target selection,
the merged weights the engines get, PEFT's file layout, checkpoints, and the flags' checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from miles.config import AlgorithmConfig, ConfigError, RolloutConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.training.torch import lora
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from miles.weights.checksum import state_dict_checksum
from miles.weights.hf import load_causal_lm, model_weights
from tests.tiny_model import make_tiny_model
from tests.unit.test_tracking_flags import base
from tests.unit.test_trainer import SAMPLES

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def base_model(path):
    return load_causal_lm(path, device=CPU, dtype=torch.float32)


def lora_trainer(path, **kw) -> Trainer:
    algo = {k: kw.pop(k) for k in list(kw) if k in AlgorithmConfig.__dataclass_fields__}
    train = TrainConfig(**{"lr": 1e-2, "lora_rank": 4, "lora_alpha": 8.0, **kw})
    return Trainer(path, train=train, algorithm=AlgorithmConfig(**{"loss_agg_mode": "token_mean", **algo}),
                   rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=4), device="cpu")


IDS = torch.tensor([[5, 6, 14, 7, 8, 9], [7, 21, 22, 9, 4, 4]])


# --- the module --------------------------------------------------------------------------------------
def test_zero_b_gives_the_base_outputs_and_only_adapters_train(model_path):
    model = base_model(model_path)
    before = model(input_ids=IDS).logits
    adapted = lora.attach(model, lora.LoraSpec(rank=4, alpha=8.0))
    assert torch.equal(model(input_ids=IDS).logits, before)          # B = 0: bit for bit the base
    assert all(torch.count_nonzero(m.lora_A.weight) > 0 for m in adapted.values())   # A drawn, not zero
    model(input_ids=IDS).logits.sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert with_grad <= trainable and trainable == {f"{n}.lora_{x}.weight" for n in adapted for x in "AB"}
    # B = 0 at the start: only B's gradient is non-zero (A's goes through B)
    assert all(m.lora_B.weight.grad.abs().sum() > 0 for m in adapted.values())


def test_the_merged_weight_gives_the_adapted_forward(model_path):
    model = base_model(model_path)
    torch.manual_seed(0)                                      # A's draw too: the same case every run
    adapted = lora.attach(model, lora.LoraSpec(rank=2, alpha=3.0))
    with torch.no_grad():
        for m in adapted.values():
            m.lora_B.weight.normal_(0, 0.3)
    adapted_logits = model(input_ids=IDS).logits
    plain = base_model(model_path)
    merged = lora.MergedWeights(model_weights(model), adapted)
    assert set(merged) == set(model_weights(plain))           # the base's names, no adapter key
    name = "model.layers.0.self_attn.q_proj"
    m = adapted[name]
    # W + (alpha / r) B A, by hand
    expected = m.weight + 1.5 * m.lora_B.weight @ m.lora_A.weight
    torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    plain.load_state_dict({k: merged[k] for k in merged}, strict=False)
    # float32 sums in another order (W' x against W x + B (A x)): 2e-5 was seen on an unseeded A
    torch.testing.assert_close(plain(input_ids=IDS).logits, adapted_logits, rtol=1e-4, atol=1e-4)
    with lora.adapters_off(adapted):                            # the reference: the base again
        assert torch.equal(model(input_ids=IDS).logits, base_model(model_path)(input_ids=IDS).logits)
    torch.testing.assert_close(model(input_ids=IDS).logits, adapted_logits, rtol=0, atol=0)   # back on


@pytest.mark.parametrize("targets, exclude, expected", [
    ((), (), {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),    # all-linear
    (("all-linear",), (), {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    (("q_proj", "v_proj"), (), {"q_proj", "v_proj"}),
    (("attn",), ("o_proj",), {"q_proj", "k_proj", "v_proj"}),
    (("mlp",), (), {"gate_proj", "up_proj", "down_proj"}),
    (("self_attn.o_proj",), (), {"o_proj"}),
])
def test_target_selection(model_path, targets, exclude, expected):
    names = lora.select_targets(base_model(model_path), lora.LoraSpec(rank=2, targets=targets, exclude=exclude))
    assert {n.rsplit(".", 1)[-1] for n in names} == expected
    assert len(names) == 2 * len(expected)                      # each of the 2 layers
    assert "lm_head" not in " ".join(names) and all(n.startswith("model.layers.") for n in names)


def test_a_pattern_selects_one_layer_and_a_bad_entry_is_named(model_path):
    names = lora.select_targets(base_model(model_path), lora.LoraSpec(rank=2, targets=("model.layers.1.*",)))
    assert names and all(n.startswith("model.layers.1.") for n in names)
    with pytest.raises(ValueError, match="--target-modules c_attn matches no Linear.*q_proj"):
        lora.select_targets(base_model(model_path), lora.LoraSpec(rank=2, targets=("c_attn",)))
    with pytest.raises(ValueError, match="leaves no module"):
        lora.select_targets(base_model(model_path), lora.LoraSpec(rank=2, targets=("q_proj",), exclude=("q_proj",)))


# --- the trainer -------------------------------------------------------------------------------------
def test_the_trainer_trains_adapters_and_engines_get_merged_weights(model_path):
    t = lora_trainer(model_path, target_modules="q_proj,v_proj,down_proj")
    base = {n: w.clone() for n, w in model_weights(base_model(model_path)).items()}
    assert t.weights_checksum() == state_dict_checksum(base)          # step 0: the base model
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    assert sum(len(g["params"]) for g in t._optimizer.param_groups) == 2 * 3 * 2    # A and B of 6 modules
    for r in range(2):
        t.train(SAMPLES, rollout_id=r)
    live = dict(t.model.named_parameters())
    assert all(torch.equal(live[n], w) for n, w in frozen.items())    # the base, bit for bit
    weights = t.weights()
    assert set(weights) == set(base)
    changed = {n for n in base if not torch.equal(weights[n], base[n])}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(2)
                       for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    for dtype in (None, torch.bfloat16):     # what an engine of either dtype holds after loading `weights`
        assert t.weights_checksum(dtype) == state_dict_checksum(weights, dtype=dtype)


def test_the_reference_is_the_base_model_with_adapters_off(model_path):
    t = lora_trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1)
    assert t._ref is t.model                                   # no second copy of the model
    t.train(SAMPLES, rollout_id=0)
    batch = t.prepare(make_train_batch(SAMPLES, t.pad_id))
    base = lora_trainer(model_path)                            # a fresh one: B = 0, the base model
    expected = base.prepare(make_train_batch(SAMPLES, base.pad_id)).old_logprobs
    torch.testing.assert_close(batch.ref_logprobs, expected, rtol=0, atol=0)
    assert not torch.equal(batch.old_logprobs, batch.ref_logprobs)   # the policy moved


def test_save_load_continues_bit_identically_and_refuses_another_lora(model_path, tmp_path):
    a = lora_trainer(model_path, lora_dropout=0.1)
    a.train(SAMPLES, rollout_id=0)
    a.save(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"]
    saved = load_file(str(tmp_path / "ck" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved
    assert all(".lora_" in k for k in saved)                   # the adapters alone, not the frozen base
    a.train(SAMPLES, rollout_id=1)
    b = lora_trainer(model_path, lora_dropout=0.1)
    b.load(tmp_path / "ck")
    b.train(SAMPLES, rollout_id=1)
    assert b.num_steps == a.num_steps == 2
    assert b.weights_checksum() == a.weights_checksum()        # dropout masks and AdamW's moments included
    with pytest.raises(ValueError, match="--lora-rank 8 but the checkpoint .* has 4"):
        lora_trainer(model_path, lora_rank=8, lora_dropout=0.1).load(tmp_path / "ck")
    with pytest.raises(ValueError, match="select other modules"):
        lora_trainer(model_path, lora_dropout=0.1, target_modules="q_proj").load(tmp_path / "ck")
    with pytest.raises(ValueError, match="holds LoRA adapters.*--lora-rank 4"):
        Trainer(model_path, train=TrainConfig(), algorithm=AlgorithmConfig(), rollout=RolloutConfig(batch_size=1),
                device="cpu").load(tmp_path / "ck")


def test_export_hf_writes_the_merged_model_and_a_peft_adapter(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    t = lora_trainer(model_path, target_modules="q_proj,v_proj")
    t.train(SAMPLES, rollout_id=0)
    t.export_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert state_dict_checksum(model_weights(model)) == t.weights_checksum()
    assert not (tmp_path / "hf" / "adapter_config.json").exists()     # a plain HF folder
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == model_path
    adapter = load_file(str(tmp_path / "hf" / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 2
    assert adapter["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (16, 4)
    # --lora-adapter-path: a trainer starting from the exported adapter holds the same merged model
    again = lora_trainer(model_path, target_modules="q_proj,v_proj", lora_adapter_path=str(tmp_path / "hf" / "adapter"))
    assert again.weights_checksum() == t.weights_checksum()
    with pytest.raises(ValueError, match="--lora-alpha 2.0 but --lora-adapter-path .* has 8.0"):
        lora_trainer(model_path, target_modules="q_proj,v_proj", lora_alpha=2.0,
                     lora_adapter_path=str(tmp_path / "hf" / "adapter"))


# --- the flags ---------------------------------------------------------------------------------------
def flags(tmp_path, *extra: str) -> list[str]:
    return [*base(tmp_path), *extra]


def test_the_lora_flags_parse_with_miles_names(tmp_path):
    cfg, _ = parse_flags(flags(tmp_path, "--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.05",
                               "--target-modules", "q_proj,k_proj,v_proj,o_proj", "--exclude-modules", "k_proj"))
    t = cfg.train
    assert (t.lora_rank, t.lora_alpha, t.lora_dropout) == (16, 32.0, 0.05)
    assert lora.LoraSpec.from_train(t) == lora.LoraSpec(rank=16, alpha=32.0, dropout=0.05,
                                                        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                                                        exclude=("k_proj",))
    assert lora.LoraSpec.from_train(parse_flags(flags(tmp_path))[0].train) is None      # default: off


@pytest.mark.parametrize("extra, message", [
    (["--lora-rank", "8", "--train-backend", "megatron"], "--lora-rank 8 with --train-backend megatron"),
    (["--lora-rank", "8", "--actor-num-gpus-per-node", "2"], "--lora-rank 8 with --train-backend torch on 2 trainer ranks"),
    (["--lora-rank", "8", "--trainer-weight-shadows"], "--lora-rank 8 with --trainer-weight-shadows"),
    (["--lora-rank", "8", "--advantage-estimator", "ppo"], "--lora-rank 8 with --advantage-estimator ppo"),
    (["--lora-rank", "8", "--decoupled-lr", "1e-5"], "--lora-rank 8 with --decoupled-lr"),
    (["--target-modules", "q_proj"], "--target-modules q_proj: LoRA is off without --lora-rank"),
    (["--lora-rank", "8", "--lora-dropout", "1.5"], "--lora-dropout 1.5: must be in"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha 0.0: must be > 0"),
    (["--lora-rank", "8", "--target-modules", "attn,unembed"], "--target-modules unembed"),
    (["--lora-rank", "8", "--lora-adapter-path", "/nonexistent"], "lacks adapter_config.json"),
])
def test_what_lora_cannot_take_is_refused_at_parse_time(tmp_path, extra, message):
    with pytest.raises(ConfigError) as info:
        parse_flags(flags(tmp_path, *extra))
    assert any(message in p for p in info.value.problems), info.value.problems


def test_miles_lora_options_not_taken_are_refused_with_the_ones_that_are(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_flags(flags(tmp_path, "--lora-rank", "8", "--lora-type", "canonical_lora"))
    (line,) = [p for p in info.value.problems if "--lora-type" in p]
    assert "canonical_lora" in line and "drop it" in line        # the HF projections are split already
    for option in ("--lora-sync-from-tensor", "--lora-base-cpu-backup", "--lora-train-only"):
        with pytest.raises(ConfigError) as info:
            parse_flags(flags(tmp_path, "--lora-rank", "8", option))
        (line,) = [p for p in info.value.problems if option in p]
        assert "merged weights" in line or "not supported yet" in line, line


def test_the_memory_plan_counts_no_gradients_moments_or_reference_copy_under_lora(tmp_path, model_path):
    from miles.training.torch.memory_plan import startup_problems

    def need(*extra: str) -> str:
        cfg, _ = parse_flags(flags(tmp_path, "--hf-checkpoint", model_path, "--device", "cuda", "--use-kl-loss", *extra))
        (problem,) = startup_problems(cfg, 1, gpu_bytes=1)      # a 1-byte GPU: refused, its parts listed
        return problem.split(" GiB; a ")[0]

    full, adapters = need(), need("--lora-rank", "8")
    assert "gradients" in full and "optimizer" in full and "reference" in full
    assert "gradients" not in adapters and "optimizer" not in adapters and "reference" not in adapters


def test_ref_update_interval_keeps_a_plain_copy_refreshed_with_the_merged_weights(model_path):
    t = lora_trainer(model_path, use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=1)
    assert t._ref is not t.model and not any(p.requires_grad for p in t._ref.parameters())
    t.train(SAMPLES, rollout_id=0)                               # refreshes the reference after it
    assert state_dict_checksum(model_weights(t._ref)) == t.weights_checksum()
