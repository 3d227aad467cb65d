import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.algorithms import logprobs_from_logits
from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.rollout.engines.embedded.engine import EmbeddedEngine, EngineDisposedError
from miles.training.batch import make_train_batch
from miles.training.torch.trainer import Trainer
from miles.types import Generation, Prompt, Sample, SamplingParams
from miles.weights.hf import model_weights
from tests.tiny_model import EOS_ID, make_tiny_model

PROMPTS = [[5, 6, 14, 11, 18], [7, 8], [9, 4, 4, 4, 4, 4, 4, 4, 5], [21, 22, 20, 23]]  # lengths differ: padding
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_path):
    return EmbeddedEngine(model_path, device="cpu", seed=0)


@pytest.fixture(scope="module")
def hf_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """The plainest greedy decoder: a full forward over the whole sequence for every new token."""
    ids, lps = list(prompt), []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(logits.argmax())
        ids.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        if tok == EOS_ID:
            break
    return ids[len(prompt):], lps


def test_greedy_matches_an_unbatched_argmax_loop(engine, hf_model):
    for prompt in PROMPTS:
        gen, = engine.generate([prompt], GREEDY)
        ids, lps = reference_greedy(hf_model, prompt, GREEDY.max_new_tokens)
        assert gen.response_ids == ids
        assert max(abs(a - b) for a, b in zip(gen.logprobs, lps)) < 1e-5


def test_left_padded_batch_equals_one_by_one(engine):
    batched = engine.generate(PROMPTS, GREEDY)
    for prompt, b in zip(PROMPTS, batched):
        single, = engine.generate([prompt], GREEDY)
        assert b.response_ids == single.response_ids and b.finish_reason == single.finish_reason
        assert max(abs(x - y) for x, y in zip(b.logprobs, single.logprobs)) < 1e-5


def test_small_max_batch_size_gives_the_same_results(model_path, engine):
    small = EmbeddedEngine(model_path, device="cpu", max_batch_size=1)
    assert [g.response_ids for g in small.generate(PROMPTS, GREEDY)] == \
           [g.response_ids for g in engine.generate(PROMPTS, GREEDY)]


def test_sampled_logprobs_match_the_trainers_forward(engine, hf_model):
    # the train/infer consistency check: the trainer's view is one right-padded forward over
    # prompt + response, logprobs at temperature T aligned to tokens (what make_train_batch builds)
    params = SamplingParams(temperature=0.7, max_new_tokens=12, seed=1)
    gens = engine.generate(PROMPTS, params)
    samples = [Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(p)), group=i, response_ids=g.response_ids,
                      rollout_logprobs=g.logprobs, finish_reason=g.finish_reason, weight_version=g.weight_version)
               for i, (p, g) in enumerate(zip(PROMPTS, gens))]
    batch = make_train_batch(samples, pad_id=0)
    with torch.no_grad():
        logits = hf_model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    train_lp = logprobs_from_logits(logits, batch.tokens, 0.7)
    diff = (train_lp - batch.rollout_logprobs)[batch.loss_mask].abs()
    assert diff.numel() == sum(len(g.response_ids) for g in gens) > 0
    assert diff.max() < 1e-4


def test_temperature_sampling_is_reproducible(model_path, engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    a = EmbeddedEngine(model_path, device="cpu", seed=7).generate(PROMPTS, params)
    b = EmbeddedEngine(model_path, device="cpu", seed=7).generate(PROMPTS, params)
    c = EmbeddedEngine(model_path, device="cpu", seed=8).generate(PROMPTS, params)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]
    seeded = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    assert [g.response_ids for g in engine.generate(PROMPTS, seeded)] == \
           [g.response_ids for g in engine.generate(PROMPTS, seeded)]


def test_top_k_1_and_tiny_top_p_sample_the_argmax(engine):
    greedy = [g.response_ids for g in engine.generate(PROMPTS, GREEDY)]
    for params in (SamplingParams(temperature=1.5, top_k=1, max_new_tokens=16, seed=0),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=16, seed=0)):
        gens = engine.generate(PROMPTS, params)
        assert [g.response_ids for g in gens] == greedy
        # the logprobs are of the untruncated distribution at temperature 1.5, so below 0
        assert all(lp < -1e-3 for g in gens for lp in g.logprobs)


def _check_finish(g: Generation, stop_ids: set[int], max_new_tokens: int) -> None:
    assert len(g.logprobs) == len(g.response_ids)
    assert not stop_ids & set(g.response_ids[:-1])           # nothing generated after a stop
    if g.finish_reason == "stop":
        assert g.response_ids[-1] in stop_ids
    else:
        assert g.finish_reason == "length" and len(g.response_ids) == max_new_tokens


def test_eos_and_stop_tokens_end_a_request_early(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0)
    gens = engine.generate(PROMPTS * 4, params)
    for g in gens:
        _check_finish(g, {EOS_ID}, 40)
    assert {g.finish_reason for g in gens} == {"stop", "length"}  # both paths exercised in one batch
    # a stop token chosen from a greedy answer cuts it right there
    full, = engine.generate([PROMPTS[0]], GREEDY)
    stop = full.response_ids[3]
    cut, = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.response_ids == full.response_ids[:full.response_ids.index(stop) + 1]


def test_update_weights_changes_outputs_version_and_checksum(model_path):
    engine = EmbeddedEngine(model_path, device="cpu")
    before = engine.generate(PROMPTS, GREEDY)
    assert engine.weight_version() == 0 and {g.weight_version for g in before} == {0}
    trainer = Trainer(model_path, train=TrainConfig(lr=0.05), algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", loss_type="sft_loss"),
                      rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), device="cpu")
    samples = [Sample(prompt=Prompt(index=0, text="", prompt_ids=(5, 6)), group=0, response_ids=[7] * 8,
                      rollout_logprobs=[0.0] * 8, finish_reason="length", weight_version=0)]
    trainer.train(samples, rollout_id=0)
    assert engine.weights_checksum() != trainer.weights_checksum()
    engine.update_weights(trainer.weights(), version=1)
    assert engine.weights_checksum() == trainer.weights_checksum()
    after = engine.generate(PROMPTS, GREEDY)
    assert engine.weight_version() == 1 and {g.weight_version for g in after} == {1}
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    # a lower-precision engine matches the trainer's weights cast to its dtype
    bf16 = EmbeddedEngine(model_path, device="cpu", dtype="bfloat16")
    bf16.update_weights(trainer.weights(), version=1)
    assert bf16.weights_dtype() == torch.bfloat16
    assert bf16.weights_checksum() == trainer.weights_checksum(dtype=bf16.weights_dtype()) != trainer.weights_checksum()


def test_update_weights_rejects_a_mismatched_dict(engine, hf_model):
    weights = {name: t.clone() for name, t in model_weights(hf_model).items()}
    checksum, version = engine.weights_checksum(), engine.weight_version()
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        engine.update_weights(weights, version=5)
    assert engine.weights_checksum() == checksum and engine.weight_version() == version


def test_bad_requests_fail_with_the_reason(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], GREEDY)
    with pytest.raises(ValueError, match=r"outside \[0, 32\)"):
        engine.generate([[5, 99]], GREEDY)
    with pytest.raises(ValueError, match="256 positions"):
        engine.generate([[5] * 250], GREEDY)


def test_tokenizer_accessors(engine):
    assert engine.eos_token_id == EOS_ID and engine.pad_token_id == 0
    assert engine.decode([5, 6, 14, 11, 18, 20, EOS_ID]) == "12+7= "


def test_dispose_frees_the_model(model_path):
    engine = EmbeddedEngine(model_path, device="cpu")
    engine.dispose()
    engine.dispose()  # idempotent
    with pytest.raises(EngineDisposedError):
        engine.generate(PROMPTS, GREEDY)


def test_a_stop_string_ends_the_response_at_the_token_that_completes_it(engine):
    long = SamplingParams(temperature=0.0, max_new_tokens=24)
    free, = engine.generate([PROMPTS[0]], long)
    text = engine.decode(free.response_ids)
    assert len(free.response_ids) >= 4, "the tiny model should talk for a few tokens"
    stop = text[2:4]                        # two characters the free response produces at tokens 2-3
    first = text.index(stop) + len(stop)    # the stop string is complete after this many characters
    got, = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=24, stop=(stop,)))
    assert got.finish_reason == "stop"
    assert got.response_ids == free.response_ids[:len(got.response_ids)]      # the same tokens, cut short
    assert engine.decode(got.response_ids).endswith(stop) and len(engine.decode(got.response_ids)) == first
    assert len(got.logprobs) == len(got.response_ids)


def test_max_context_len_caps_each_response_by_its_prompt(engine):
    # 8 tokens of context: the 5-token prompt gets 3 new tokens, the 2-token one 6 (max_new_tokens 16)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=tuple(range(32)), max_context_len=8)
    no_stop = SamplingParams(temperature=0.0, max_new_tokens=16, max_context_len=8)
    free = engine.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=16))
    capped = engine.generate([PROMPTS[0], PROMPTS[1]], no_stop)
    for prompt, f, c in zip(PROMPTS, free, capped):
        budget = 8 - len(prompt)
        assert len(c.response_ids) == min(budget, len(f.response_ids))
        assert c.response_ids == f.response_ids[:budget]
        assert c.finish_reason == ("length" if len(f.response_ids) > budget else f.finish_reason)
    assert all(len(g.response_ids) == 1 for g in engine.generate([PROMPTS[0]], params))  # any token stops
    with pytest.raises(ValueError, match="leaves no room for a response under max_context_len 5"):
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, max_context_len=5))


def test_memory_release_is_a_no_op_on_the_cpu_and_the_run_s_hand_off_sequence_works(engine):
    # the run's sequence (miles.cluster.memory): release every tag, resume "weights" before the push,
    # then the rest; on the CPU there is nothing to give back, and answers and health stay as they were
    before = engine.generate(PROMPTS, GREEDY)
    engine.release_memory(("weights", "kv_cache", "cuda_graph"))
    assert engine.health() == {"busy": False, "since_progress_s": 0.0}
    engine.resume_memory(("weights",))
    engine.resume_memory(("kv_cache", "cuda_graph"))
    assert engine.generate(PROMPTS, GREEDY) == before
