"""SFT data (`--loss-type sft_loss`): prompt/response pairs, which the rollout executor serves as
samples instead of generating responses.

Rows are read like prompt rows (`miles.data.prompts`: JSONL or parquet, the prompt under
`--input-key`, templated and tokenized the same way, bad rows reported together); the response text
is under `--response-key`. It is tokenized without special tokens and closed with the tokenizer's
EOS, so the model learns to stop where the data stops.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from miles.config import ConfigError, DataConfig
from miles.data.prompts import load_prompts, missing_key_problem
from miles.types import Prompt


def load_sft_data(cfg: DataConfig, tokenizer: Any) -> tuple[list[Prompt], dict[int, tuple[int, ...]]]:
    """(prompts, responses): `responses[prompt.index]` is the response's token ids, EOS last.

    Each prompt keeps its response text as its `label`.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ConfigError("--loss-type sft_loss: the tokenizer has no EOS token to end the responses with; "
                          "use a tokenizer that defines eos_token")
    try:   # the response is read as the row's label; errors name the response's flag
        prompts = load_prompts(replace(cfg, label_key=cfg.response_key), tokenizer)
    except ConfigError as exc:
        raise ConfigError([p.replace("--label-key", "--response-key").replace(" or drop it", "")
                           for p in exc.problems]) from exc
    missing = [f"row {p.index + 1}" for p in prompts if p.label is None]
    if missing:
        raise ConfigError(missing_key_problem(cfg.prompt_data, "--response-key", cfg.response_key, missing,
                                              len(prompts), None) + " (SFT needs a response in every row)")
    responses = {p.index: tuple(tokenizer(p.label, add_special_tokens=False)["input_ids"]) + (eos,) for p in prompts}
    return prompts, responses
