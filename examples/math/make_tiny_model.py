"""A tiny random Qwen3 model whose tokenizer writes LaTeX: the math recipe's CPU run (cpu.yaml).

It learns no math. It exists so that the recipe's whole path runs on a CPU in seconds: the prompts
through a Qwen3-style chat template (the assistant turn opens with `<think>`), generation, the
verifier, training and the pass@k eval. A random model would never close its thinking and box an
answer, so the verifier would never run: the weights are warm-started (`FORMAT_STEPS` steps of
next-token loss, about ten seconds on a CPU) on responses of the recipe's format,
`</think> The answer is \\boxed{X}.` with X another problem's answer, so the model writes the format
with answers that are mostly wrong (`--rm-type deepscaler` grades the box after `</think>`).

The tokenizer has one token per LaTeX command of the recipe's answers and per character of the
prompts (`<unk>` for the rest); the chat template wraps each user message as Qwen3's does.

    python examples/math/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import re
import string
import sys
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
LATEX = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "\\boxed{", "\\frac{", "\\sqrt{", "\\pi", "\\infty", "\\%", "^\\circ", "\\cdot")
CHARS = string.digits + string.ascii_letters + " {}()[]^+-*/=,.$?\n\\<>|:_"
TOKENS = (PAD, BOS, EOS, UNK, *LATEX, *CHARS)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TOKENS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    pattern = "|".join(re.escape(t) for t in sorted(LATEX, key=len, reverse=True))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pattern}|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                  padding_side="left", model_max_length=512)
    tok.chat_template = CHAT_TEMPLATE
    return tok


FORMAT_STEPS = 200


def _format_batches(tok, rows: list[dict[str, str]], seed: int, batch: int = 8):
    """Prompts of the recipe, each followed by a response of its format (tokenized once)."""
    import random

    import torch

    r = random.Random(seed)
    prompts = [tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) for row in rows]
    texts = [p + f"so</think> The answer is \\boxed{{{r.choice(rows)['label']}}}.{EOS}" for p in prompts]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    while True:
        picked = r.sample(ids, batch)
        width = max(map(len, picked))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in picked])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in picked])[:, None]).long()
        yield input_ids, mask, input_ids.masked_fill(mask == 0, -100)


def make_tiny_model(path: str | Path, seed: int = 0, data: str | Path | None = None) -> str:
    import json

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(vocab_size=len(TOKENS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=48, tie_word_embeddings=True,
                      max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tok = build_tokenizer()
    rows = [json.loads(line) for line in open(data or Path(__file__).resolve().parent / "data" / "train.jsonl")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # a model this small runs fastest on one thread
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = _format_batches(tok, rows, seed)
        for _ in range(FORMAT_STEPS):
            ids, mask, labels = next(batches)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.set_num_threads(threads)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1]))
