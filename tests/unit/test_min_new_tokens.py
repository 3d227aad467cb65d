"""--eval-min-new-tokens in the engines (SGLang's min_new_tokens): EOS and the stop tokens cannot be sampled
before a response has that many tokens; the embedded engine and FastEngine (CPU, eager) alike."""

import pytest
import torch

from miles.rollout.engines.embedded.engine import EmbeddedEngine
from miles.rollout.engines.fast.engine import FastEngine
from miles.rollout.engines.fast.sampling import bar_stops
from miles.types import SamplingParams
from tests.tiny_model import EOS_ID, make_tiny_model

PROMPTS = [[5, 6, 14, 11, 18], [7, 8], [9, 4, 4, 4, 4], [21, 22, 20, 23], [6, 6], [12, 13, 14]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module", params=["embedded", "fast"])
def engine(request, model_path):
    cls = EmbeddedEngine if request.param == "embedded" else FastEngine
    return cls(model_path, device="cpu", seed=0, max_batch_size=4)   # fast: 6 prompts, 4 slots, refills


def test_bar_stops_masks_the_stop_columns_of_the_marked_rows_only():
    logits = torch.zeros(2, 4)
    bar_stops(logits, torch.tensor([True, False]), torch.tensor([False, True, False, True]))
    assert logits.tolist() == [[0, float("-inf"), 0, float("-inf")], [0, 0, 0, 0]]


def test_no_stop_token_before_min_new_tokens(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    firsts = [g.response_ids[0] for g in engine.generate(PROMPTS, greedy)]
    # every prompt's greedy first token made a stop token: without a minimum each response is that one token
    stops = tuple(sorted(set(firsts)))
    cut = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=stops))
    assert [(len(g.response_ids), g.finish_reason) for g in cut] == [(1, "stop")] * len(PROMPTS)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=stops, min_new_tokens=3),
                   SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=stops, min_new_tokens=3, seed=1)):
        for g in engine.generate(PROMPTS, params):
            assert len(g.response_ids) >= 3 and len(g.logprobs) == len(g.response_ids)
            assert not set(g.response_ids[:3]) & {*stops, EOS_ID}
            assert all(lp > float("-inf") for lp in g.logprobs)
            assert g.finish_reason == "length" or g.response_ids[-1] in {*stops, EOS_ID}


def test_min_new_tokens_past_the_cap_gives_the_cap(engine):
    gens = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5, min_new_tokens=50, seed=2))
    assert all(len(g.response_ids) == 5 and g.finish_reason == "length" and EOS_ID not in g.response_ids for g in gens)


def test_a_negative_min_new_tokens_is_a_bad_request(engine):
    with pytest.raises(ValueError, match="min_new_tokens must be >= 0, got -1"):
        engine.generate(PROMPTS[:1], SamplingParams(min_new_tokens=-1))
