"""The math recipe (examples/math): its prompts, its Qwen3 command line and its CPU config."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

from miles.config.flags import parse_flags
from miles.rollout.math_grading import VerifierPool

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math"
# loaded by path under a name of its own: the arithmetic example's make_data.py has the same module name
_spec = importlib.util.spec_from_file_location("math_example_make_data", EXAMPLE / "make_data.py")
make_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_data)

QWEN3_4B_CONFIG = {"model_type": "qwen3", "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
                   "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
                   "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True, "vocab_size": 151936}


def rows(name: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in open(EXAMPLE / "data" / f"{name}.jsonl")]


def test_the_committed_prompts_are_what_make_data_writes(tmp_path):
    make_data.write(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / "data" / name).read_text(), name
    train, eval_ = rows("train"), rows("eval")
    assert (len(train), len(eval_)) == (320, 64)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    assert all(r["prompt"].endswith("within \\boxed{}.") for r in train + eval_)
    labels = " ".join(r["label"] for r in train)
    for form in ("\\frac{", "\\sqrt{", "\\pi", "\\infty", "\\%", "^\\circ", "x^2+"):
        assert form in labels, form


def test_every_eval_label_is_read_by_the_verifier():
    """Each label equals itself by math-verify (not the inline check): the verifier parses all of them."""
    pool = VerifierPool(processes=1)
    try:
        labels = [r["label"] for r in rows("eval")]

        async def grade_all() -> list[bool | None]:
            return await asyncio.gather(*(pool.equivalent(x, x) for x in labels))

        verdicts = asyncio.run(grade_all())
    finally:
        pool.close()
    assert [x for x, v in zip(labels, verdicts) if v is not True] == []


def qwen3_command(tmp_path: Path) -> list[str]:
    model = tmp_path / "Qwen3-4B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    script = (EXAMPLE / "run-qwen3-4b.sh").read_text()
    line = script[script.index("miles train \\") + len("miles train"):].replace("\\\n", " ")
    line = line.replace('"$MODEL"', str(model)).replace("$HERE", str(EXAMPLE)).replace("$OUT", str(tmp_path / "out"))
    assert "$" not in line, line
    return shlex.split(line)


def test_the_qwen3_command_line_is_taken_as_miles_means_it(tmp_path):
    cfg, _ = parse_flags(qwen3_command(tmp_path))
    assert cfg.rollout.rm_type == "deepscaler" and cfg.data.apply_chat_template
    assert (cfg.data.input_key, cfg.data.label_key) == ("prompt", "label")
    assert cfg.eval.n_samples_per_prompt == 8 and cfg.eval.log_passrate      # pass@1 .. pass@8


def test_the_cpu_config_parses_with_the_recipes_reward(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg, _ = parse_flags(["--config", str(EXAMPLE / "cpu.yaml"), "--hf-checkpoint", str(tmp_path)])
    assert cfg.rollout.rm_type == "deepscaler" and cfg.data.apply_chat_template
    assert Path(cfg.data.prompt_data).resolve() == EXAMPLE / "data" / "train.jsonl"
