"""Prompt loading (JSONL/parquet, chat template, BOS rule, errors) and the resumable prompt iterator."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from structlog.testing import capture_logs
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from miles.config import ConfigError, DataConfig
from miles.data.iterator import PromptIterator
from miles.data.prompts import MAX_REPORTED_ERRORS, load_prompts
from miles.types import Prompt

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "user": 3, ":": 4, "assistant": 5,
         "what": 6, "is": 7, "2+2": 8, "one": 9, "two": 10, "three": 11}
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def make_tokenizer(*, adds_bos: bool = True, chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: one id per whitespace-separated word, as in VOCAB."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds_bos:  # Llama-style: the post-processor puts BOS in front
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def write_jsonl(path: Path, lines: list[object | str]) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(prompt_data=str(path), **kw)


ROWS = [
    {"input": "what is 2+2", "label": 4, "meta": {"source": "a"}},
    {"input": "one two", "label": "x"},
    {"input": "three", "meta": {"k": [1, 2]}},
]


# ---- loading ------------------------------------------------------------------------------------

def test_jsonl_rows_become_tokenized_prompts(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    prompts = load_prompts(cfg(path, label_key="label", metadata_key="meta"), tokenizer)
    # "what is 2+2" -> words 6 7 8, BOS 1 in front (the tokenizer adds BOS by convention)
    assert prompts[0] == Prompt(index=0, text="what is 2+2", prompt_ids=(1, 6, 7, 8), label="4",
                                metadata={"source": "a"})
    assert prompts[1].prompt_ids == (1, 9, 10) and prompts[1].label == "x" and prompts[1].metadata == {}
    assert prompts[2].label is None and prompts[2].metadata == {"k": [1, 2]}


def test_parquet_gives_the_same_prompts_as_jsonl(tmp_path, tokenizer):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    pq.write_table(pa.table({"input": [r["input"] for r in ROWS], "label": ["4", "x", None]}),
                   tmp_path / "d.parquet")
    from_jsonl = load_prompts(cfg(jsonl, label_key="label"), tokenizer)
    from_parquet = load_prompts(cfg(tmp_path / "d.parquet", label_key="label"), tokenizer)
    assert from_parquet == from_jsonl


def test_parquet_struct_metadata_is_a_dict(tmp_path, tokenizer):
    pq.write_table(pa.table({"q": ["one"], "m": [{"source": "b", "level": 3}]}), tmp_path / "d.parquet")
    [prompt] = load_prompts(cfg(tmp_path / "d.parquet", input_key="q", metadata_key="m"), tokenizer)
    assert prompt.metadata == {"source": "b", "level": 3}


def test_chat_template_renders_string_and_message_inputs_with_a_single_bos(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "one"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "what is 2+2"}, {"input": messages}])
    first, second = load_prompts(cfg(path, apply_chat_template=True), tokenizer)
    assert first.text == "<s> user : what is 2+2 assistant :"
    # the template wrote <s> (1) itself: no second BOS; then user : what is 2+2 assistant :
    assert first.prompt_ids == (1, 3, 4, 6, 7, 8, 5, 4)
    assert second.prompt_ids == (1, 3, 4, 9, 5, 4)


def test_tokenizer_that_does_not_add_bos_gets_none(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "one two"}])
    [prompt] = load_prompts(cfg(path), make_tokenizer(adds_bos=False))
    assert prompt.prompt_ids == (9, 10)  # GPT-2/Qwen style: bos_token defined but never prepended


def test_chat_template_missing_is_a_config_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "one"}])
    with pytest.raises(ConfigError, match="has no chat template; drop --apply-chat-template"):
        load_prompts(cfg(path, apply_chat_template=True), make_tokenizer(chat_template=None))


def test_row_errors_are_collected_with_line_numbers_and_fixes(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"input": "one"},               # line 1: fine
        '{"input": "two"',              # line 2: malformed
        {"prompt": "three", "id": 1},   # line 3: missing key
        "",                             # line 4: blank, skipped
        {"input": 7},                   # line 5: not a string
        [1, 2],                         # line 6: not an object
        {"input": [{"role": "user", "content": "one"}]},  # line 7: messages without the template
    ])
    with pytest.raises(ConfigError) as info:
        load_prompts(cfg(path), tokenizer)
    problems = info.value.problems
    assert len(problems) == 5
    assert all(p.startswith(f"{path}: ") for p in problems)
    assert "line 2: malformed JSON" in problems[0]
    assert "line 5: input must be a string, got int" in problems[1]
    assert "line 6: expected a JSON object" in problems[2]
    assert "line 7:" in problems[3] and "--apply-chat-template" in problems[3]
    # rows without the key: one line, a count and the rows, like every missing-key error
    assert problems[4] == (f"{path}: 1 of 6 rows (line 3) have no 'input' for --input-key; a row has keys "
                           "['id', 'prompt']; set --input-key to one of them")


def test_many_bad_rows_report_the_first_ten_and_a_count(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": i} for i in range(25)])
    with pytest.raises(ConfigError) as info:
        load_prompts(cfg(path), tokenizer)
    problems = info.value.problems
    assert len(problems) == MAX_REPORTED_ERRORS + 1
    assert "line 10:" in problems[9] and problems[-1].endswith("and 15 more bad rows")


def test_a_missing_key_is_one_line_with_a_count_and_the_first_rows(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"x": i} if i % 2 else {"input": "a"} for i in range(25)])
    with pytest.raises(ConfigError) as info:
        load_prompts(cfg(path), tokenizer)
    assert info.value.problems == [f"{path}: 12 of 25 rows (lines 2, 4, 6, 8, 10, ...) have no 'input' for "
                                   "--input-key; a row has keys ['x']; set --input-key to one of them"]
    path = write_jsonl(tmp_path / "e.jsonl", [{"x": i} for i in range(3)])
    with pytest.raises(ConfigError, match=r"none of the 3 rows has 'input' for --input-key"):
        load_prompts(cfg(path), tokenizer)


def test_parquet_errors_name_the_row(tmp_path, tokenizer):
    pq.write_table(pa.table({"input": ["one", None, "two"]}), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match=r"d.parquet: row 2: input must be a string, got NoneType"):
        load_prompts(cfg(tmp_path / "d.parquet"), tokenizer)


def test_parquet_without_the_input_column_lists_the_columns(tmp_path, tokenizer):
    pq.write_table(pa.table({"question": ["one"], "answer": ["1"]}), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match=r"no column 'input'.*\['question', 'answer'\]"):
        load_prompts(cfg(tmp_path / "d.parquet"), tokenizer)


def test_label_key_absent_from_every_row_is_reported(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "one", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"the only row has no 'label' for --label-key; a row has keys "
                                          r"\['answer', 'input'\]; set --label-key to one of them or drop it"):
        load_prompts(cfg(path, label_key="label"), tokenizer)


@pytest.mark.parametrize("name, match", [
    ("d.csv", r"d.csv: unsupported file type '.csv'; accepted suffixes are .jsonl, .parquet"),
    ("missing.jsonl", r"missing.jsonl: file not found"),
])
def test_bad_paths_are_config_errors(tmp_path, tokenizer, name, match):
    (tmp_path / "d.csv").write_text("input\none\n")
    with pytest.raises(ConfigError, match=match):
        load_prompts(cfg(tmp_path / name), tokenizer)


def test_empty_dataset_is_a_config_error(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="the dataset is empty"):
        load_prompts(cfg(tmp_path / "d.jsonl"), tokenizer)


def test_max_prompt_len_drops_long_prompts_and_logs_how_many(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with capture_logs() as logs:
        # lengths with BOS: 4, 3, 2 tokens
        prompts = load_prompts(cfg(path, max_prompt_len=3), tokenizer)
    assert [p.index for p in prompts] == [1, 2]
    [dropped] = [e for e in logs if e["event"] == "prompts_dropped"]
    assert dropped["num_dropped"] == 1 and dropped["num_kept"] == 2


def test_max_prompt_len_that_drops_everything_is_a_config_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"all 3 prompts are longer than --max-prompt-len 1 tokens \(the shortest has 2\)"):
        load_prompts(cfg(path, max_prompt_len=1), tokenizer)


# ---- iterator -----------------------------------------------------------------------------------

def prompts_n(n: int) -> list[Prompt]:
    return [Prompt(index=i, text=str(i), prompt_ids=(i,)) for i in range(n)]


def indices(batch: list[Prompt]) -> list[int]:
    return [p.index for p in batch]


def test_unshuffled_batches_wrap_into_the_next_epoch():
    it = PromptIterator(prompts_n(5), 2, shuffle=False, seed=0)
    assert it.num_batches_per_epoch == 2  # floor(5 / 2)
    seen = []
    for _ in range(4):
        seen.append((indices(it.next_batch()), it.epoch, it.offset))
    # 5 prompts in batches of 2: [0,1] [2,3] [4 | 0] [1,2]; the third batch crosses into epoch 1
    assert seen == [([0, 1], 0, 2), ([2, 3], 0, 4), ([4, 0], 1, 1), ([1, 2], 1, 3)]


def test_a_smaller_batch_takes_the_next_prompts_and_no_more():
    # --partial-rollout: a round that continues buffered groups draws only the rest of its prompts
    it = PromptIterator(prompts_n(5), 2, shuffle=False, seed=0)
    assert [indices(it.next_batch(1)), indices(it.next_batch(0)), indices(it.next_batch(9)), indices(it.next_batch())] \
        == [[0], [], [1, 2], [3, 4]]       # at most the batch size


def test_shuffle_is_a_deterministic_permutation_per_epoch():
    def first_two_epochs(seed: int) -> list[int]:
        it = PromptIterator(prompts_n(6), 3, shuffle=True, seed=seed)
        return [i for _ in range(4) for i in indices(it.next_batch())]

    order = first_two_epochs(seed=1)
    assert order == first_two_epochs(seed=1)
    assert sorted(order[:6]) == sorted(order[6:]) == list(range(6))
    assert order[:6] != order[6:]  # epochs draw different permutations
    assert order != first_two_epochs(seed=2)


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5])
def test_resumed_iterator_yields_the_batches_of_the_uninterrupted_one(consumed):
    reference = PromptIterator(prompts_n(7), 3, shuffle=True, seed=11)
    expected = [indices(reference.next_batch()) for _ in range(consumed + 6)][consumed:]

    interrupted = PromptIterator(prompts_n(7), 3, shuffle=True, seed=11)
    for _ in range(consumed):
        interrupted.next_batch()
    state = json.loads(json.dumps(interrupted.state_dict()))  # as it would be checkpointed

    resumed = PromptIterator(prompts_n(7), 3, shuffle=True, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert [indices(resumed.next_batch()) for _ in range(6)] == expected


def test_resume_over_a_different_dataset_is_refused():
    state = PromptIterator(prompts_n(7), 3, shuffle=True, seed=0).state_dict()
    with pytest.raises(ConfigError, match="saved over 7 prompts but the dataset now has 6"):
        PromptIterator(prompts_n(6), 3, shuffle=True, seed=0).load_state_dict(state)


def test_batch_larger_than_the_dataset_names_both_numbers():
    with pytest.raises(ConfigError, match=r"--rollout-batch-size 8 is larger than the dataset \(5 prompts"):
        PromptIterator(prompts_n(5), 8, shuffle=False, seed=0)
