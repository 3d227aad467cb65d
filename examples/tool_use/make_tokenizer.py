"""Tokenizer of the tool-use example: characters, plus whole-word tokens for the tool-call markup.

One token per character of the task (`0-9 * + - = space`), one token each for `<tool_call>`,
`</tool_call>`, `<tool_response>`, `</tool_response>`, and two for the fixed JSON around the
calculator's argument, so a call is 10 tokens, not 60:

    <tool_call>{"name": "calc", "arguments": {"expression": "37*48"}}</tool_call><eos>
    '<tool_call>' '{"name": "calc", "arguments": {"expression": "' 3 7 * 4 8 '"}}' '</tool_call>' <eos>

The markup tokens are ordinary (not special) tokens: `decode(..., skip_special_tokens=True)` keeps
them, so the reward sees the whole trajectory. Specials: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3;
encoding adds none.

The chat template renders a user turn as its content and `=`, an assistant turn as its content and
its tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the JSON as
`tojson` writes it, which is what the model writes) and `<eos>`, and a tool turn as
`<tool_response>RESULT</tool_response>`; the generation prompt adds nothing. So the prompt of
`37*48` is `37*48=` and the tool turn after a call is `<tool_response>1776</tool_response>`.

    python examples/tool_use/make_tokenizer.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"
ARGS_OPEN = '{"name": "calc", "arguments": {"expression": "'
ARGS_CLOSE = '"}}'
WORDS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, ARGS_OPEN, ARGS_CLOSE)
ALPHABET = "0123456789*+-= "
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ m['content'] }}="
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{%- endfor -%}<eos>"
    "{%- elif m['role'] == 'tool' -%}<tool_response>{{ m['content'] }}</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + tuple(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # the markup words first (longest first), then any single character
    words = "|".join(re.escape(w) for w in sorted(SPECIALS + WORDS, key=len, reverse=True))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                  unk_token=UNK, padding_side="left", model_max_length=512)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """`save_pretrained`, naming the class `PreTrainedTokenizerFast` (transformers 4.x knows it too)."""
    tok.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/tool_use/make_tokenizer.py OUT_DIR")
    save_tokenizer(build_tokenizer(), sys.argv[1])
