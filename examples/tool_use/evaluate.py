"""Measure a tool-use model the way the recipe's evals do, in this process (no Ray): the embedded
engine, miles' multi-turn generation with the calculator, the task's reward.

    python examples/tool_use/evaluate.py MODEL_DIR [--temperature T] [--n N]

prints pass@1 (greedy by default) and how often the model called the calculator, on data/eval.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVAL = HERE / "data" / "eval.jsonl"
MAX_RESPONSE_LEN = 24
MAX_TURNS = 2


def generate_config():
    from miles.config import GenerateConfig

    return GenerateConfig(execute_tool_function_path=f"{HERE / 'tools.py'}:execute",
                          tool_specs_path=str(HERE / "tool_specs.json"), max_turns=MAX_TURNS, tool_timeout_s=5.0)


def evaluate(model_dir: str | Path, *, temperature: float = 0.0, n: int = 1, seed: int = 0,
             eval_path: Path = EVAL) -> dict[str, float]:
    """eval/tool/* metrics of `model_dir` on `eval_path` (pass@1, tool_calls_mean, ...)."""
    from miles.config import AlgorithmConfig, DataConfig, EvalConfig, RolloutConfig
    from miles.data.prompts import load_prompts
    from miles.rollout.engines.embedded.engine import EmbeddedEngine
    from miles.rollout.executor import RolloutExecutor

    engine = EmbeddedEngine(str(model_dir), device="cpu", dtype="float32", seed=seed)
    data = DataConfig(rollout_shuffle=True, prompt_data=str(eval_path), label_key="label", apply_chat_template=True)
    prompts = load_prompts(data, engine.tokenizer)
    rollout = RolloutConfig(n_samples_per_prompt=8, batch_size=1, max_response_len=MAX_RESPONSE_LEN, temperature=1.0,
                            custom_rm_path=f"{HERE / 'task.py'}:reward")
    executor = RolloutExecutor(
        prompts=prompts, eval_sets={"tool": prompts}, rollout=rollout, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
        eval=EvalConfig(prompt_data=(("tool", str(eval_path)),), n_samples_per_prompt=n, temperature=temperature),
        shuffle=False, tokenizer=engine.tokenizer, engines=[engine], seed=seed, generate=generate_config())
    return asyncio.run(executor.evaluate(0))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))
    metrics = evaluate(args.model_dir, temperature=args.temperature, n=args.n)
    print({k.removeprefix("eval/tool/"): round(v, 4) for k, v in metrics.items()})
