"""SFT data: prompt/response rows, the response closed with EOS, rows without a response reported."""

import json

import pytest

from miles.config import ConfigError, DataConfig
from miles.data.sft import load_sft_data
from tests.tiny_model import EOS_ID, _tokenizer


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_responses_are_tokenized_and_end_with_eos(tmp_path):
    tok = _tokenizer()
    path = write(tmp_path / "sft.jsonl", [{"input": "1+2=", "response": "3"}, {"input": "4+5=", "response": "9"}])
    prompts, responses = load_sft_data(DataConfig(rollout_shuffle=True, prompt_data=path), tok)
    assert [p.text for p in prompts] == ["1+2=", "4+5="]
    three = tok("3", add_special_tokens=False)["input_ids"]
    assert responses[0] == (*three, EOS_ID) and len(responses[1]) == 2


def test_rows_without_a_response_are_named(tmp_path):
    path = write(tmp_path / "sft.jsonl", [{"input": "1+2=", "answer": "3"}, {"input": "4+5=", "response": "9"}])
    with pytest.raises(ConfigError, match=r"1 of 2 rows \(row 1\) have no 'response' for --response-key.*SFT needs a response"):
        load_sft_data(DataConfig(rollout_shuffle=True, prompt_data=path), _tokenizer())
    with pytest.raises(ConfigError, match="none of the 2 rows has 'reply' for --response-key; a row has keys"):   # no row has the key at all
        load_sft_data(DataConfig(rollout_shuffle=True, prompt_data=path, response_key="reply"), _tokenizer())
