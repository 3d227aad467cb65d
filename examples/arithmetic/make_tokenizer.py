"""Character-level tokenizer for the arithmetic example, saved as a HF fast tokenizer.

One token per character of the task alphabet, plus `<pad>`, `<bos>`, `<eos>` and `<unk>`. Encoding
adds no special tokens (no `<bos>`), so every path a data loader may take (`add_special_tokens` on or
off, chat template tokenized or not) gives the same ids; the model was warm-started on exactly those
ids. Generation ends with `<eos>`. `AutoTokenizer.from_pretrained(folder)` loads the result offline.

The chat template joins the messages' `content` strings and adds nothing else, so
`apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=False,
add_generation_prompt=True)` returns `"12+7="`: `--apply-chat-template` is a no-op on this task and
the model sees exactly the prompts it was warm-started on.

    python examples/arithmetic/make_tokenizer.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)            # ids 0..3, in this order
ALPHABET = "0123456789+-=*/ ()?."          # characters of the task, ids 4..
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer; ids depend only on SPECIALS and ALPHABET."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; WordLevel then maps it to its id.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()          # join characters back without spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", model_max_length=64,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, folder: str | Path) -> None:
    """`save_pretrained`, naming the class `PreTrainedTokenizerFast`, which transformers 4.x also
    knows (5.x writes its own alias, `TokenizersBackend`)."""
    tok.save_pretrained(folder)
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python examples/arithmetic/make_tokenizer.py OUT_DIR")
    save_tokenizer(build_tokenizer(), argv[0])
    print(f"tokenizer saved to {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
