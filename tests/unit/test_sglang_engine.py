"""The SGLang engine against the fake SGLang server (tests/fakes): the real command line, SGLang's
fields, the weight-update sequence and versions, memory tags, aborts, health probes of a busy, stalled
or hung server, a dead server, teardown."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from miles.rollout.engines.sglang.client import SGLangHTTPError
from miles.rollout.engines.sglang.engine import (ABORT_GRACE_S, PROGRESS_FRESH_S, SGLangEngine, SGLangEngineConfig,
                                         SGLangServerDied, SGLangStartError)
from miles.types import SamplingParams
from miles.weights.checksum import state_dict_checksum
from tests.fakes import FAKES_DIR, fake_calls, fake_state, sglang_processes
from tests.tiny_model import EOS_ID, VOCAB_SIZE, make_tiny_model

pytestmark = pytest.mark.timeout(120)
CFG = SGLangEngineConfig(memory_saver=True, startup_timeout_s=30)


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES_DIR), os.environ.get("PYTHONPATH", "")]))
    return make_tiny_model(tmp_path / "model")


@pytest.fixture
def engine(model, tmp_path):
    e = SGLangEngine(model, sglang=CFG, dtype="float32", engine_name="e0", seed=3, work_dir=tmp_path / "work")
    yield e
    asyncio.run(e.dispose())
    assert sglang_processes(model) == []


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def slow(model, tmp_path):
    """make(concurrency): an engine whose server makes a token every 50 ms and never stops early."""
    made = []

    def make(concurrency: int = 256) -> SGLangEngine:
        cfg = SGLangEngineConfig(startup_timeout_s=30, max_concurrency=concurrency,
                                 server_args=("--fake-token-delay", "0.05", "--fake-never-stop"))
        made.append(SGLangEngine(model, sglang=cfg, engine_name=f"s{len(made)}", work_dir=tmp_path / f"s{len(made)}"))
        return made[-1]

    yield make
    for e in made:
        fake_state(e.url, {"generate": False, "health": False})
        run(e.dispose())


async def running(url: str, n: int) -> None:
    """Until the server holds `n` requests."""
    deadline = time.monotonic() + 10
    while len(fake_state(url)["running"]) < n:
        assert time.monotonic() < deadline, fake_state(url)
        await asyncio.sleep(0.05)


def test_starts_sglangs_launch_command_in_its_own_process_group(model, tmp_path):
    cfg = SGLangEngineConfig(tp_size=2, startup_timeout_s=30, server_args=("--mem-fraction-static", "0.5"))
    e = SGLangEngine(model, sglang=cfg, device="cuda", engine_name="e1", seed=9, work_dir=tmp_path / "w")
    try:
        cmd = psutil.Process(e.server_pid()).cmdline()
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        for flag, value in (("--model-path", model), ("--tp-size", "2"), ("--dtype", "bfloat16"),
                            ("--random-seed", "9"), ("--weight-version", "0"), ("--mem-fraction-static", "0.5"),
                            ("--port", str(e.port)), ("--device", "cuda")):
            assert cmd[cmd.index(flag) + 1] == value
        assert "--skip-tokenizer-init" in cmd and "--enable-memory-saver" not in cmd
        assert os.getpgid(e.server_pid()) == e.server_pid() != os.getpgid(0)
        assert e.weights_dtype() == torch.bfloat16
    finally:
        run(e.dispose())


def test_generate_sends_only_sglang_fields_and_reads_ids_logprobs_and_versions(engine):
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9]]
    gens = run(engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, seed=42)))
    assert len(gens) == 3
    for g in gens:
        assert 1 <= len(g.response_ids) == len(g.logprobs) <= 6 and g.weight_version == 0
        assert all(0 <= t < VOCAB_SIZE for t in g.response_ids) and all(lp < 0 for lp in g.logprobs)
        assert g.finish_reason == ("stop" if g.response_ids[-1] == EOS_ID else "length")
    assert gens[0].response_ids != gens[1].response_ids       # one prompt twice: two seeds, two samples
    again = run(engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, seed=42)))
    assert [g.response_ids for g in again] == [g.response_ids for g in gens]
    calls = fake_calls(engine.url, "/generate")
    assert len(calls) == 6 and all(c["status"] == 200 and c["ignored"] == [] for c in calls)
    assert len({c["body"]["rid"] for c in calls}) == 6
    assert calls[0]["body"]["sampling_params"]["top_k"] == -1 and calls[0]["body"]["return_logprob"] is True


def test_a_request_sglang_rejects_is_an_error_with_sglangs_message(engine):
    with pytest.raises(SGLangHTTPError, match="top_p must be in \\(0, 1\\], got 1.5") as info:
        run(engine.generate([[5]], SamplingParams(top_p=1.5)))
    assert info.value.status == 400


def test_an_unknown_pass_through_flag_fails_the_start_with_the_servers_log(model, tmp_path):
    cfg = SGLangEngineConfig(startup_timeout_s=30, server_args=("--no-such-flag",))
    with pytest.raises(SGLangStartError, match="(?s)exited with status 2.*unrecognized arguments: --no-such-flag"):
        SGLangEngine(model, sglang=cfg, engine_name="bad", work_dir=tmp_path / "w")
    assert sglang_processes(model) == []


def test_a_server_that_is_not_healthy_in_time_is_killed_with_its_children(model, tmp_path):
    t0 = time.monotonic()
    cfg = SGLangEngineConfig(startup_timeout_s=2, server_args=("--fake-startup-delay", "60"))
    with pytest.raises(SGLangStartError, match="(?s)not healthy after 2 s.*fake sglang .* serving"):
        SGLangEngine(model, sglang=cfg, engine_name="slow", work_dir=tmp_path / "w")
    assert time.monotonic() - t0 < 15
    assert sglang_processes(model) == []


def exported(model: str, shift: float) -> dict[str, torch.Tensor]:
    return {k: v + shift for k, v in load_file(f"{model}/model.safetensors").items()}


def test_weight_updates_pause_flush_update_continue_and_set_versions(engine, model):
    before = run(engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, seed=1)))[0]
    for version in (1, 2):
        weights = exported(model, 0.1 * version)
        run(engine.update_weights(weights, version))
        assert engine.weight_version() == version
        assert run(engine.weights_checksum()) == state_dict_checksum(weights, dtype=torch.float32)
    after = run(engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, seed=1)))[0]
    assert after.weight_version == 2 and after.response_ids != before.response_ids
    control = [c for c in fake_calls(engine.url) if c["endpoint"] not in ("/generate",)]
    assert [c["endpoint"] for c in control] == ["/pause_generation", "/flush_cache", "/update_weights_from_disk",
                                                "/continue_generation"] * 2
    assert control[0]["body"] == {"mode": "retract"}
    disk = [c["body"] for c in control if c["endpoint"] == "/update_weights_from_disk"]
    assert [b["weight_version"] for b in disk] == ["1", "2"] and all(c["ignored"] == [] for c in control)
    assert not os.path.exists(disk[0]["model_path"]) and os.path.exists(disk[1]["model_path"])


def test_a_refused_update_keeps_the_version_and_still_continues_generation(engine, model):
    weights = exported(model, 0.0)
    weights.pop(next(iter(weights)))
    with pytest.raises(SGLangHTTPError, match="missing") as info:
        run(engine.update_weights(weights, 1))
    assert info.value.status == 400 and engine.weight_version() == 0
    assert fake_calls(engine.url)[-1]["endpoint"] == "/continue_generation"


def test_memory_is_released_and_resumed_by_tag(engine, model, tmp_path):
    run(engine.release_memory(["kv_cache", "cuda_graph"]))
    with pytest.raises(SGLangHTTPError, match="memory released"):
        run(engine.generate([[5]], SamplingParams(max_new_tokens=2)))
    run(engine.release_memory(["kv_cache"]))          # already released: nothing to send
    checks = fake_state(engine.url)["health_checks"]
    assert run(engine.health()) == {"busy": False, "since_progress_s": 0.0}
    assert fake_state(engine.url)["health_checks"] == checks  # a server without its memory cannot generate: not asked
    assert engine.released_memory() == ["cuda_graph", "kv_cache"]
    run(engine.resume_memory())                         # all tags: only the released ones go (SGLang refuses others)
    assert len(run(engine.generate([[5]], SamplingParams(max_new_tokens=2)))) == 1
    with pytest.raises(ValueError, match="use one or more of weights, kv_cache, cuda_graph"):
        run(engine.release_memory(["kv"]))
    assert [c["body"] for c in fake_calls(engine.url, "/release_memory_occupation")] == \
        [{"tags": ["kv_cache", "cuda_graph"]}]
    assert [c["body"] for c in fake_calls(engine.url, "/resume_memory_occupation")] == \
        [{"tags": ["kv_cache", "cuda_graph"]}]
    plain = SGLangEngine(model, sglang=SGLangEngineConfig(startup_timeout_s=30), engine_name="p", work_dir=tmp_path / "p")
    try:
        with pytest.raises(ValueError, match="--enable-memory-saver"):
            run(plain.release_memory(["kv_cache"]))
    finally:
        run(plain.dispose())


def test_a_cancelled_generate_aborts_each_of_its_requests(model, tmp_path):
    cfg = SGLangEngineConfig(server_args=("--fake-token-delay", "0.05", "--fake-never-stop"))
    e = SGLangEngine(model, sglang=cfg, engine_name="slow", work_dir=tmp_path / "w")

    async def main():
        task = asyncio.ensure_future(e.generate([[5], [6]], SamplingParams(max_new_tokens=10_000)))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        run(main())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(fake_calls(e.url, "/generate")) < 2:
            time.sleep(0.1)      # an aborted request is recorded when the server answers it
        started = sorted(c["body"]["rid"] for c in fake_calls(e.url, "/generate"))
        aborted = sorted(c["body"]["rid"] for c in fake_calls(e.url, "/abort_request"))
        assert len(started) == 2 and aborted == started
    finally:
        run(e.dispose())


def test_a_dead_server_is_found_its_group_killed_and_calls_fail_with_its_log(engine, model):
    children = [p for p in psutil.Process(engine.server_pid()).children(recursive=True)]
    assert children
    os.kill(engine.server_pid(), signal.SIGKILL)        # the leader only: the child must go with the group
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sglang_processes(model):
        time.sleep(0.1)
    assert sglang_processes(model) == []
    with pytest.raises(SGLangServerDied, match="(?s)exited with status -9.*fake sglang"):
        run(engine.generate([[5]], SamplingParams(max_new_tokens=2)))
    with pytest.raises(SGLangServerDied, match="exited with status -9"):
        run(engine.health())


def test_dispose_takes_the_server_group_and_the_weight_exports(model, tmp_path):
    e = SGLangEngine(model, sglang=CFG, dtype="float32", engine_name="d", work_dir=tmp_path / "w")
    run(e.update_weights(exported(model, 0.0), 1))
    exports = list((tmp_path / "w").glob("weights-v*"))
    assert exports and len(sglang_processes(model)) == 2     # the server and its child
    run(e.dispose())
    run(e.dispose())                                         # idempotent
    assert sglang_processes(model) == [] and not any(p.exists() for p in exports)
    assert (tmp_path / "w" / "server.log").exists()
    with pytest.raises(SGLangServerDied, match="disposed"):
        run(e.generate([[5]], SamplingParams()))


# --- health and abort --------------------------------------------------------------------------------

def test_an_idle_engine_has_its_server_prove_it_answers(engine):
    checks = fake_state(engine.url)["health_checks"]
    assert run(engine.health()) == {"busy": False, "since_progress_s": 0.0}
    assert fake_state(engine.url)["health_checks"] == checks + 1


def test_a_busy_engine_whose_requests_finish_answers_without_asking_the_server(slow):
    e = slow()

    async def main():
        # ten requests finish 0.1 s apart, and a long one keeps the engine busy until it is aborted
        caps = [2 * (k + 1) for k in range(10)] + [10_000]
        call = asyncio.ensure_future(e.generate([[5]] * 11, SamplingParams(max_new_tokens=10_000), caps))
        await running(e.url, 11)
        checks = fake_state(e.url)["health_checks"]
        states = []
        for _ in range(8):
            states.append(await e.health())
            await asyncio.sleep(0.1)
        asked = fake_state(e.url)["health_checks"] - checks
        await running(e.url, 1)
        while len(fake_state(e.url)["running"]) > 1:               # the short ones are done
            await asyncio.sleep(0.05)
        await e.abort()
        return states, asked, await call

    states, asked, gens = run(main())
    assert asked == 0 and all(s["busy"] and s["since_progress_s"] < PROGRESS_FRESH_S for s in states)
    assert [g.finish_reason for g in gens] == ["length"] * 10 + ["abort"]
    assert len(gens[-1].response_ids) == len(gens[-1].logprobs) >= 20         # what it made until the abort


def test_requests_that_stall_on_a_server_that_still_answers_are_not_a_hang(slow):
    e = slow(concurrency=2)          # both connections of the generate requests are taken: probes get their own

    async def main():
        call = asyncio.ensure_future(e.generate([[5], [6]], SamplingParams(max_new_tokens=10_000)))
        await running(e.url, 2)
        fake_state(e.url, {"generate": True})                     # nothing finishes any more; /health_generate is fine
        await asyncio.sleep(PROGRESS_FRESH_S + 0.2)
        checks = fake_state(e.url)["health_checks"]
        state = await asyncio.wait_for(e.health(), 5)
        asked = fake_state(e.url)["health_checks"] - checks
        t0 = time.monotonic()
        await e.abort()
        gens = await call
        return state, asked, gens, time.monotonic() - t0

    state, asked, gens, took = run(main())
    assert state == {"busy": True, "since_progress_s": 0.0} and asked == 1
    # the stuck server never gives the aborted requests back: they are cut after the grace, empty
    assert [(g.response_ids, g.finish_reason) for g in gens] == [([], "abort")] * 2
    assert ABORT_GRACE_S - 0.5 < took < ABORT_GRACE_S + 3


def test_a_hung_server_leaves_the_probe_unanswered_busy_or_idle(slow):
    e = slow()

    async def main():
        call = asyncio.ensure_future(e.generate([[5]], SamplingParams(max_new_tokens=10_000)))
        await running(e.url, 1)
        # a stuck scheduler: no tokens, and SGLang's health check gives up (503) after 0.3 s, again and again
        fake_state(e.url, {"generate": True, "health": True, "health_timeout_s": 0.3})
        await asyncio.sleep(PROGRESS_FRESH_S + 0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(e.health(), 2)           # busy, nothing finished lately
        await e.abort()
        assert [g.finish_reason for g in await call] == ["abort"]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(e.health(), 2)           # idle
        fake_state(e.url, {"generate": False, "health": False})
        return await asyncio.wait_for(e.health(), 5)

    assert run(main()) == {"busy": False, "since_progress_s": 0.0}


def test_abort_returns_the_running_requests_tokens_and_sends_none_of_the_waiting_ones(slow):
    e = slow(concurrency=2)

    async def main():
        call = asyncio.ensure_future(e.generate([[5], [6], [7], [8]], SamplingParams(max_new_tokens=10_000)))
        await running(e.url, 2)
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await e.abort()
        gens = await call
        took = time.monotonic() - t0
        return gens, took, await e.generate([[9]], SamplingParams(max_new_tokens=3))

    gens, took, later = run(main())
    assert took < ABORT_GRACE_S and [g.finish_reason for g in gens] == ["abort"] * 4
    assert all(len(g.response_ids) == len(g.logprobs) >= 1 for g in gens[:2])      # sent: their tokens so far
    assert [g.response_ids for g in gens[2:]] == [[], []]                           # waiting for a slot: not sent
    sent = [c["body"]["rid"] for c in fake_calls(e.url, "/generate")]
    assert len(sent) == 3 and sorted(c["body"]["rid"] for c in fake_calls(e.url, "/abort_request")) == sorted(sent[:2])
    assert later[0].finish_reason == "length" and len(later[0].response_ids) == 3  # a call after the abort runs


def test_a_weight_update_is_reported_busy_without_asking_the_paused_server(engine, model, monkeypatch):
    flush = engine._client.flush_cache

    async def slow_flush():                                  # the server paused for a long update
        await asyncio.sleep(1.0)
        await flush()

    monkeypatch.setattr(engine._client, "flush_cache", slow_flush)

    async def main():
        update = asyncio.ensure_future(engine.update_weights(exported(model, 0.1), 1))
        while not fake_calls(engine.url, "/pause_generation"):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        checks = fake_state(engine.url)["health_checks"]
        state = await engine.health()
        asked = fake_state(engine.url)["health_checks"] - checks
        await update
        return state, asked

    state, asked = run(main())
    assert state["busy"] and 0.25 < state["since_progress_s"] < 1.0 and asked == 0
    assert run(engine.health()) == {"busy": False, "since_progress_s": 0.0}      # done: the server is asked again
