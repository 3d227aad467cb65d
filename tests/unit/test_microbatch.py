"""Micro-batch plans: fixed sizes, token budgets (--use-dynamic-batch-size --max-tokens-per-gpu), row selection."""

import random

import pytest
import torch

from miles.training.batch import make_train_batch
from miles.training.torch.microbatch import (HostRows, fixed_size_groups, padded_tokens, plan_micro_batches, take_rows,
                                       token_budget_groups)
from miles.types import Prompt, Sample


def test_token_budget_by_hand():
    # lengths 5, 9, 3, 9, 4 with a budget of 20: longest first (9 [1], 9 [3]) fill 18 <= 20, a third
    # row would make 3 x 9 = 27; then 5 [0], 4 [4], 3 [2]: 3 x 5 = 15 <= 20
    assert token_budget_groups([5, 9, 3, 9, 4], 20) == [[1, 3], [0, 4, 2]]


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch():
    assert token_budget_groups([50, 3, 3], 10) == [[0], [1, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_budget_partition_properties(seed):
    r = random.Random(seed)
    lengths = [r.randint(1, 300) for _ in range(r.randint(1, 200))]
    budget = r.randint(300, 5000)
    groups = token_budget_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))     # every row exactly once
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= budget
    # greedy over the sorted rows: no group could have taken the next group's first (longest) row
    for g, nxt in zip(groups, groups[1:]):
        assert (len(g) + 1) * max(lengths[i] for i in g) > budget
    assert groups == token_budget_groups(list(lengths), budget)                  # deterministic


def test_fixed_size_groups_and_bad_sizes():
    assert fixed_size_groups(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro-batch-size"):
        fixed_size_groups(5, 0)
    # --max-tokens-per-gpu >= 1 is the config's rule, stated once (tests/unit/test_check_registry.py)


def sample(i, prompt_len, response_len):
    return Sample(prompt=Prompt(index=i, text="", prompt_ids=tuple(range(1, prompt_len + 1))), group=i,
                  response_ids=[7] * response_len, rollout_logprobs=[-0.5] * response_len, finish_reason="stop",
                  weight_version=0, advantage=float(i))


def test_take_rows_selects_and_trims():
    batch = make_train_batch([sample(0, 2, 8), sample(1, 1, 2), sample(2, 3, 1)], pad_id=0)
    mb = take_rows(batch, [2, 1])
    assert mb.tokens.shape == (2, 4)                                             # longest kept row: 3 + 1
    assert mb.tokens.tolist() == [[1, 2, 3, 7], [1, 7, 7, 0]]
    assert mb.advantages[0].tolist() == [0, 0, 0, 2.0] and mb.loss_mask[1].tolist() == [False, True, True, False]
    assert padded_tokens(mb) == 8


@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_taken_from_the_host_copy_is_the_same_and_carries_its_layout(packed):
    # what the step's loop reads instead of the device: the trained tokens, the real tokens, the pack
    # and the trained positions in the forward's layout (a pack's, or the padded rows' flattened)
    rng = random.Random(4)
    data = [sample(i, rng.randint(1, 6), rng.randint(1, 9)) for i in range(7)]
    data[2] = sample(2, 3, 9)
    data[2].loss_mask = [True, False, False, True, True, False, True, True, True]    # multi-turn: tool tokens untrained
    batch = make_train_batch(data, pad_id=0)
    rows = [5, 2, 0, 6]
    assert len({len(data[r].tokens) for r in rows}) > 1          # padding worth packing away
    plain, known = take_rows(batch, rows), take_rows(batch, rows, host=HostRows.of(batch), packed=packed)
    for name in ("tokens", "loss_mask", "advantages", "attention_mask", "rollout_logprobs"):
        assert torch.equal(getattr(known, name), getattr(plain, name)), name
    assert plain.layout is None and known.layout is not None
    assert known.num_tokens == int(plain.loss_mask.sum()) == plain.num_tokens
    assert known.layout.real_tokens == int(plain.attention_mask.sum())
    if packed:
        assert known.pack() is known.layout.pack
        layout_mask = known.pack().pack(plain.loss_mask)[0]
    else:
        assert known.layout.pack is None
        layout_mask = plain.loss_mask.reshape(-1)
    assert known.layout.trained.tolist() == layout_mask.nonzero().squeeze(1).tolist()
    # a change of device drops the layout (its tensors would be on the old one)
    assert known.to("cpu").layout is None


def test_plan_uses_the_budget_only_when_set():
    batch = make_train_batch([sample(i, 2, n) for i, n in enumerate([1, 10, 2, 9])], pad_id=0)
    assert plan_micro_batches(batch.attention_mask.sum(1).tolist(), micro_batch_size=3) == [[0, 1, 2], [3]]
    groups = plan_micro_batches(batch.attention_mask.sum(1).tolist(), micro_batch_size=3,
                                max_tokens_per_gpu=24)
    assert groups == [[1, 3], [2, 0]]                                           # lengths 12, 11 | 4, 3
    assert all(padded_tokens(take_rows(batch, g)) <= 24 for g in groups)
    assert sum(take_rows(batch, g).num_tokens for g in groups) == batch.num_tokens


def test_right_padded_rows_need_no_attention_mask_under_causal_attention(tmp_path):
    # what the module docstring relies on: with right padding, a forward without the mask gives
    # the same logits on the real tokens as one with it
    from tests.tiny_model import make_tiny_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path)).eval()
    batch = make_train_batch([sample(0, 3, 5), sample(1, 2, 1), sample(2, 1, 3)], pad_id=0)
    with torch.no_grad():
        masked = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
        unmasked = model(input_ids=batch.tokens, attention_mask=None, use_cache=False).logits
    real = batch.attention_mask.bool()
    torch.testing.assert_close(unmasked[real], masked[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked[~real], masked[~real], atol=1e-3)       # padding differs: not a no-op


def test_rows_of_one_length_carry_no_pack_even_when_the_trainer_packs():
    # nothing to remove: the rows run as they are (no pack made and unmade around each attention)
    batch = make_train_batch([sample(0, 3, 9), sample(1, 5, 7), sample(2, 2, 10), sample(3, 1, 5)], pad_id=0)
    host = HostRows.of(batch)
    even, ragged = take_rows(batch, [0, 1, 2], host=host, packed=True), take_rows(batch, [0, 3], host=host, packed=True)
    assert even.pack() is None and even.layout.trained.tolist() == even.loss_mask.reshape(-1).nonzero()[:, 0].tolist()
    assert ragged.pack() is not None and ragged.pack().num_tokens == 12 + 6
