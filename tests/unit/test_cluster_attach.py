"""The flags of a run on a cluster it attaches to: shipping, shared filesystem, actor resources; the
resources in the placement; the model-path check an actor makes on its node. No Ray here."""

from __future__ import annotations

import pytest

from miles.cluster.placement import PlacementRequest, check_actor_resources, plan_placement
from miles.cluster.ray_cluster import checking_paths, driver_path
from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.checkpoint.folders import CopiedFolders, SharedFolders, pick_folders


@pytest.fixture
def minimal(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "1+1="}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "1",
            "--num-rollout", "1", "--n-samples-per-prompt", "8"]


def test_the_attach_flags_reach_the_cluster_slice(minimal):
    cfg, _ = parse_flags([*minimal, "--ray-address", "10.0.0.1:6379", "--ray-no-ship-code", "--no-shared-fs",
                          "--ray-actor-resources", '{"miles_worker": 1, "big_disk": 0.5}'])
    c = cfg.cluster
    assert (c.ship_code, c.shared_fs, c.actor_resources) == (False, False, {"miles_worker": 1, "big_disk": 0.5})
    assert parse_flags([*minimal, "--shared-fs"])[0].cluster.shared_fs is True
    c = parse_flags(minimal)[0].cluster
    assert (c.ship_code, c.shared_fs, c.actor_resources) == (True, None, None)     # ship, decide, anywhere


@pytest.mark.parametrize("flags,expected", [
    (["--ray-no-ship-code"], "--ray-no-ship-code needs --ray-address"),
    (["--ray-actor-resources", '{"GPU": 1}'], "'GPU' is not a custom resource name"),
    (["--ray-actor-resources", '{"miles_worker": 1.5}'], "a whole number above 1"),
    (["--ray-actor-resources", '{"miles_worker": 0}'], "must be a number > 0"),
    (["--ray-actor-resources", '{"miles_worker": "one"}'], "must be a number > 0"),
    (["--ray-actor-resources", '["miles_worker"]'], "must be a JSON object"),
])
def test_bad_attach_flags_are_named_with_the_fix(minimal, flags, expected):
    with pytest.raises(ConfigError) as e:
        parse_flags([*minimal, *flags])
    assert expected in str(e.value)


def test_actor_resources_go_into_each_bundle_once_per_actor_living_there():
    colocated = plan_placement(PlacementRequest(use_gpus=True, colocate=True, has_critic=True))
    assert colocated.bundle_specs({"miles_worker": 1}) == [{"GPU": 1, "miles_worker": 3}]   # trainer, critic, engine
    apart = plan_placement(PlacementRequest(use_gpus=True, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert apart.bundle_specs({"w": 0.5}) == [{"GPU": 1, "w": 0.5}, {"GPU": 2, "w": 0.5}, {"GPU": 2, "w": 0.5}]
    assert apart.bundle_specs() == [{"GPU": 1}, {"GPU": 2}, {"GPU": 2}]
    assert apart.num_actors == 3


def test_more_actor_resources_than_the_cluster_has_is_an_error_before_any_actor():
    check_actor_resources({"miles_worker": 1}, 3, {"CPU": 3, "miles_worker": 10})
    with pytest.raises(ConfigError) as e:
        check_actor_resources({"miles_worker": 4}, 3, {"CPU": 3, "miles_worker": 10})
    assert "miles_worker: 12 needed, the cluster has 10" in str(e.value) and "ray start --resources" in str(e.value)
    with pytest.raises(ConfigError, match="the cluster has 0"):
        check_actor_resources({"typo_worker": 1}, 1, {"CPU": 3, "miles_worker": 10})


class Component:
    def __init__(self, model_path: str, *, seed: int = 0):
        self.model_path, self.seed = model_path, seed


def test_an_actor_missing_the_model_on_its_node_says_which_flag_path_and_node(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    checked = checking_paths(Component, {"--hf-checkpoint": str(model)}, "engine-0")
    assert checked.__name__ == "Component"
    assert checked(str(model), seed=3).seed == 3              # present: the component's constructor runs
    model.rmdir()                                             # what another node without the folder sees
    with pytest.raises(FileNotFoundError) as e:
        checked(str(model))
    text = str(e.value)
    assert f"--hf-checkpoint {model}" in text and "where engine-0 runs" in text and "every node" in text


def test_the_shared_filesystem_default_follows_where_the_nodes_are():
    def pick(flag, *, started=False, ips=("10.0.0.1",)):
        folders, why = pick_folders(flag, started=started, node_ips=ips, driver_ip="10.0.0.1")
        return type(folders), why

    started = pick(None, started=True, ips=("127.0.0.1", "10.0.0.9"))
    assert started == (SharedFolders, "the run started the cluster on this machine")
    assert pick(None, ips=("10.0.0.1", "10.0.0.1"))[0] is SharedFolders
    kind, why = pick(None, ips=("10.0.0.1", "10.0.0.2"))
    assert kind is CopiedFolders and "10.0.0.2" in why
    assert pick(True, ips=("10.0.0.2",)) == (SharedFolders, "--shared-fs")           # the flag wins
    assert pick(False, started=True) == (CopiedFolders, "--no-shared-fs")


def test_paths_handed_to_actors_are_absolute_when_they_are_the_drivers(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert driver_path("model") == str(tmp_path / "model")         # the actor's cwd is not the driver's
    assert driver_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub name stays one
