"""Bad input for --train-backend megatron is one clear error each, found by validate (before any
actor starts): megatron-core missing, an unsupported architecture, TP that does not divide the
heads or the key/value heads, sizes that do not make a layout, and parallel flags on a backend that
does not split models."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.training.megatron import checks
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_checks")
    model = make_tiny_model(root / "model")           # Qwen2: 2 attention heads, 1 key/value head, 2 layers
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    return root, model, str(data)


def problems_of(task, *flags: str) -> list[str]:
    _, model, data = task
    argv = ["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "2", "--num-rollout", "1", "--train-backend", "megatron", *flags]
    with pytest.raises(ConfigError) as err:
        parse_flags(argv)
    return err.value.problems


@pytest.fixture
def megatron_installed(monkeypatch):
    """The checks as they run where megatron-core is installed (the other checks need no import of it)."""
    real = checks.installed
    monkeypatch.setattr(checks, "installed", lambda m: True if m == "megatron.core" else real(m))


def test_missing_megatron_core_is_named_with_the_install_command(task, monkeypatch):
    monkeypatch.setattr(checks, "installed", lambda m: False)
    problems = problems_of(task)
    assert problems == ["--train-backend megatron needs megatron-core, which is not installed: "
                        "pip install -e '.[megatron]' in a miles checkout (pip install 'miles[megatron]' otherwise)"]


def test_tp_that_does_not_divide_the_key_value_heads(task, megatron_installed):
    problems = problems_of(task, "--tensor-model-parallel-size", "2")
    assert problems == ["--tensor-model-parallel-size 2 does not divide the model's num_key_value_heads 1; "
                        "use a TP size that divides it"]


def test_unsupported_architecture(task, megatron_installed, tmp_path):
    root, model, data = task
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    argv = ["--hf-checkpoint", str(gpt2), "--prompt-data", data, "--rollout-batch-size", "2", "--num-rollout", "1", "--n-samples-per-prompt", "8",
            "--train-backend", "megatron"]
    with pytest.raises(ConfigError) as err:
        parse_flags(argv)
    assert err.value.problems == ["architecture ['GPT2LMHeadModel'] is not supported by --train-backend megatron; "
                                  "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM (or use "
                                  "--train-backend torch)"]


def test_layout_problems_come_together(task, megatron_installed):
    problems = problems_of(task, "--pipeline-model-parallel-size", "3", "--sequence-parallel")
    assert any("--sequence-parallel needs --tensor-model-parallel-size > 1" in p for p in problems)
    assert any("--pipeline-model-parallel-size 3 does not divide the model's 2 layers" in p for p in problems)


def test_sequence_parallel_needs_fused_norms(task, monkeypatch):
    monkeypatch.setattr(checks, "installed", lambda m: m == "megatron.core")      # neither TE nor Apex
    problems = problems_of(task, "--sequence-parallel")
    assert "--sequence-parallel needs --tensor-model-parallel-size > 1" in problems[0]
    assert problems[1].startswith("--sequence-parallel needs Transformer Engine's or Apex's norms")


def test_context_parallel_is_accepted_and_counts_in_the_ranks(task, megatron_installed):
    _, model, data = task
    base = ["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "2", "--num-rollout", "1", "--train-backend", "megatron", "--context-parallel-size", "2"]
    cfg, _ = parse_flags(base)                       # on the CPU: TP x PP x CP = 2 ranks
    assert cfg.train.context_parallel_size == 2 and checks.run_problems(cfg) == []
    # on GPUs, 3 trainer GPUs do not hold CP 2; 4 do (data parallel 2)
    problems = problems_of(task, "--context-parallel-size", "2", "--device", "cuda", "--actor-num-gpus-per-node", "3")
    assert problems == ["the trainer's 3 GPU(s) are not a multiple of TP 1 x PP 1 x CP 2 = 2; give it a multiple of "
                        "that many GPUs (--actor-num-nodes x --actor-num-gpus-per-node) or lower the sizes"]
    cuda, _ = parse_flags([*base, "--device", "cuda", "--actor-num-gpus-per-node", "4"])
    assert checks.run_problems(cuda, 4) == []


def test_parallel_flags_on_the_torch_backend(task):
    _, model, data = task
    argv = ["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "2", "--num-rollout", "1", "--n-samples-per-prompt", "8",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--decoder-first-pipeline-num-layers", "1"]
    with pytest.raises(ConfigError) as err:
        parse_flags(argv)
    assert err.value.problems == ["--tensor-model-parallel-size 2, --sequence-parallel, --decoder-first-pipeline-num-"
                                  "layers 1: --train-backend torch does not split models; drop them or use "
                                  "--train-backend megatron"]


def test_ppo_needs_a_critic_the_megatron_backend_lacks(task, megatron_installed):
    problems = problems_of(task, "--advantage-estimator", "ppo")
    assert any("--train-backend megatron has no critic" in p for p in problems)


def test_a_fitting_run_passes(task, megatron_installed):
    _, model, data = task
    cfg, _ = parse_flags(["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "2",
                          "--num-rollout", "1", "--n-samples-per-prompt", "8", "--train-backend", "megatron"])
    assert cfg.train.backend == "megatron" and cfg.train.tensor_model_parallel_size == 1


def test_the_torch_trainers_memory_flags_it_lacks_are_refused_by_name(task, megatron_installed):
    problems = problems_of(task, "--offload-train", "--update-weight-buffer-size", "1024", "--use-dynamic-batch-size",
                           "--max-tokens-per-gpu", "64")
    flags = [p.split(":")[0] for p in problems]
    assert flags == ["--offload-train", "--update-weight-buffer-size", "--use-dynamic-batch-size",
                     "--max-tokens-per-gpu"], problems
    assert all("not supported by --train-backend megatron yet" in p and p.endswith("use --train-backend torch")
               for p in problems)
    assert problems_of(task, "--offload")[0].startswith("--offload: not supported by --train-backend megatron yet")


def test_the_decoupled_rate_is_refused_and_the_weight_decay_schedule_taken(task, megatron_installed):
    problems = problems_of(task, "--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
                           "--end-weight-decay", "0.1", "--decoupled-lr", "1e-6")
    assert [p.split(":")[0] for p in problems] == ["--decoupled-lr"], problems
    assert "embedding and output layer" in problems[0]


def test_colocation_activation_recompute_and_engine_offload_are_accepted(task, megatron_installed):
    _, model, data = task
    cfg, _ = parse_flags(["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "2",
                          "--num-rollout", "1", "--n-samples-per-prompt", "8", "--train-backend", "megatron", "--colocate", "--offload-rollout",
                          "--recompute-activations"])
    assert cfg.cluster.colocate and cfg.train.recompute_activations


def test_on_cuda_the_ranks_are_the_trainers_gpus(task, megatron_installed):
    # 3 trainer GPUs cannot hold pipelines of 2 stages; 4 can (data parallel 2 over the 4 samples)
    problems = problems_of(task, "--device", "cuda", "--actor-num-gpus-per-node", "3",
                           "--pipeline-model-parallel-size", "2")
    assert problems == ["the trainer's 3 GPU(s) are not a multiple of TP 1 x PP 2 x CP 1 = 2; give it a multiple of "
                        "that many GPUs (--actor-num-nodes x --actor-num-gpus-per-node) or lower the sizes"]
    _, model, data = task
    cfg, _ = parse_flags(["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "2",
                          "--n-samples-per-prompt", "2", "--num-rollout", "1", "--train-backend", "megatron",
                          "--device", "cuda", "--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "2"])
    assert checks.run_problems(cfg, 4) == [] and checks.run_problems(cfg, 6) != []
