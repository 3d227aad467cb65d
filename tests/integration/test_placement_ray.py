"""The placement group's Ray layer on the CPU machine: a plan the cluster cannot grant is a ConfigError
within the timeout (never a hang), and nothing is left behind."""

import time

import pytest

from miles.cluster.placement import (PlacementGroupResource, PlacementRequest, check_cluster, cluster_gpus,
                                     plan_placement)
from miles.config import ConfigError

pytestmark = [pytest.mark.ray]


def test_a_gpu_plan_on_a_cpu_cluster_fails_fast_and_removes_its_group(ray_cluster):
    from ray.util import placement_group_table

    plan = plan_placement(PlacementRequest(use_gpus=True, colocate=True))
    assert cluster_gpus() == 0
    with pytest.raises(ConfigError, match="needs 1 GPU"):
        check_cluster(plan, cluster_gpus())
    start = time.monotonic()
    with pytest.raises(ConfigError, match="not granted within 2 s"):
        PlacementGroupResource(plan, name="miles-test-pg", timeout_s=2)
    assert time.monotonic() - start < 30
    states = [g["state"] for g in placement_group_table().values() if g["name"] == "miles-test-pg"]
    assert states and all(s == "REMOVED" for s in states)
