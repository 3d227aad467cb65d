"""--opd-type sglang's contract with the teacher servers, against the fake SGLang server (SGLang's HTTP
contract, no model): miles' scoring request (the whole sequence as input_ids, no new token, every input
token's logprob), nothing SGLang would ignore, the response tokens' logprobs read off the answer's
tail, and each sample routed to the teacher its metadata names (else 'default')."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.rollout.engines.sglang.api import SGLangResponseError, parse_input_logprobs
from miles.rollout.opd_teacher import TeacherServers
from miles.types import Prompt, Sample
from tests.fakes import fake_calls
from tests.tiny_model import make_tiny_model
from tests.unit.test_fake_sglang import post, start_fake

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p, url = start_fake(make_tiny_model(tmp_path_factory.mktemp("teacher") / "model"))
    yield url
    p.dispose()


def sample(prompt: tuple[int, ...], response: list[int], **metadata) -> Sample:
    return Sample(prompt=Prompt(index=0, text="", prompt_ids=prompt), group=0, response_ids=response,
                  rollout_logprobs=[-1.0] * len(response), finish_reason="stop", weight_version=0,
                  metadata=dict(metadata))


def test_the_teacher_scores_each_response_token_with_miles_request(server):
    samples = [sample((5, 6, 7), [8, 9, 2]), sample((5,), [10, 2]), sample((4, 4), [11])]
    samples[2].status = "aborted"                        # not trained on: not sent
    teachers = TeacherServers({"default": server + "/generate"})

    async def go():
        try:
            return await teachers.score(samples)
        finally:
            await teachers.close()

    metrics = asyncio.run(go())
    assert metrics["opd_teacher_samples"] == 2.0 and samples[2].teacher_logprobs is None
    calls = fake_calls(server, "/generate")[-2:]
    for call in calls:
        body = call["body"]
        assert call["status"] == 200 and call["ignored"] == []           # nothing SGLang would drop silently
        assert body["sampling_params"] == {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False}
        assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    assert sorted(c["body"]["input_ids"] for c in calls) == sorted([[5, 6, 7, 8, 9, 2], [5, 10, 2]])
    for s in samples[:2]:
        # the server's own answer for the same request: its input logprobs, the first (a null) dropped,
        # the last len(response) kept
        status, answer = post(server + "/generate", {"input_ids": s.tokens, "return_logprob": True,
                                                     "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
        entries = answer["meta_info"]["input_token_logprobs"]
        assert status == 200 and entries[0][0] is None and len(entries) == len(s.tokens)
        assert s.teacher_logprobs == [e[0] for e in entries[-s.response_length:]]
        assert all(-4.02 < lp < 0 for lp in s.teacher_logprobs)


def test_an_answer_of_other_tokens_or_too_short_is_refused():
    good = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.5, 8, None], [-0.25, 2, None]]}}
    assert parse_input_logprobs(good, [8, 2], url="u") == [-0.5, -0.25]
    with pytest.raises(SGLangResponseError, match="not the response's"):
        parse_input_logprobs(good, [9, 2], url="u")
    with pytest.raises(SGLangResponseError, match="input_token_logprobs for 3 response tokens"):
        parse_input_logprobs(good, [5, 8, 2], url="u")
    with pytest.raises(SGLangResponseError, match="input_token_logprobs"):
        parse_input_logprobs({"output_ids": [], "meta_info": {}}, [8], url="u")


def test_samples_go_to_the_teacher_their_metadata_names_else_the_default():
    teachers = TeacherServers.from_flags(("math=http://m:1/generate", "http://d:2"), "opd_teacher")
    assert teachers.url_for(sample((5,), [2], opd_teacher="math")) == "http://m:1/generate"
    assert teachers.url_for(sample((5,), [2], opd_teacher="code")) == "http://d:2"
    assert teachers.url_for(sample((5,), [2])) == "http://d:2"
    only_math = TeacherServers.from_flags(("math=http://m:1",), "domain")
    assert only_math.url_for(sample((5,), [2], domain="math")) == "http://m:1"
    with pytest.raises(ValueError, match=r"metadata\['domain'\] = 'code' names no teacher"):
        only_math.url_for(sample((5,), [2], domain="code"))


def test_a_rollout_scored_by_the_teacher_server_carries_its_logprobs_into_the_advantages(server):
    from miles.config import AlgorithmConfig
    from miles.training.batch import make_train_batch
    from miles.training.terms import PolicyObjective
    from tests.unit.test_executor_algorithms import ScriptedEngine, executor

    algorithm = AlgorithmConfig(use_opd=True, opd_type="sglang", opd_teacher_urls=(server,), opd_kl_coef=0.5,
                                use_rollout_logprobs=True)
    ex = executor(ScriptedEngine(lambda p, k: [3 + k, 2]), algorithm=algorithm)   # reward 0 each: A = 0

    async def go():
        try:
            return await ex.generate(0)
        finally:
            await ex.dispose()

    batch_out = asyncio.run(go())
    assert batch_out.metrics["opd_teacher_samples"] == 4.0
    for s in batch_out.samples:
        assert s.teacher_logprobs is not None and len(s.teacher_logprobs) == 2 and s.advantage == 0.0
    obj = PolicyObjective(algorithm, executor(ScriptedEngine(None))._cfg)
    batch = make_train_batch(batch_out.samples, 0)
    obj.prepare(batch, torch.zeros_like(batch.rollout_logprobs), None, None)   # the trainer's: not the student's
    # pure OPD from the engine's logprobs (-0.5 each): A' = -0.5 * (-0.5 - teacher) on the response tokens
    expected = [[-0.5 * (-0.5 - t) for t in s.teacher_logprobs] for s in batch_out.samples]
    assert torch.allclose(batch.advantages[:, 1:], torch.tensor(expected))
