"""The arithmetic example's data, tokenizer and committed base model (examples/arithmetic)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic"
sys.path.insert(0, str(EXAMPLE))

import make_data  # noqa: E402
from miles.training.batch import make_train_batch  # noqa: E402
from make_base_model import ModelSpec, SftSpec, build_model, sft_trainer, to_sample  # noqa: E402
from make_tokenizer import build_tokenizer, save_tokenizer  # noqa: E402
from task import final_number, greedy_responses, load_jsonl, reward  # noqa: E402

DATA = EXAMPLE / "data"
BASE = EXAMPLE / "base_model"


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, str]]]:
    return {name: load_jsonl(DATA / f"{name}.jsonl") for name in ("train", "eval", "sft")}


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: the machine is shared, and SFT determinism is defined per thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(BASE), AutoTokenizer.from_pretrained(BASE)


def test_sloppy_sum_drops_carries_with_the_given_probability():
    # 57+68: units 7+8=15 (write 5, carry 1); tens 5+6(+1)=11 or 12 (write 1 or 2, carry 1).
    # Keeping both carries gives 125; dropping both gives 15 (units 5, tens 5+6=11 -> 1, no hundreds).
    assert make_data.sloppy_sum(57, 68, random.Random(0), forget=0.0) == 125
    assert make_data.sloppy_sum(57, 68, random.Random(0), forget=1.0) == 15
    assert make_data.sloppy_sum(0, 0, random.Random(0), forget=0.5) == 0
    assert make_data.sloppy_sum(12, 7, random.Random(0), forget=1.0) == 19   # no carry to drop


def test_committed_data_is_what_make_data_writes(rows):
    assert rows == make_data.make_splits()


def test_eval_is_large_disjoint_from_train_and_labelled_with_true_sums(rows):
    assert len(rows["eval"]) >= 200
    assert not {r["input"] for r in rows["eval"]} & {r["input"] for r in rows["train"]}
    for r in rows["eval"] + rows["train"]:
        a, b = r["input"].removesuffix("=").split("+")
        assert r["label"] == str(int(a) + int(b)), r


def test_sft_answers_train_prompts_with_a_teacher_that_is_often_wrong(rows):
    assert [r["input"] for r in rows["sft"]] == [r["input"] for r in rows["train"]]
    right = sum(s["response"] == t["label"] for s, t in zip(rows["sft"], rows["train"]))
    assert 0.2 < right / len(rows["sft"]) < 0.6


def test_reward_reads_the_last_integer():
    assert final_number("12 then 19") == "19"
    assert final_number("-7") == "-7"
    assert final_number("none") is None
    assert reward("19", "19") == 1.0
    assert reward("119", "19") == 0.0
    assert reward("", "0") == 0.0


def test_tokenizer_round_trips_and_chat_template_is_a_no_op(base):
    _, tok = base
    text = "86+57=143"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)                 # one token per character, no <bos> added
    assert tok.decode(ids) == text
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    chat = [{"role": "user", "content": "86+57="}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "86+57="
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok.get_vocab() == build_tokenizer().get_vocab()


def test_base_model_is_small_and_loads(base):
    model, tok = base
    size = sum(p.stat().st_size for p in BASE.iterdir())
    assert size <= 10 * 2**20, f"{size} bytes"
    assert (BASE / "model.safetensors").exists()
    assert model.config.vocab_size == len(tok)


def test_base_greedy_accuracy_is_low_but_not_zero(base, rows):
    model, tok = base
    sample = rows["eval"][:50]
    answers = greedy_responses(model, tok, [r["input"] for r in sample])
    accuracy = sum(reward(a, r["label"]) for a, r in zip(answers, sample)) / len(sample)
    assert 0.15 <= accuracy <= 0.55, accuracy       # 0.38 on this slice, 0.376 on all 500 (README)


def test_base_samples_often_hold_the_answer_greedy_misses(base, rows):
    """GRPO's premise: where greedy is wrong, a right answer is among 8 samples at temperature 1."""
    model, tok = base
    sample = rows["eval"][:100]
    greedy = greedy_responses(model, tok, [r["input"] for r in sample])
    missed = [r for r, g in zip(sample, greedy) if not reward(g, r["label"])]
    torch.manual_seed(0)
    enc = tok([r["input"] for r in missed for _ in range(8)], return_tensors="pt", padding=True,
              padding_side="left", add_special_tokens=False)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    found = [any(reward(texts[8 * i + j], r["label"]) for j in range(8)) for i, r in enumerate(missed)]
    assert sum(found) / len(found) >= 0.25, sum(found) / len(found)    # 0.63 when measured


def test_sft_loss_covers_the_response_and_eos_only():
    tok = build_tokenizer()
    sample = to_sample(tok, {"input": "12+7=", "response": "19"}, index=0)
    assert tok.decode(list(sample.prompt.prompt_ids) + sample.response_ids) == "12+7=19<eos>"
    batch = make_train_batch([sample, to_sample(tok, {"input": "1+1=", "response": "2"}, index=1)],
                             tok.pad_token_id)
    assert batch.tokens.shape == (2, 8)                     # "12+7=" + "19" + <eos>
    assert batch.loss_mask[0].tolist() == [False] * 5 + [True] * 3
    assert batch.loss_mask.sum().item() == 3 + 2
    assert batch.attention_mask[1].tolist() == [1] * 6 + [0] * 2


def _tiny_sft(seed: int, folder: Path) -> tuple[list[dict[str, float]], torch.nn.Module]:
    """Five steps of the project trainer on 8 rows, from a 1-layer model saved to `folder`."""
    tok = build_tokenizer()
    build_model(ModelSpec(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2), tok,
                seed).save_pretrained(folder)
    save_tokenizer(tok, folder)
    trainer = sft_trainer(folder, SftSpec(steps=100, batch_size=8, lr=1e-2, warmup_steps=2, seed=seed))
    samples = [to_sample(tok, {"input": f"{a}+{a}=", "response": str(2 * a)}, index=a) for a in range(8)]
    return [trainer.train(samples, rollout_id=step) for step in range(5)], trainer.model


def test_sft_with_the_trainer_starts_near_uniform_learns_and_follows_the_schedule(tmp_path):
    metrics, _ = _tiny_sft(seed=0, folder=tmp_path)
    losses = [m["loss"] for m in metrics]
    # Initial weights are N(0, 0.02): logits are ~0, so the NLL is ~ln(vocab) = ln 24 = 3.178.
    assert losses[0] == pytest.approx(3.178, abs=0.05)
    assert losses[-1] < losses[0] - 0.5
    assert all(m["num_steps"] == 1 for m in metrics)        # one optimizer step per call
    # Warmup 2: 1e-2 * 1/2, 1e-2; then cosine over steps 2..100: p = (step - 2) / 98, so step 2 has
    # p = 0 (1e-2) and step 3 has 1e-2 * (1 + cos(pi / 98)) / 2 = 0.99974e-2.
    assert [m["lr"] for m in metrics[:4]] == pytest.approx([5e-3, 1e-2, 1e-2, 0.99974e-2], rel=1e-5)


def test_sft_is_deterministic_for_a_seed(tmp_path):
    (metrics_a, model_a), (metrics_b, model_b) = (_tiny_sft(seed=3, folder=tmp_path / "a"),
                                                  _tiny_sft(seed=3, folder=tmp_path / "b"))
    assert [m["loss"] for m in metrics_a] == [m["loss"] for m in metrics_b]
    for (name, p), q in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(p, q), name
