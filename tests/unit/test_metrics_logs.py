"""Worker logs: actor names → role/rank, JSON lines in the run dir with the run's context bound."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import structlog

from miles.metrics.logs import LogContext, context_for_actor, logged_actor_class, process_logging


EARLY = structlog.get_logger().bind(role="early")     # bound at import, as the components' modules do


@pytest.fixture(autouse=True)
def restore_structlog():
    saved = {**structlog.get_config()}
    procs = list(saved.pop("processors"))
    yield
    structlog.configure(**saved)
    structlog.get_config()["processors"][:] = procs


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name, role, rank, restart, file", [
    ("engine-0", "engine", 0, None, "engine-0.jsonl"),
    ("engine-12-r3", "engine", 12, 3, "engine-12-r3.jsonl"),
    ("trainer", "trainer", 0, None, "trainer-0.jsonl"),
    ("rollout-executor", "rollout-executor", 0, None, "rollout-executor-0.jsonl"),
])
def test_actor_names_give_role_rank_and_file(tmp_path, name, role, rank, restart, file):
    c = context_for_actor(name, run_id="r1", log_dir=tmp_path)
    assert (c.role, c.rank, c.restart) == (role, rank, restart)
    assert c.path == tmp_path / file


class Component:
    """A plain component, as the run's actors are."""

    def __init__(self, size: int):
        self.size = size
        structlog.get_logger().bind(role="component").info("component_ready", size=size)

    def train(self, samples: list, rollout_id: int) -> int:
        structlog.get_logger().info("train_done", num=len(samples))
        return rollout_id

    async def generate(self, rollout_id: int) -> int:
        await asyncio.sleep(0)
        structlog.get_logger().info("generate_done")
        return rollout_id

    def weights(self) -> str:
        structlog.get_logger().warning("no_weights_yet", reason="test")
        return "w"

    def early(self, rollout_id: int) -> None:
        EARLY.info("from_a_logger_bound_at_import")
        EARLY.debug("below_the_level")


def test_logged_component_writes_json_lines_with_the_run_context(tmp_path, capsys):
    ctx = LogContext(run_id="r1", log_dir=str(tmp_path / "logs"), role="engine", rank=2)
    cls = logged_actor_class(Component, ctx)
    assert cls.__name__ == "Component" and issubclass(cls, Component)
    c = cls(7)
    assert c.train([1, 2], 5) == 5 and c.train([1], rollout_id=6) == 6
    assert asyncio.run(c.generate(9)) == 9
    assert c.weights() == "w"
    got = lines(tmp_path / "logs" / "engine-2.jsonl")
    assert [(e["event"], e.get("rollout_id")) for e in got] == [
        ("component_ready", None), ("actor_ready", None), ("train_done", 5), ("train_done", 6), ("generate_done", 9),
        ("no_weights_yet", None)]
    assert all(e["run_id"] == "r1" and e["rank"] == 2 and "ts" in e for e in got)
    assert got[0]["role"] == "component"      # a role the component binds itself wins over the default
    assert got[1]["actor"] == "Component" and isinstance(got[1]["pid"], int)
    assert got[2]["role"] == "engine" and got[2]["level"] == "info" and got[2]["num"] == 2
    err = capsys.readouterr().err               # warnings also reach stderr (Ray forwards it to the driver)
    assert "no_weights_yet" in err and "train_done" not in err


def test_a_logger_bound_before_configuration_lands_in_the_file_too(tmp_path, capsys):
    # Ray imports a component's module (and its module-level bound logger) before the constructor runs
    c = logged_actor_class(Component, LogContext(run_id="r", log_dir=str(tmp_path), role="trainer"))(1)
    c.early(4)
    got = lines(tmp_path / "trainer-0.jsonl")[-1]
    assert (got["event"], got["role"], got["rollout_id"], got["run_id"]) == ("from_a_logger_bound_at_import", "early", 4, "r")
    assert "from_a_logger_bound_at_import" not in capsys.readouterr().out     # not printed to stdout as well
    assert all(e["event"] != "below_the_level" for e in lines(tmp_path / "trainer-0.jsonl"))


def test_concurrent_calls_each_carry_their_own_rollout_id(tmp_path):
    cls = logged_actor_class(Component, LogContext(run_id="r", log_dir=str(tmp_path), role="executor"))
    c = cls(1)

    async def both():
        return await asyncio.gather(c.generate(1), c.generate(2))

    assert asyncio.run(both()) == [1, 2]
    got = [e for e in lines(tmp_path / "executor-0.jsonl") if e["event"] == "generate_done"]
    assert sorted(e["rollout_id"] for e in got) == [1, 2]


def test_a_constructor_that_raises_is_logged_with_its_traceback(tmp_path):
    cls = logged_actor_class(Component, LogContext(run_id="r", log_dir=str(tmp_path), role="engine"))
    with pytest.raises(TypeError):
        cls("not", "an int")
    failed = lines(tmp_path / "engine-0.jsonl")[-1]
    assert failed["event"] == "actor_init_failed" and failed["level"] == "error" and "TypeError" in failed["exception"]


def test_level_filters_and_bad_level_is_named(tmp_path):
    cls = logged_actor_class(Component, LogContext(run_id="r", log_dir=str(tmp_path), role="t", level="warning"))
    c = cls(1)
    c.train([], 0)
    c.weights()
    assert [e["event"] for e in lines(tmp_path / "t-0.jsonl")] == ["no_weights_yet"]
    with pytest.raises(ValueError, match="'loud'"):
        logged_actor_class(Component, LogContext(run_id="r", log_dir=str(tmp_path), role="t", level="loud"))(1)


def test_process_logging_restores_the_configuration_and_makes_no_dir_until_a_line(tmp_path):
    before = list(structlog.get_config()["processors"])
    log_dir = tmp_path / "run" / "logs"
    with process_logging(LogContext(run_id="r", log_dir=str(log_dir), role="driver", level="info")) as path:
        assert not log_dir.exists()              # a run that fails its checks leaves no directory
        structlog.get_logger().info("prompts_loaded", n=3)
    assert structlog.get_config()["processors"] == before
    assert [e["event"] for e in lines(path)] == ["prompts_loaded"] and path.name == "driver-0.jsonl"


def test_the_tee_prints_one_short_line(tmp_path):
    from miles.metrics.logs import configure_process_logging

    err = io.StringIO()
    configure_process_logging(LogContext(run_id="r", log_dir=str(tmp_path), role="x"), stderr=err)
    structlog.get_logger().error("boom", detail=1)
    assert err.getvalue().startswith("[error] boom ") and "detail=1" in err.getvalue()
