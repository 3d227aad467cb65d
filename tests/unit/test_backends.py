"""The backend seam: registries name classes that implement their protocols, the flags offer exactly
the registries' names, and the composition root picks what the config names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from miles.config import ConfigError, DataConfig, ModelConfig, RolloutConfig, RunConfig
from miles.config.flags import BY_DEST
from miles.config.validate import validate
from miles.phases.init import pick_backends
from miles.rollout.protocol import ENGINES, Engine
from miles.runtime.machine import import_object
from miles.training.protocol import TRAIN_BACKENDS, CriticBackend, TrainBackendSpec, TrainerBackend
from tests.tiny_model import make_tiny_model


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")}


def test_every_registered_class_implements_its_protocol():
    assert members(Engine) >= {"generate", "update_weights", "weights_checksum", "weights_dtype", "dispose"}
    for name, path in ENGINES.items():
        cls = import_object(path)
        assert not members(Engine) - set(dir(cls)), (name, members(Engine) - set(dir(cls)))
    for name, spec in TRAIN_BACKENDS.items():
        trainer = import_object(spec.trainer)
        assert not members(TrainerBackend) - set(dir(trainer)), (name, members(TrainerBackend) - set(dir(trainer)))
        if spec.critic:
            critic = import_object(spec.critic)
            assert not members(CriticBackend) - set(dir(critic)), (name, members(CriticBackend) - set(dir(critic)))


def test_flag_choices_are_the_registries():
    assert BY_DEST["rollout_engine"].choices == tuple(ENGINES)
    assert BY_DEST["train_backend"].choices == tuple(TRAIN_BACKENDS)


class FakeEngine:                       # a backend a later issue would add: one registry entry
    pass


class FakeTrainer:
    pass


def cfg_with(**rollout_and_train) -> RunConfig:
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p.jsonl"),
                    rollout=RolloutConfig(batch_size=2), num_rollout=1)
    return replace(cfg, rollout=replace(cfg.rollout, engine=rollout_and_train.get("engine", "embedded")),
                   train=replace(cfg.train, backend=rollout_and_train.get("backend", "torch")))


def test_pick_backends_reads_both_flags(monkeypatch):
    monkeypatch.setitem(ENGINES, "fake", f"{__name__}:FakeEngine")
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
                  data=DataConfig(prompt_data=str(data), label_key="label"))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "--rollout-engine vllm: no such engine; use one of embedded" in str(err.value)
    assert "--train-backend jax: no such backend; use one of torch" in str(err.value)
    monkeypatch.setitem(TRAIN_BACKENDS, "nocritic", TrainBackendSpec(trainer=f"{__name__}:FakeTrainer"))
    cfg = replace(cfg, rollout=replace(cfg.rollout, engine="embedded"), train=replace(cfg.train, backend="nocritic"),
                  algorithm=replace(cfg.algorithm, advantage_estimator="ppo"))
    with pytest.raises(ConfigError, match="--train-backend nocritic has no critic"):
        validate(cfg)
