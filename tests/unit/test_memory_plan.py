"""The memory-planned token budget (CUDA without --max-tokens-per-gpu) as pure functions: the
activation bytes per token bound what autograd really keeps, the budget follows the stated rule,
a device where nothing fits is refused by the flags that make room, and the cap splits a fixed
micro-batch without merging rows."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.training.batch import TrainBatch
from miles.training.torch.forward import hidden_forward, logits_forward
from miles.training.torch.memory_plan import (HEADROOM, activation_bytes_per_token, plan_token_budget, reserve_bytes)
from miles.training.torch.microbatch import plan_micro_batches


def saved_bytes_per_token(model, forward, tokens=(96, 192)) -> float:
    """Bytes autograd saves per token in a forward of `forward` (the slope between two lengths;
    parameters and autocast's weight copies are per step, not per token, and cancel out)."""
    sizes = []
    for t in tokens:
        ids = torch.randint(0, model.config.vocab_size, (1, t))
        zeros = torch.zeros(1, t)
        mask = torch.ones(1, t, dtype=torch.bool)
        mask[:, 0] = False
        mb = TrainBatch(tokens=ids, loss_mask=mask, advantages=zeros, token_rewards=zeros, rollout_logprobs=zeros,
                        attention_mask=torch.ones(1, t, dtype=torch.long), weight_version=0)
        seen, total = set(), [0]

        def pack(x):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                total[0] += x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            forward(model, mb, True, True)
        sizes.append(total[0])
    return (sizes[1] - sizes[0]) / (tokens[1] - tokens[0])


@pytest.mark.parametrize("dims", [(128, 384, 4, 2, 32), (128, 768, 2, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_bytes_per_token_bound_what_autograd_keeps(dims, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    h, inter, heads, kv, head_dim = dims
    cfg = Qwen3Config(hidden_size=h, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=head_dim, num_hidden_layers=2, vocab_size=512)
    model = Qwen3ForCausalLM(cfg)

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    e = torch.finfo(dtype).bits // 8
    for logits, forward in ((False, partial(hidden_forward, 1.0, autocast, dtype, 2048)),
                            (True, partial(logits_forward, 1.0, autocast))):
        measured = saved_bytes_per_token(model, forward)
        bound = activation_bytes_per_token(cfg, compute_bytes=e, recompute=False, logits=logits)
        assert measured <= bound < 1.35 * measured, (logits, measured, bound)
    assert activation_bytes_per_token(cfg, compute_bytes=e, recompute=True, logits=False) < \
        0.7 * activation_bytes_per_token(cfg, compute_bytes=e, recompute=False, logits=False)


def test_the_budget_is_the_stated_rule():
    gib = 2 ** 30
    assert plan_token_budget(10 * gib, 2 * gib, 100_000) == int(HEADROOM * 8 * gib / 100_000)
    # the first step still allocates gradients (4 B/param) and AdamW's moments (8 B/param); later ones do not
    first = reserve_bytes(params=10 ** 9, grads_allocated=False, optimizer_allocated=False, compute_bytes=2,
                          chunk_rows=2048, vocab=151_936)
    later = reserve_bytes(params=10 ** 9, grads_allocated=True, optimizer_allocated=True, compute_bytes=2,
                          chunk_rows=2048, vocab=151_936)
    assert first - later == 12 * 10 ** 9 and later == 2 * 10 ** 9 + 2048 * 151_936 * 16
    with pytest.raises(ValueError, match="--recompute-activations.*--offload-train"):
        plan_token_budget(10 * gib, 2 * gib, 100_000, min_tokens=10 ** 6)
    with pytest.raises(ValueError, match="only 0 fit"):
        plan_token_budget(gib, 2 * gib, 100_000)


def test_the_cap_splits_fixed_micro_batches_by_padded_size_without_merging():
    lengths = [30, 5, 5, 5, 20, 20, 3, 40]
    groups = plan_micro_batches(lengths, micro_batch_size=4, memory_tokens=60)
    fixed = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(any(set(g) <= set(f) for f in fixed) for g in groups)     # pieces of the fixed micro-batches
    assert all(len(g) * max(lengths[i] for i in g) <= 60 or len(g) == 1 for g in groups)
    assert plan_micro_batches(lengths, micro_batch_size=4) == fixed          # no cap: as before


def test_dynamic_batches_without_a_budget_are_refused_on_the_cpu_only(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", "examples/arithmetic/base_model", "--prompt-data", str(data),
            "--rollout-batch-size", "1", "--num-rollout", "1", "--n-samples-per-prompt", "2", "--use-dynamic-batch-size"]
    with pytest.raises(ConfigError, match="--max-tokens-per-gpu N on the CPU"):
        parse_flags(base + ["--device", "cpu"])
    assert parse_flags(base + ["--device", "cuda"])[0].train.max_tokens_per_gpu is None


QWEN3_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, tie_word_embeddings=False, max_position_embeddings=40960)
H200 = 141 * 2 ** 30
HOST = 128 * 2 ** 30          # the GPU machine's memory
BIG_HOST = 2 ** 40            # a host that holds any of these plans' moments: the GPU side alone


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """A GRPO run's config on one GPU, colocated with the fast engine, 2k-token answers, and an 8B
    model folder (config only: the check reads shapes, never weights)."""
    import json

    tmp = tmp_path_factory.mktemp("plan")
    (tmp / "p.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    (tmp / "qwen3-8b").mkdir()
    (tmp / "qwen3-8b" / "config.json").write_text(json.dumps(QWEN3_8B))

    def make(*flags, model=tmp / "qwen3-8b"):
        cfg = parse_flags(["--hf-checkpoint", "examples/arithmetic/base_model", "--prompt-data", str(tmp / "p.jsonl"),
                           "--rollout-batch-size", "1", "--num-rollout", "1", "--n-samples-per-prompt", "2",
                           "--device", "cuda", "--colocate", "--rollout-engine", "fast",
                           "--rollout-max-response-len", "2048", "--max-prompt-len", "128", *flags])[0]
        return replace(cfg, model=replace(cfg.model, hf_checkpoint=str(model)))
    return make


def test_a_plan_whose_step_cannot_fit_is_refused_at_start_up_naming_the_flags_that_make_room(gpu_run):
    from functools import partial

    from miles.training.torch.memory_plan import parameter_count, startup_problems

    from transformers import AutoConfig

    startup_problems = partial(startup_problems, host_bytes=BIG_HOST)     # the GPU side alone

    assert parameter_count(AutoConfig.from_pretrained(gpu_run().model.hf_checkpoint)) == pytest.approx(8.19e9, rel=0.01)
    # weights 4 + gradients 4 + moments 8 + bf16 copies 2 + the engine's bf16 weights 2 B/param: 18 x 8.19e9 > 141 GiB
    (problem,) = startup_problems(gpu_run("--recompute-activations"), 1, gpu_bytes=H200)
    assert "--offload-train" in problem and "--recompute-activations" not in problem and "141.0 GiB" in problem
    assert "optimizer 61.0" in problem and "engine weights 15.3" in problem
    # the moments streamed from host memory: 10 B/param + activations fit
    assert startup_problems(gpu_run("--recompute-activations", "--offload-train"), 1, gpu_bytes=H200) == []
    # 16k-token answers without recompute: every layer's activations of one sample no longer fit
    (long,) = startup_problems(gpu_run("--offload-train", "--rollout-max-response-len", "16384"), 1, gpu_bytes=H200)
    assert "--recompute-activations" in long and "--offload-train" not in long and "samples up to 16512 tokens" in long
    # a frozen KL reference is a whole float32 copy more (it still fits beside streamed moments)
    (kl,) = startup_problems(gpu_run("--recompute-activations", "--use-kl-loss"), 1, gpu_bytes=H200)
    assert "reference 30.5" in kl and "reference" not in problem
    assert startup_problems(gpu_run("--recompute-activations", "--offload-train", "--use-kl-loss"), 1,
                            gpu_bytes=H200) == []
    # two trainer GPUs shard the state
    assert startup_problems(gpu_run("--recompute-activations"), 2, gpu_bytes=H200) == []
    # PPO's critic is 16 B/param more, sharded like the policy: 9 + 8 + 2 engine B/param do not fit on 2
    # GPUs, 4.5 + 4 + 2 on 4 do
    ppo = gpu_run("--recompute-activations", "--advantage-estimator", "ppo")
    (critic,) = startup_problems(ppo, 1, gpu_bytes=H200)
    assert "critic 122.1" in critic and "--offload-train" not in critic and "--optimizer-cpu-offload" in critic
    # --optimizer-cpu-offload streams both optimizers' moments: 5 + 4 + 2 B/param fit on 2 GPUs
    assert startup_problems(gpu_run("--recompute-activations", "--advantage-estimator", "ppo", "--optimizer-cpu-offload"),
                            2, gpu_bytes=H200) == []
    assert startup_problems(gpu_run("--recompute-activations", "--optimizer-cpu-offload"), 1, gpu_bytes=H200) == []
    assert "critic 61.0" in startup_problems(ppo, 2, gpu_bytes=H200)[0]
    assert startup_problems(ppo, 4, gpu_bytes=H200) == []
    # --opd-type megatron: the trainer holds the teacher whole in float32 (4 B/param of the teacher's own
    # size): beside the 8B policy, its streamed moments and its KL reference (16 B/param with the engine's
    # weights, which fit above), an 8B teacher no longer fits
    fits = gpu_run("--recompute-activations", "--offload-train", "--use-kl-loss")
    opd = replace(fits, algorithm=replace(fits.algorithm, use_opd=True, opd_type="megatron",
                                          opd_teacher_load=fits.model.hf_checkpoint))
    (teacher,) = startup_problems(opd, 1, gpu_bytes=H200)
    assert "teacher 30.5" in teacher and "--opd-type sglang" in teacher and "teacher" not in problem
    assert startup_problems(opd, 1, gpu_bytes=2 * H200) == []
    # the teacher of --opd-type sglang scores on its servers: nothing in the trainer
    assert startup_problems(replace(opd, algorithm=replace(opd.algorithm, opd_type="sglang", opd_teacher_load=None)),
                            1, gpu_bytes=H200) == []
    # nothing to check: no GPUs known, a CPU run
    assert startup_problems(gpu_run(), None, gpu_bytes=H200) == []
    cpu = gpu_run()
    assert startup_problems(replace(cpu, model=replace(cpu.model, device="cpu")), 1, gpu_bytes=H200) == []


def test_moments_in_host_memory_that_the_host_cannot_hold_are_refused_at_start_up(gpu_run):
    """--offload-train / --optimizer-cpu-offload keep AdamW's moments (8 B/param) in host memory: a machine
    whose memory cannot hold them beside the rest is refused at start-up, not by the OOM killer in the
    first train step (the 8B model's moments are 61.0 GiB)."""
    from miles.training.torch.memory_plan import HOST_MOMENTS_SHARE, startup_problems

    offload = gpu_run("--recompute-activations", "--offload-train")
    assert startup_problems(offload, 1, gpu_bytes=H200, host_bytes=HOST) == []
    (problem,) = startup_problems(offload, 1, gpu_bytes=H200, host_bytes=64 * 2 ** 30)
    assert "--offload-train keeps AdamW's moments in host memory: about 61.0 GiB" in problem
    assert "this machine has 64.0 GiB" in problem and "--lora-rank" in problem
    # the bound is the share, not the whole: 61.0 GiB fit 77 GiB at 80% (61.6), not 76 (60.8)
    assert HOST_MOMENTS_SHARE == 0.8
    assert startup_problems(offload, 1, gpu_bytes=H200, host_bytes=77 * 2 ** 30) == []
    assert startup_problems(offload, 1, gpu_bytes=H200, host_bytes=76 * 2 ** 30) != []
    # PPO with --optimizer-cpu-offload: the critic's moments too
    ppo = gpu_run("--recompute-activations", "--advantage-estimator", "ppo", "--optimizer-cpu-offload")
    (both,) = startup_problems(ppo, 2, gpu_bytes=H200, host_bytes=HOST)
    assert "--optimizer-cpu-offload keeps" in both and "about 122.1 GiB" in both and "policy and critic" in both
    # moments on the GPU, LoRA's adapters, or a cluster elsewhere (--ray-address): nothing to check here
    assert startup_problems(gpu_run("--recompute-activations"), 2, gpu_bytes=H200, host_bytes=2 ** 30) == []
    lora = gpu_run("--recompute-activations", "--offload-train", "--lora-rank", "8")
    assert startup_problems(lora, 1, gpu_bytes=H200, host_bytes=2 ** 30) == []
    remote = replace(offload, cluster=replace(offload.cluster, ray_address="10.0.0.1:6379"))
    assert startup_problems(remote, 1, gpu_bytes=H200, host_bytes=2 ** 30) == []
    # both problems at once: the GPU's step and the host's moments
    assert len(startup_problems(gpu_run("--offload-train", "--rollout-max-response-len", "16384"), 1,
                                gpu_bytes=H200, host_bytes=2 ** 30)) == 2


def test_validate_runs_the_start_up_check_with_this_machines_gpu_memory(tmp_path, monkeypatch):
    import miles.training.torch.memory_plan as plan

    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    flags = ["--hf-checkpoint", "examples/arithmetic/base_model", "--prompt-data", str(data), "--rollout-batch-size",
             "1", "--num-rollout", "1", "--n-samples-per-prompt", "2", "--device", "cuda"]
    monkeypatch.setattr(plan, "gpu_memory_bytes", lambda: 2 ** 29)          # half a GiB: not even a CUDA context
    with pytest.raises(ConfigError, match=r"step needs about 1\.0 GiB .* a GPU here has 0\.5 GiB"):
        parse_flags(flags)
    monkeypatch.setattr(plan, "gpu_memory_bytes", lambda: 80 * 2 ** 30)
    assert parse_flags(flags)[0].model.device == "cuda"


def test_the_plan_counts_the_weights_of_the_engine_that_runs_not_the_one_asked(gpu_run):
    """The default `embedded` is FastEngine on a GPU for the models FastEngine implements (init's swap); its
    weights stay on the GPU while a colocated trainer trains, so the plan counts them as for `fast` asked
    outright (the bug: it asked whether the *asked* engine was "fast" and counted none)."""
    from miles.rollout.engines.registry import ENGINES, engine_to_run
    from miles.training.torch.memory_plan import startup_problems

    embedded = gpu_run("--recompute-activations", "--rollout-engine", "embedded")
    assert embedded.rollout.engine == "embedded" and engine_to_run(embedded, on_gpus=True) == ("fast", None)
    assert ENGINES["fast"].weights_on_release == "kept"
    (problem,) = startup_problems(embedded, 1, gpu_bytes=H200, host_bytes=BIG_HOST)
    assert "engine weights 15.3" in problem and "--rollout-engine sglang (it releases its weights" in problem
    assert problem == startup_problems(gpu_run("--recompute-activations"), 1, gpu_bytes=H200, host_bytes=BIG_HOST)[0]
    # an engine that drops its weights while the trainer trains adds none (the moments still do not fit)
    (sglang,) = startup_problems(gpu_run("--recompute-activations", "--rollout-engine", "sglang"), 1, gpu_bytes=H200, host_bytes=BIG_HOST)
    assert "engine weights" not in sglang and "--rollout-engine sglang" not in sglang


def test_a_resident_engine_on_the_trainers_gpu_counts_its_kv_cache_share_and_the_plan_names_the_fraction(gpu_run):
    """--colocate --no-offload-rollout (the async machines' one-GPU layout): the fast engine keeps its KV
    cache while the trainer trains, --rollout-mem-fraction of the GPU less its weights, plus its workspace
    (`shared_gpu_bytes`); the plan counts it, and a plan that does not fit names the fraction."""
    from miles.rollout.engines.fast.cache import shared_held_bytes, shared_plan_bytes
    from miles.rollout.engines.registry import ENGINES
    from miles.training.torch.memory_plan import startup_problems

    gib, weights = 2 ** 30, 2 * 8.19e9
    assert shared_plan_bytes(100, 30) == 70 and shared_plan_bytes(10, 30) == 0
    assert shared_held_bytes(total_bytes=100, weight_bytes=30, mem_fraction=0.5, workspace=5) == 35 + 5
    resident = ("--no-offload-rollout", "--recompute-activations", "--optimizer-cpu-offload")
    # the engine is told, so that it plans its cache from the GPU's total, not from what is free at its start
    assert ENGINES["fast"].options(gpu_run(*resident))["shared_gpu"] is True
    assert "shared_gpu" not in ENGINES["fast"].options(gpu_run())
    (problem,) = startup_problems(gpu_run(*resident), 1, gpu_bytes=H200, host_bytes=BIG_HOST)
    # 0.5 x (141 GiB - 15.3 GiB of engine weights) = 62.9 GiB of KV cache, and ~2.3 GiB of workspace
    cache = float(problem.split("engine cache ")[1].split(",")[0])
    assert 0.5 * (H200 - weights) / gib < cache < 0.5 * (H200 - weights) / gib + 3
    assert "engine weights 15.3" in problem and "--rollout-mem-fraction" in problem
    assert "--offload-train" not in problem          # the async machines refuse it; the moments' flag is named
    # the same run handing the cache back and forth (sync's --colocate) counts none of it
    assert startup_problems(gpu_run("--recompute-activations", "--optimizer-cpu-offload"), 1, gpu_bytes=H200, host_bytes=BIG_HOST) == []
    # a smaller share of the GPU for the engine leaves the trainer room
    assert startup_problems(gpu_run(*resident, "--rollout-mem-fraction", "0.2"), 1, gpu_bytes=H200, host_bytes=BIG_HOST) == []
    # and more decode rows need more workspace (logits for each row over the 152k vocabulary)
    (wide,) = startup_problems(gpu_run(*resident, "--rollout-max-batch-size", "1024"), 1, gpu_bytes=H200, host_bytes=BIG_HOST)
    assert float(wide.split("engine cache ")[1].split(",")[0]) > cache + 1
