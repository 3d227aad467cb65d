"""A tiny random Qwen2 causal LM plus a char-level tokenizer, written to a folder in HF format.

Tests build it in a tmp dir (about 100 KB, milliseconds once transformers is imported) and load it like any checkpoint:
`AutoModelForCausalLM.from_pretrained(path)`, `AutoTokenizer.from_pretrained(path)`.

Vocabulary (32 ids): 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>, then one id per character of `CHARS`
(digits, arithmetic signs, space and a few letters), so math-style prompts such as "12+7=" tokenize
one character per id; characters outside `CHARS` are dropped. The tokenizer adds no special tokens.
"""

from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = "0123456789+-*/=? abcdefghijk"
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
assert VOCAB_SIZE == 32
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # byte-level symbols ("Ġ" for space), as Qwen2's tokenizer expects: AutoTokenizer loads any
    # qwen2 checkpoint's tokenizer.json through Qwen2Tokenizer, which would drop a plain " " entry
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS.replace(" ", "Ġ")))}
    # BPE without merges = one token per character
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS,
                                  pad_token=PAD, unk_token=UNK)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def make_tiny_model(path: str | Path, seed: int = 0) -> str:
    """Write a random tiny Qwen2ForCausalLM (fp32, tied embeddings) and its tokenizer to `path`.

    The same `seed` gives the same weights. Returns `path` as a string.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True,
        max_position_embeddings=256, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
        # the default init (std 0.02) makes near-uniform next-token distributions; a larger scale
        # gives peaked ones, so greedy decoding, EOS stops and logprob changes show in a few tokens
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


# Tiny configs of the other families a run serves, with the parts that set them apart from Qwen2:
# Qwen3's per-head q/k RMSNorm, no q/k/v bias and head_dim != hidden / heads; Llama 3's `llama3` RoPE
# scaling (a short original context, so the scaled frequencies show within a few tokens), tied or not
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 16}


def tiny_config(family: str, *, tied: bool = True, **overrides):
    """The HF config of a tiny `family` model ("qwen2", "qwen3", "llama3", "qwen3_moe") over this vocabulary."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=tied,
                  max_position_embeddings=256, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if family == "qwen2":
        return Qwen2Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1,
                              "intermediate_size": 64, **overrides})
    if family == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 16, "rope_theta": 10000.0, **overrides})
    if family == "llama3":
        return LlamaConfig(**{**common, "head_dim": 8, "rope_theta": 500.0, "rope_scaling": dict(LLAMA3_ROPE),
                              **overrides})
    if family == "qwen3_moe":      # layer 0 dense (mlp_only_layers), 1-2 four experts each, top-2 renormalised
        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3, "head_dim": 16, "rope_theta": 10000.0,
                                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0],
                                 **overrides})
    raise ValueError(f"unknown tiny family {family!r}: use qwen2, qwen3, llama3 or qwen3_moe")


def make_tiny_family(path: str | Path, family: str, *, tied: bool = True, seed: int = 0, scale: float = 0.3,
                     **overrides) -> str:
    """Write a random tiny model of `family` (fp32) and the char-level tokenizer to `path` (`overrides`:
    config fields, e.g. num_hidden_layers).

    Matrices are drawn N(0, scale) (peaked next-token distributions, as `make_tiny_model`); the
    norms' weights N(1, 0.1), so that a norm a forward forgot to apply changes the result."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, tied=tied, **overrides))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, scale)
                else:
                    p.normal_(1.0, 0.1)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)
