"""Where the megatron ranks run: on GPUs each rank takes one trainer placement of the run's plan
(miles.cluster.placement) and the group actor itself takes no GPU; on the CPU the group starts
TP x PP x CP ranks of its own. The torch trainer keeps the plan's first trainer placement."""

from __future__ import annotations

from types import SimpleNamespace

from miles.cluster.placement import PlacementRequest, RunPlacement, plan_placement
from miles.config import ModelConfig, RolloutConfig, RunConfig, TrainConfig
from miles.config.schema import DataConfig
from miles.phases.init import _trainer_placement
from miles.training.protocol import TRAIN_BACKENDS


def ctx(backend: str, **request) -> SimpleNamespace:
    cfg = RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(rollout_shuffle=True, prompt_data="p"),
                    rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), train=TrainConfig(backend=backend))
    plan = plan_placement(PlacementRequest(**request))
    return SimpleNamespace(cfg=cfg, c=SimpleNamespace(cluster=SimpleNamespace(namespace="ns"), placement=RunPlacement(plan)),
                           backends=SimpleNamespace(train_spec=TRAIN_BACKENDS[backend]))


def test_megatron_ranks_take_the_trainers_gpus_of_the_plan():
    got = _trainer_placement(ctx("megatron", use_gpus=True, actor_num_gpus_per_node=2))
    assert got == {"placement": {"num_gpus": 0}, "rank_options": [{"num_gpus": 0.4}, {"num_gpus": 0.4}],
                      "namespace": "ns"}
    colocated = _trainer_placement(ctx("megatron", use_gpus=True, colocate=True))
    assert colocated["rank_options"] == [{"num_gpus": 0.4}]      # the engine takes 0.2 of the same GPU


def test_megatron_on_the_cpu_and_torch_anywhere_keep_one_actor_placement():
    assert _trainer_placement(ctx("megatron", use_gpus=False)) == {"placement": {"num_gpus": 0}, "namespace": "ns"}
    assert _trainer_placement(ctx("torch", use_gpus=True)) == {"placement": {"num_gpus": 0.4}}
