"""Where the torch trainer's ranks run: one rank on one trainer placement as before; with more than one
(--actor-num-nodes x --actor-num-gpus-per-node) the FSDP group, whose ranks take the plan's trainer
placements on GPUs, or start as that many CPU processes on a CPU run. PPO's critic the same, on the
plan's critic placements."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.cluster.placement import PlacementRequest, RunPlacement, plan_placement
from miles.config import ConfigError, ModelConfig, RolloutConfig, RunConfig, TrainConfig
from miles.config.flags import parse_flags
from miles.config.schema import ClusterConfig, DataConfig
from miles.phases.init import _critic_placement, _trainer_placement
from miles.training.protocol import TRAIN_BACKENDS


def ctx(gpus_per_node: int, use_gpus: bool) -> SimpleNamespace:
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p"),
                    rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), train=TrainConfig(backend="torch"),
                    cluster=ClusterConfig(actor_num_gpus_per_node=gpus_per_node))
    plan = plan_placement(PlacementRequest(use_gpus=use_gpus, actor_num_gpus_per_node=gpus_per_node,
                                           has_critic=True))
    return SimpleNamespace(cfg=cfg, c=SimpleNamespace(cluster=SimpleNamespace(namespace="ns"), placement=RunPlacement(plan)),
                           backends=SimpleNamespace(train_spec=TRAIN_BACKENDS["torch"].for_ranks(gpus_per_node)))


def test_one_rank_is_the_one_process_trainer_and_more_are_the_fsdp_group():
    assert TRAIN_BACKENDS["torch"].for_ranks(1).trainer == "miles.training.torch.trainer:Trainer"
    many = TRAIN_BACKENDS["torch"].for_ranks(2)
    assert many.trainer == "miles.training.torch.fsdp.group:FSDPTrainer" and many.ranked
    assert TRAIN_BACKENDS["torch"].for_ranks(1).critic == "miles.training.torch.critic:Critic"
    assert many.critic == "miles.training.torch.fsdp.critic_group:FSDPCritic"
    assert TRAIN_BACKENDS["megatron"].for_ranks(4) is TRAIN_BACKENDS["megatron"]


def test_fsdp_ranks_take_the_trainer_placements_or_start_as_cpu_processes():
    on_gpus = _trainer_placement(ctx(2, use_gpus=True))
    assert on_gpus == {"placement": {"num_gpus": 0}, "rank_options": [{"num_gpus": 0.4}, {"num_gpus": 0.4}],
                      "namespace": "ns"}
    assert _trainer_placement(ctx(2, use_gpus=False)) == {"placement": {"num_gpus": 0}, "world_size": 2, "namespace": "ns"}
    assert _trainer_placement(ctx(1, use_gpus=False)) == {"placement": {"num_gpus": 0}}


def test_the_critics_ranks_take_the_critic_placements_beside_the_trainers():
    plan = ctx(2, use_gpus=True).c.placement.plan
    assert [c.bundle for c in plan.critics] == [t.bundle for t in plan.trainers] == [0, 1]
    on_gpus = _critic_placement(ctx(2, use_gpus=True))
    assert on_gpus == {"placement": {"num_gpus": 0}, "namespace": "ns",
                       "rank_options": [{"num_gpus": c.num_gpus} for c in plan.critics]}
    assert _critic_placement(ctx(2, use_gpus=False)) == {"placement": {"num_gpus": 0}, "world_size": 2,
                                                         "namespace": "ns"}
    assert _critic_placement(ctx(1, use_gpus=False)) == {"placement": {"num_gpus": 0}}


def test_fsdp_is_torch_and_takes_several_ranks(tiny_task):
    base = ["--hf-checkpoint", tiny_task["model"], "--prompt-data", tiny_task["train"], "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1"]
    cfg, _ = parse_flags([*base, "--train-backend", "fsdp", "--actor-num-gpus-per-node", "2"])
    assert cfg.train.backend == "torch" and cfg.cluster.trainer_ranks == 2



def test_a_backend_without_ranks_is_still_refused_more_than_one(tiny_task, monkeypatch):
    from miles.training import protocol

    monkeypatch.setitem(protocol.TRAIN_BACKENDS, "torch", protocol.TrainBackendSpec(trainer="miles.training.torch.trainer:Trainer"))
    with pytest.raises(ConfigError, match="--actor-num-gpus-per-node 2: the torch trainer runs on one GPU"):
        parse_flags(["--hf-checkpoint", tiny_task["model"], "--prompt-data", tiny_task["train"], "--rollout-batch-size",
                     "2", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2"])


def test_offload_train_is_taken_on_several_ranks(tiny_task):
    from miles.training.protocol import SupportsOffload

    cfg, _ = parse_flags(["--hf-checkpoint", tiny_task["model"], "--prompt-data", tiny_task["train"],
                          "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                          "--actor-num-gpus-per-node", "2", "--offload-train"])
    assert cfg.cluster.offloads_train and TRAIN_BACKENDS["torch"].for_ranks(2).supports(SupportsOffload)
