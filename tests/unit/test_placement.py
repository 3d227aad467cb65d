"""The placement plan: bundles and GPU shares from miles' placement flags; errors before any actor starts."""

import itertools
from collections import defaultdict

import pytest

from miles.cluster.placement import (CPU_ACTOR, CpuThreads, Placement, PlacementRequest, check_cluster,
                                     cpu_thread_budget, plan_placement)
from miles.config import ConfigError


def test_cpu_runs_keep_num_gpus_0_and_no_placement_group():
    plan = plan_placement(PlacementRequest(use_gpus=False, num_engines=3, has_critic=True, colocate=True))
    assert plan.bundles == 0
    assert plan.trainers == (CPU_ACTOR,) and plan.critics == (CPU_ACTOR,) and plan.engines == (CPU_ACTOR,) * 3
    assert CPU_ACTOR == Placement(bundle=None, num_gpus=0)


def test_cpu_threads_all_cores_to_a_trainer_alone_and_what_the_engines_leave_when_they_overlap():
    two_engines = plan_placement(PlacementRequest(use_gpus=False, num_engines=2))
    # sync: the engines wait while the trainer steps, which takes every core
    assert cpu_thread_budget(two_engines, cores=2, overlapped=False) == CpuThreads(cores=2, overlapped=False,
                                                                                  trainer=2, engine=1)
    # async / fully_async: each engine's thread holds a core; one thread at least, never more than the cores
    assert cpu_thread_budget(two_engines, cores=2, overlapped=True).trainer == 1
    assert cpu_thread_budget(two_engines, cores=1, overlapped=True).trainer == 1
    assert cpu_thread_budget(two_engines, cores=16, overlapped=True).trainer == 14
    # the trainer's ranks split what they get (the critic takes its rank's, training in turn with it)
    assert cpu_thread_budget(two_engines, cores=16, overlapped=True, ranks=2).trainer == 7
    assert cpu_thread_budget(two_engines, cores=16, overlapped=False, ranks=2).trainer == 8
    assert cpu_thread_budget(two_engines, cores=2, overlapped=False, ranks=4).trainer == 1
    assert cpu_thread_budget(two_engines, cores=4, overlapped=True).describe() == {
        "cores": 4, "overlapped": True, "trainer": 2, "engine": 1}
    # on GPUs the devices compute: no budget
    assert cpu_thread_budget(plan_placement(PlacementRequest(use_gpus=True)), cores=2, overlapped=True) is None


def test_one_gpu_each_when_not_colocated():
    plan = plan_placement(PlacementRequest(use_gpus=True))
    assert plan.bundles == 2
    assert plan.trainers == (Placement(0, 0.4),) and plan.engines == (Placement(1, 1.0),)


def test_colocated_on_one_gpu_trainer_critic_and_engine_share_the_bundle():
    plan = plan_placement(PlacementRequest(use_gpus=True, colocate=True, has_critic=True))
    assert plan.bundles == 1
    assert plan.trainers == (Placement(0, 0.4),) and plan.critics == (Placement(0, 0.4),)
    assert plan.engines == (Placement(0, 0.2),)


def test_colocated_engines_fill_the_trainers_gpus_from_the_first():
    # 2 nodes x 2 GPUs for the trainer; 4 engine GPUs, 2 per engine: 2 engines on bundles 0 and 2
    plan = plan_placement(PlacementRequest(use_gpus=True, colocate=True, actor_num_nodes=2, actor_num_gpus_per_node=2,
                                           rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert plan.bundles == 4 and [e.bundle for e in plan.engines] == [0, 2]
    assert [t.bundle for t in plan.trainers] == [0, 1, 2, 3]
    # the engine count is --rollout-num-engines' (1), not one per trainer GPU
    assert plan_placement(PlacementRequest(use_gpus=True, colocate=True, actor_num_gpus_per_node=4)).num_engines == 1


def test_rollout_num_gpus_sets_the_engine_count():
    # 4 engine GPUs, 2 per engine: 2 engines, each all 2 GPUs of a bundle of its own (a TP=2 server sees both)
    plan = plan_placement(PlacementRequest(use_gpus=True, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert plan.bundle_gpus == (1, 2, 2) and plan.gpus == 5
    assert plan.engines == (Placement(1, 2.0), Placement(2, 2.0))


def shares_per_bundle(plan):
    total = defaultdict(float)
    for p in (*plan.trainers, *plan.critics, *plan.engines):
        total[p.bundle] += p.num_gpus
    return total


@pytest.mark.parametrize("colocate,critic,nodes,per_node,per_engine,engines",
                         list(itertools.product([False, True], [False, True], [1, 2], [1, 4], [1, 2], [1, 2])))
def test_every_bundle_is_used_and_no_gpu_is_oversubscribed(colocate, critic, nodes, per_node, per_engine, engines):
    r = PlacementRequest(use_gpus=True, colocate=colocate, has_critic=critic, actor_num_nodes=nodes,
                         actor_num_gpus_per_node=per_node, rollout_num_gpus_per_engine=per_engine, num_engines=engines)
    try:
        plan = plan_placement(r)
    except ConfigError:
        assert colocate and engines * per_engine > nodes * per_node     # more engine GPUs than the trainer's
        return
    shares = shares_per_bundle(plan)
    assert all(s <= plan.bundle_gpus[b] + 1e-9 for b, s in shares.items())
    assert set(shares) <= set(range(plan.bundles))
    assert len(plan.trainers) == nodes * per_node and len(plan.critics) == (nodes * per_node if critic else 0)
    # an engine of k GPUs owns bundle b of k GPUs: it is not the trainer's unless colocated
    trainer_bundles = {t.bundle for t in plan.trainers}
    for e in plan.engines:
        assert (e.bundle in trainer_bundles) == colocate


def test_inconsistent_requests_are_config_errors_naming_the_flags():
    with pytest.raises(ConfigError, match="--colocate puts the engines on the trainer's 1 GPU"):
        plan_placement(PlacementRequest(use_gpus=True, colocate=True, rollout_num_gpus=2))
    with pytest.raises(ConfigError, match="not a multiple of --rollout-num-gpus-per-engine"):
        plan_placement(PlacementRequest(use_gpus=True, rollout_num_gpus=3, rollout_num_gpus_per_engine=2))
    with pytest.raises(ConfigError, match="cannot span nodes"):
        plan_placement(PlacementRequest(use_gpus=True, rollout_num_gpus_per_engine=16, rollout_num_gpus=16))
    with pytest.raises(ConfigError) as err:
        plan_placement(PlacementRequest(use_gpus=True, actor_num_nodes=0, rollout_num_gpus=0))
    assert len(err.value.problems) == 2          # every problem at once


def test_too_few_gpus_in_the_cluster_is_a_config_error():
    plan = plan_placement(PlacementRequest(use_gpus=True))
    check_cluster(plan, 2.0)
    with pytest.raises(ConfigError, match="needs 2 GPU.*has 1"):
        check_cluster(plan, 1.0)
    check_cluster(plan_placement(PlacementRequest(use_gpus=True, colocate=True)), 1.0)


def test_debug_halves_drop_their_actors():
    rollout_only = plan_placement(PlacementRequest(use_gpus=True, has_trainer=False, colocate=True))
    assert rollout_only.trainers == () and rollout_only.bundles == 1 and rollout_only.engines == (Placement(0, 1.0),)
    train_only = plan_placement(PlacementRequest(use_gpus=True, has_engines=False))
    assert train_only.engines == () and train_only.bundles == 1


def test_one_gpu_and_no_layout_flags_colocate_and_a_named_layout_stays_as_given():
    from dataclasses import replace
    from pathlib import Path

    from miles.cluster.auto_layout import AUTO_COLOCATE_REASON, AUTO_SHARED_REASON, auto_colocate, auto_reason
    from miles.cluster.placement import placement_request
    from miles.config.flags import parse_flags
    from miles.metrics.progress import ProgressModel

    def cfg_of(*flags):
        example = Path(__file__).resolve().parents[2] / "examples/arithmetic/grpo.yaml"
        return parse_flags(["--config", str(example), *flags])[0]

    def auto(cfg, *, gpus=1, started=True, machine="sync"):
        needed = plan_placement(placement_request(cfg, use_gpus=True)).gpus
        return auto_colocate(cfg, use_gpus=True, cluster_gpus=gpus, started=started, needed_gpus=needed,
                             machine=machine)

    plain = cfg_of()
    colocated = auto(plain)
    assert colocated == replace(plain, cluster=replace(plain.cluster, colocate=True))
    assert plan_placement(placement_request(colocated, use_gpus=True)).gpus == 1
    assert auto(plain, gpus=2) is None                     # the default layout fits: as it was
    assert auto(plain, started=False) is None              # an attached cluster is the user's layout
    assert auto(plain, machine="async") is None            # the async machine refuses this run (no --use-tis)
    # the async machines cannot hand the GPU back and forth: they get it shared, both resident
    tis = cfg_of("--use-tis")
    shared = auto(tis, machine="async")
    assert shared == replace(tis, cluster=replace(tis.cluster, colocate=True, offload_rollout=False))
    assert shared.cluster.shares_gpu_resident and auto_reason(shared) == AUTO_SHARED_REASON
    assert plan_placement(placement_request(shared, use_gpus=True)).gpus == 1
    assert auto(cfg_of("--use-tis", "--fully-async"), machine="fully_async").cluster.shares_gpu_resident
    assert auto_reason(colocated) == AUTO_COLOCATE_REASON and not colocated.cluster.shares_gpu_resident
    assert auto(cfg_of("--use-tis", "--offload-rollout"), machine="async") is None     # the user's flag stays
    for named in (["--rollout-num-gpus", "1"], ["--rollout-num-gpus-per-engine", "1", "--rollout-num-gpus", "1"], ["--rollout-num-engines", "2"]):
        assert auto(cfg_of(*named)) is None, named
    assert auto_colocate(plain, use_gpus=False, cluster_gpus=1, started=True, needed_gpus=0, machine="sync") is None
    line = ProgressModel().update({"event": "placement", "auto_colocate": AUTO_COLOCATE_REASON})
    assert line == [f"colocating: {AUTO_COLOCATE_REASON}"] and "--colocate" in line[0]


def test_a_cpu_run_without_an_engine_count_gets_two_engines_and_a_named_count_is_kept():
    from pathlib import Path

    from miles.cluster.auto_layout import AUTO_ENGINES_REASON, auto_num_engines
    from miles.cluster.placement import placement_request
    from miles.config.flags import parse_flags
    from miles.metrics.progress import ProgressModel

    def cfg_of(*flags):
        example = Path(__file__).resolve().parents[2] / "examples/arithmetic/grpo.yaml"
        return parse_flags(["--config", str(example), *flags])[0]

    def engines(cfg, *, use_gpus=False, cores=2):
        return plan_placement(placement_request(cfg, use_gpus=use_gpus, cores=cores)).num_engines

    plain = cfg_of()
    assert plain.rollout.num_engines is None
    assert engines(plain) == 2 and engines(plain, cores=8) == 2
    assert engines(plain, cores=1) == 1                    # one core: nothing to decode on beside it
    assert engines(plain, use_gpus=True) == 1              # a GPU engine is not bound to one thread
    assert engines(cfg_of("--rollout-num-engines", "1")) == 1          # named: kept, 1 included
    assert engines(cfg_of("--rollout-num-engines", "3")) == 3
    assert engines(cfg_of("--rollout-num-gpus", "1"), use_gpus=True) == 1
    assert auto_num_engines(cfg_of("--rollout-num-engines", "1"), use_gpus=False, cores=2) is None
    assert auto_num_engines(cfg_of("--rollout-engine", "sglang"), use_gpus=False, cores=2) is None
    reason = AUTO_ENGINES_REASON.format(cores=2)
    line = ProgressModel().update({"event": "placement", "auto_engines": reason})
    assert line == [f"engines: {reason}"] and "--rollout-num-engines 1" in line[0]
