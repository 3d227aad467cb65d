"""Rewards beyond math and exact_match: f1, random, deterministic_random, the boxed_ prefix,
--reward-key, --group-rm, per-sample metadata rm_type, and remote_rm against a fake reward HTTP
service (fast, flaky, slow, refusing, not JSON, down)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp import web

from miles.config import ConfigError, RolloutConfig
from miles.rollout.remote_reward import RemoteReward, check_reachable
from miles.rollout.rewards import (RM_TYPES, RewardError, builtin_reward, deterministic_random_reward, f1_reward,
                                   score_group)
from miles.rollout.scoring import Rewards
from miles.types import Prompt, Sample

P = Prompt(index=3, text="what?", prompt_ids=(1,), label="the cat sat")


def sample(response: str, *, label: str = "4", metadata=None, status="completed", group=0) -> Sample:
    prompt = Prompt(index=group, text="q", prompt_ids=(1,), label=label, metadata=metadata or {})
    return Sample(prompt=prompt, group=group, response_ids=[1], rollout_logprobs=[0.0], finish_reason="stop",
                  weight_version=0, response_text=response, metadata=dict(prompt.metadata), status=status)


def test_f1_by_hand():
    # "a cat sat down" -> [cat, sat, down] against [cat, sat]: p 2/3, r 1, f1 = 0.8
    assert f1_reward(P, "A cat, sat down!", "the cat sat") == pytest.approx(0.8)
    assert f1_reward(P, "dog", "the cat sat") == 0.0
    assert f1_reward(P, "The cat sat.", "the cat sat") == 1.0


def test_random_rewards():
    values = {deterministic_random_reward(P, f"r{i}", None) for i in range(32)}
    assert values == {0.0, 1.0}
    assert [deterministic_random_reward(P, f"r{i}", None) for i in range(8)] == \
        [deterministic_random_reward(P, f"r{i}", None) for i in range(8)]     # the same every time
    assert {builtin_reward("random")(P, "x", None) for _ in range(64)} == {0.0, 1.0}


def test_boxed_prefix_scores_the_last_box():
    assert "boxed_f1" in RM_TYPES and "boxed_math" in RM_TYPES
    assert asyncio.run(builtin_reward("boxed_math")(P, "2+2 is \\boxed{4}, not 5", "4")) == 1.0
    assert asyncio.run(builtin_reward("boxed_math")(P, "the answer is 4", "4")) == 0.0     # no box: 0.0
    assert builtin_reward("boxed_exact_match")(P, "so \\boxed{cat}", "cat") == 1.0
    with pytest.raises(ConfigError, match="boxed_remote_rm"):
        builtin_reward("boxed_remote_rm")


def score(rewards: Rewards, samples: list[Sample], n: int) -> list[float]:
    asyncio.run(rewards.score(samples, n))
    return [s.reward for s in samples]


def test_metadata_rm_type_overrides_per_sample_and_unscorable_samples_keep_zero():
    rewards = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, rm_type="math"))
    samples = [sample("4"), sample("\\boxed{5} then 4", metadata={"rm_type": "boxed_math"}), sample("4", status="failed")]
    # math reads 4 (the last number); boxed_math reads 5; the failed sample is not scored
    assert score(rewards, samples, 3) == [1.0, 0.0, 0.0]


def test_unknown_metadata_rm_type_is_found_at_start_up():
    rewards = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1))
    bad = Prompt(index=7, text="q", prompt_ids=(1,), metadata={"rm_type": "mathh"})
    with pytest.raises(ConfigError, match="metadata 'rm_type' of prompt 7 'mathh'"):
        rewards.check_prompts([bad])


def test_reward_key_and_group_rm(tmp_path, monkeypatch):
    (tmp_path / "rm.py").write_text(
        "def named(prompt, response, label):\n"
        "    return {'acc': float(response == label), 'len': len(response)}\n"
        "def ranked(prompt, responses, label):\n"
        "    order = sorted(range(len(responses)), key=lambda i: len(responses[i]))\n"
        "    return [float(order.index(i)) for i in range(len(responses))]\n")
    monkeypatch.chdir(tmp_path)
    keyed = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, custom_rm_path="rm.py:named", reward_key="len"))
    assert score(keyed, [sample("4"), sample("444")], 2) == [1.0, 3.0]
    unkeyed = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, custom_rm_path="rm.py:named"))
    with pytest.raises(RewardError, match="--reward-key"):
        score(unkeyed, [sample("4")], 1)
    missing = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, custom_rm_path="rm.py:named", reward_key="f1"))
    with pytest.raises(RewardError, match="'acc', 'len'"):
        score(missing, [sample("4")], 1)
    group = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, custom_rm_path="rm.py:ranked", group_rm=True))
    # one call per group: rank by length within each group of 3
    assert score(group, [sample("aaa"), sample("a"), sample("aa"), sample("b"), sample("bb"), sample("")], 3) == \
        [2.0, 0.0, 1.0, 1.0, 2.0, 0.0]


def test_reward_timeout_fails_only_the_sample_and_names_it(tmp_path, monkeypatch):
    # --reward-timeout through Rewards: the hung call scores 0.0 and is reported
    (tmp_path / "rm.py").write_text("import time\n"
                                    "def slow(prompt, response, label):\n"
                                    "    if response == 'hang':\n"
                                    "        time.sleep(30)\n"
                                    "    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    timed_out = []
    rewards = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, custom_rm_path="rm.py:slow"), timeout_s=0.3,
                      on_timeout=timed_out.append)
    samples = [sample("ok"), sample("hang"), sample("ok")]
    t0 = time.monotonic()
    assert score(rewards, samples, 3) == [1.0, 0.0, 1.0]
    assert time.monotonic() - t0 < 5 and timed_out == [samples[1]]


def test_an_eval_datasets_reward_replaces_the_runs_but_not_a_samples_own_type():
    rewards = Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, rm_type="math"))
    exact = rewards.for_type("exact_match", flag="--eval-config dataset 'x'")
    samples = [sample(" 4.0"), sample("\\boxed{4}", metadata={"rm_type": "boxed_math"})]
    asyncio.run(rewards.score(samples, 2, default=exact))
    assert [s.reward for s in samples] == [0.0, 1.0]     # " 4.0" is not "4" exactly; the sample's type wins
    assert score(rewards, [sample(" 4.0")], 1) == [1.0]  # without it, math: 4.0 == 4


# --- remote_rm against a fake service ---------------------------------------------------------------

class FakeService:
    """/score answers {"acc", "len"}; /number a number; /flaky 503 for the first `fail` requests;
    /slow sleeps; /refuse 400; /text is not JSON."""

    def __init__(self, fail: int = 2, delay: float = 2.0):
        self.fail, self.delay, self.hits = fail, delay, {}
        app = web.Application()
        for name in ("score", "number", "flaky", "slow", "refuse", "text"):
            app.router.add_post(f"/{name}", getattr(self, name))
        self.runner = web.AppRunner(app)

    async def __aenter__(self):
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()

    def _hit(self, request) -> int:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        return self.hits[request.path]

    async def score(self, request):
        self._hit(request)
        body = await request.json()
        return web.json_response({"acc": float(body["response"] == body["label"]), "len": len(body["response"]),
                                  "prompt": body["prompt"]})

    async def number(self, request):
        self._hit(request)
        return web.json_response(0.25)

    async def flaky(self, request):
        if self._hit(request) <= self.fail:
            return web.Response(status=503, text="warming up")
        return web.json_response(1.0)

    async def slow(self, request):
        self._hit(request)
        await asyncio.sleep(self.delay)
        return web.json_response(1.0)

    async def refuse(self, request):
        self._hit(request)
        return web.Response(status=400, text="missing field")

    async def text(self, request):
        self._hit(request)
        return web.Response(text="oops")


def remote_rewards(url: str, **kw) -> Rewards:
    options = {"rm_retry_backoff_s": 0.01, **kw}
    return Rewards(RolloutConfig(n_samples_per_prompt=8, batch_size=1, rm_type="remote_rm", rm_url=url, **options))


def test_remote_reward_posts_prompt_response_label_and_reads_the_key():
    async def main():
        async with FakeService() as svc:
            rewards = remote_rewards(f"{svc.url}/score", reward_key="acc")
            await rewards.check_services()
            samples = [sample("4"), sample("5")]
            await rewards.score(samples, 2)
            plain = remote_rewards(f"{svc.url}/number")
            await plain.score([s2 := sample("x")], 1)
            await rewards.close()
            await plain.close()
            return [s.reward for s in samples], s2.reward, svc.hits

    rewards, number, hits = asyncio.run(main())
    assert rewards == [1.0, 0.0] and number == 0.25 and hits["/score"] == 2


def test_remote_reward_retries_transient_failures_with_backoff():
    async def main(retries):
        async with FakeService(fail=2) as svc:
            remote = RemoteReward(f"{svc.url}/flaky", timeout_s=5, max_retries=retries, backoff_s=0.05)
            t0 = time.monotonic()
            try:
                return await remote(P, "x", "y"), svc.hits["/flaky"], time.monotonic() - t0
            finally:
                await remote.close()

    value, hits, elapsed = asyncio.run(main(3))
    assert value == 1.0 and hits == 3 and elapsed >= 0.05 + 0.1      # waited 0.05 then 0.1 s
    with pytest.raises(RuntimeError, match=r"2 attempts failed \(--rm-max-retries 1\); last: HTTP 503: warming up"):
        asyncio.run(main(1))


def test_remote_reward_timeout_per_request():
    async def main():
        async with FakeService(delay=3.0) as svc:
            rewards = remote_rewards(f"{svc.url}/slow", rm_timeout_s=0.2, rm_max_retries=1)
            t0 = time.monotonic()
            try:
                await rewards.score([sample("x")], 1)
            finally:
                await rewards.close()
                hits, elapsed = svc.hits["/slow"], time.monotonic() - t0
            return hits, elapsed

    with pytest.raises(RewardError, match=r"remote_rm.*2 attempts failed.*no answer within --rm-timeout 0.2s"):
        asyncio.run(main())


def test_remote_reward_does_not_retry_a_refusal_or_a_non_json_answer():
    async def main(path):
        async with FakeService() as svc:
            remote = RemoteReward(f"{svc.url}/{path}", max_retries=3, backoff_s=0.01)
            try:
                await score_group(remote, P, ["x"], "y")
            finally:
                await remote.close()
                assert svc.hits[f"/{path}"] == 1

    with pytest.raises(RewardError, match="HTTP 400 \\(not retried\\): missing field"):
        asyncio.run(main("refuse"))
    with pytest.raises(RewardError, match="not JSON"):
        asyncio.run(main("text"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_service_that_is_down_is_a_clear_start_up_error():
    url = f"http://127.0.0.1:{free_port()}/score"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"--rm-url {url}: the reward service does not answer.*start it"):
        asyncio.run(check_reachable(url, timeout_s=1.0, attempts=2, backoff_s=0.01))
    assert time.monotonic() - t0 < 5


def test_a_service_going_down_mid_run_fails_the_reward_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/score"

    async def main():
        rewards = remote_rewards(url, rm_max_retries=1)
        try:
            await rewards.score([sample("x")], 1)
        finally:
            await rewards.close()

    with pytest.raises(RewardError, match=f"--rm-url {url}: 2 attempts failed.*Connect"):
        asyncio.run(main())
