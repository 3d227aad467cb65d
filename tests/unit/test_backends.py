"""The backend seam: registries name classes that implement their protocols, the flags offer exactly
the registries' names, and the composition root picks what the config names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from miles.config import ConfigError, DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.config.flags import BY_DEST
from miles.config.validate import validate
from miles.phases.init import pick_backends
from miles.rollout.engines.registry import ENGINES
from miles.rollout.protocol import Engine, EngineSpec
from miles.runtime.machine import import_object
from miles.training.protocol import TRAIN_BACKENDS, CriticBackend, TrainBackendSpec, TrainerBackend
from tests.tiny_model import make_tiny_model


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")}


def test_every_registered_class_implements_its_protocol():
    assert members(Engine) >= {"generate", "update_weights", "weights_checksum", "weights_dtype", "dispose"}
    for name, spec in ENGINES.items():
        cls = import_object(spec.engine)
        assert not members(Engine) - set(dir(cls)), (name, members(Engine) - set(dir(cls)))
        assert all(issubclass(cls, c) for c in spec.capabilities), name
    for name, spec in TRAIN_BACKENDS.items():
        trainer = import_object(spec.trainer)
        assert not members(TrainerBackend) - set(dir(trainer)), (name, members(TrainerBackend) - set(dir(trainer)))
        assert all(issubclass(trainer, c) for c in spec.capabilities), name
        if spec.critic:
            critic = import_object(spec.critic)
            assert not members(CriticBackend) - set(dir(critic)), (name, members(CriticBackend) - set(dir(critic)))


def test_flag_choices_are_the_registries():
    assert BY_DEST["rollout_engine"].choices == tuple(ENGINES)       # the registries assert it at import too
    assert BY_DEST["train_backend"].choices == tuple(TRAIN_BACKENDS)


class FakeEngine:                       # a backend a later issue would add: one registry entry
    pass


class FakeTrainer:
    pass


def cfg_with(**rollout_and_train) -> RunConfig:
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p.jsonl"),
                    rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=2), num_rollout=1)
    return replace(cfg, rollout=replace(cfg.rollout, engine=rollout_and_train.get("engine", "embedded")),
                   train=replace(cfg.train, backend=rollout_and_train.get("backend", "torch")))


def test_pick_backends_reads_both_flags(monkeypatch):
    monkeypatch.setitem(ENGINES, "fake", EngineSpec(engine=f"{__name__}:FakeEngine", options=lambda cfg: {}))
    monkeypatch.setitem(TRAIN_BACKENDS, "fake", TrainBackendSpec(trainer=f"{__name__}:FakeTrainer"))
    picked = pick_backends(cfg_with(engine="fake", backend="fake"))
    assert picked.engine is FakeEngine and picked.trainer is FakeTrainer and picked.critic is None
    default = pick_backends(cfg_with())
    assert default.engine.__name__ == "EmbeddedEngine" and default.trainer.__name__ == "Trainer"


def test_ppo_picks_the_backends_critic():
    cfg = cfg_with()
    cfg = replace(cfg, algorithm=replace(cfg.algorithm, advantage_estimator="ppo"))
    assert pick_backends(cfg).critic.__name__ == "Critic"


def test_validate_names_unknown_backends_and_a_missing_critic(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "model")
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    cfg = replace(cfg_with(engine="vllm", backend="jax"), model=ModelConfig(hf_checkpoint=str(model)),
                  data=DataConfig(rollout_shuffle=True, prompt_data=str(data), label_key="label"))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "--rollout-engine vllm: no such engine; use one of embedded" in str(err.value)
    assert "--train-backend jax: no such backend; use one of torch" in str(err.value)
    monkeypatch.setitem(TRAIN_BACKENDS, "nocritic", TrainBackendSpec(trainer=f"{__name__}:FakeTrainer"))
    cfg = replace(cfg, rollout=replace(cfg.rollout, engine="embedded"), train=replace(cfg.train, backend="nocritic"),
                  algorithm=replace(cfg.algorithm, advantage_estimator="ppo"))
    with pytest.raises(ConfigError, match="--train-backend nocritic has no critic"):
        validate(cfg)


# --- which engine a run gets, and its options ------------------------------------------------------

def engine_cfg(model: str, **rollout) -> RunConfig:
    device = rollout.pop("device", "cpu")
    cfg = cfg_with()
    return replace(cfg, model=ModelConfig(hf_checkpoint=model, device=device), rollout=replace(cfg.rollout, **rollout))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32)).save_pretrained(gpt2)
    return {"qwen2": make_tiny_model(tmp_path_factory.mktemp("qwen2")), "gpt2": str(gpt2)}


def test_embedded_on_cpu_stays_the_transformers_engine_with_its_options(models):
    picked = pick_backends(engine_cfg(models["qwen2"]))
    assert picked.engine.__name__ == "EmbeddedEngine" and picked.engine_name == "embedded"
    assert picked.engine_options == {} and picked.fast_path_refused is None      # as before: nothing changes
    picked = pick_backends(engine_cfg(models["qwen2"], max_batch_size=16, mem_fraction=0.3, cuda_graph=False))
    assert picked.engine_options == {"max_batch_size": 16}                        # what EmbeddedEngine reads


def test_embedded_on_cuda_is_the_fast_engine_for_models_it_implements(models):
    # --device cuda is read as written (the driver needs no GPU to pick): selection runs on CPU here
    picked = pick_backends(engine_cfg(models["qwen2"], device="cuda"))
    assert picked.engine.__name__ == "FastEngine" and picked.engine_name == "fast"
    assert picked.engine_options == dict(cuda_graph=True, torch_compile=True, attention_kernel=True)   # its defaults
    picked = pick_backends(engine_cfg(models["qwen2"], device="cuda:1", max_batch_size=512, mem_fraction=0.8,
                                      cuda_graph=False, torch_compile=False, attention_kernel=False))
    assert picked.engine_options == dict(max_batch_size=512, mem_fraction=0.8, cuda_graph=False,
                                         torch_compile=False, attention_kernel=False)
    refused = pick_backends(engine_cfg(models["gpt2"], device="cuda"))
    assert refused.engine.__name__ == "EmbeddedEngine" and refused.engine_options == {}
    assert "model_type 'gpt2' is not implemented" in refused.fast_path_refused


def test_device_auto_follows_the_clusters_gpus(models):
    # the one rule of ModelConfig.uses_gpus: --device auto is on GPUs when the run's cluster has some
    assert pick_backends(engine_cfg(models["qwen2"], device="auto")).engine_name == "embedded"
    assert pick_backends(engine_cfg(models["qwen2"], device="auto"), cluster_gpus=2).engine_name == "fast"
    assert pick_backends(engine_cfg(models["qwen2"], device="cpu"), cluster_gpus=2).engine_name == "embedded"


def test_rollout_engine_fast_runs_anywhere_but_validate_refuses_models_it_does_not_implement(models):
    picked = pick_backends(engine_cfg(models["qwen2"], engine="fast"))              # CPU: eager, as CI runs it
    assert picked.engine.__name__ == "FastEngine" and "mem_fraction" not in picked.engine_options   # the engine's
    with pytest.raises(ConfigError, match=r"--rollout-engine fast cannot run --hf-checkpoint .*gpt2.*: "
                                          r"model_type 'gpt2' is not implemented.*use --rollout-engine embedded"):
        validate(engine_cfg(models["gpt2"], engine="fast", device="cuda"))


def test_engine_defaults_live_on_the_engine_spec_and_the_help_quotes_them():
    import inspect

    from miles.config.flags import FLAGS, help_line
    from miles.rollout.engines.embedded.engine import EmbeddedEngine
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.rollout.engines.registry import ENGINES

    fast, embedded = (inspect.signature(c).parameters for c in (FastEngine, EmbeddedEngine))
    for name, params in (("fast", fast), ("embedded", embedded)):
        assert ENGINES[name].defaults and all(params[k].default == v for k, v in ENGINES[name].defaults.items())
    assert ENGINES["fast"].defaults["max_batch_size"] == 256 and ENGINES["embedded"].defaults["max_batch_size"] == 64
    assert RolloutConfig(n_samples_per_prompt=8, batch_size=1).mem_fraction is None     # the engine's default
    helps = {f.name: help_line(f) for f in FLAGS}
    assert "(default: 256 for FastEngine, 64 for EmbeddedEngine)" in helps["rollout-max-batch-size"]
    assert "(default: 0.5)" in helps["rollout-mem-fraction"]
    assert "default: 8192)" in helps["rollout-chunked-prefill-size"]


def test_engine_flags_parse_and_bad_values_are_reported_together(tmp_path):
    from miles.config.flags import parse_flags

    model = make_tiny_model(tmp_path / "model")
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", model, "--prompt-data", str(data), "--rollout-batch-size", "1", "--num-rollout", "1",
            "--n-samples-per-prompt", "2"]
    cfg, _ = parse_flags(base + ["--rollout-engine", "fast", "--rollout-max-batch-size", "128",
                                 "--rollout-mem-fraction", "0.7", "--disable-cuda-graph", "--disable-torch-compile",
                                 "--disable-attention-kernel"])
    r = cfg.rollout
    assert (r.engine, r.max_batch_size, r.mem_fraction, r.cuda_graph, r.torch_compile, r.attention_kernel) == \
           ("fast", 128, 0.7, False, False, False)
    default, _ = parse_flags(base)
    assert (default.rollout.max_batch_size, default.rollout.mem_fraction, default.rollout.cuda_graph) == (None, None, True)
    for fraction in ("0", "1", "1.5", "-0.2"):
        with pytest.raises(ConfigError) as err:
            parse_flags(base + ["--rollout-mem-fraction", fraction, "--rollout-max-batch-size", "0"])
        assert f"--rollout-mem-fraction {float(fraction)}: must be in (0, 1)" in str(err.value)
        assert "--rollout-max-batch-size 0: must be a positive integer" in str(err.value)


def test_engine_picked_names_the_family_and_why(models, tmp_path):
    from miles.rollout.engines.reason import engine_reason
    from miles.metrics.progress import ProgressModel
    from tests.tiny_model import make_tiny_family

    qwen3 = make_tiny_family(tmp_path / "qwen3", "qwen3")
    cases = {
        "fast": engine_cfg(qwen3, device="cuda"),
        "cpu": engine_cfg(qwen3),
        "refused": engine_cfg(models["gpt2"], device="cuda"),
    }
    why = {k: {**engine_reason(cfg, pick_backends(cfg)), "cls": pick_backends(cfg).engine.__name__,
               "fast_path_refused": pick_backends(cfg).fast_path_refused} for k, cfg in cases.items()}
    assert (why["fast"]["family"], why["fast"]["architecture"]) == ("qwen3", "Qwen3ForCausalLM")
    assert why["fast"]["why"] == "--rollout-engine embedded on CUDA: FastEngine implements qwen3"
    assert "off CUDA" in why["cpu"]["why"]
    assert why["refused"]["family"] == "gpt2" and "FastEngine refused the model (model_type 'gpt2'" in why["refused"]["why"]
    lines = {k: ProgressModel().update({"event": "engine_picked", **ev}) for k, ev in why.items()}
    assert lines["fast"] == ["engine: FastEngine for Qwen3ForCausalLM: --rollout-engine embedded on CUDA: "
                             "FastEngine implements qwen3"]
    assert lines["refused"][0].startswith("warning: engine: EmbeddedEngine for GPT2LMHeadModel: ")
