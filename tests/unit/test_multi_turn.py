"""Multi-turn generation with tools: the default generate function's flow with a scripted engine
(tool call, tool turn, answer; tool errors, hangs, unknown tools, the turn and token budgets), and
trajectories from the real embedded engine whose masks and logprobs line up with the trainer's
recomputation. Uses the tool-use example's tokenizer and chat template."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles.config import AlgorithmConfig, EvalConfig, GenerateConfig, RolloutConfig, TrainConfig
from miles.rollout.executor import RolloutExecutor
from miles.rollout.generation import EngineBatcher, GenerateContext, new_sample, run_samples
from miles.rollout.multi_turn import generate as multi_turn
from miles.rollout.tools import ToolError, ToolKit, parse_tool_call_tags
from miles.types import Generation, Prompt, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_use_{name}", ROOT / "examples/tool_use" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOK = _example("make_tokenizer").build_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def call_text(expression: str, name: str = "calc") -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": {"expression": expression}})}</tool_call>'


class ScriptedEngine:
    """Turn k of a trajectory (k = tool responses in the prompt so far) answers script[k]."""

    def __init__(self, script: list[str], finish: str = "stop"):
        self.script, self.finish, self.calls = script, finish, []

    async def generate(self, prompts, params, caps=None):
        caps = caps or [params.max_new_tokens] * len(prompts)
        self.calls.append(list(caps))
        out = []
        for p, cap in zip(prompts, caps):
            turn = TOK.decode(p).count("</tool_response>")
            answer = ids(self.script[min(turn, len(self.script) - 1)]) + [EOS]
            finish = self.finish if len(answer) <= cap else "length"
            answer = answer[:cap]
            out.append(Generation(answer, [-0.25] * len(answer), finish, 0))
        return out


def run_multi_turn(engine, execute, *, max_turns=3, budget=40, timeout=5.0, specs=None):
    kit = ToolKit(execute=execute, specs=specs, timeout_s=timeout)
    cfg = GenerateConfig(max_turns=max_turns, execute_tool_function_path="x:y")

    async def main():
        async def call(i, prompts, params, caps):
            return await engine.generate(prompts, params, caps)

        batcher = EngineBatcher(1, call, max_batch=64)
        prompt = Prompt(index=0, text="37*48=", prompt_ids=tuple(ids("37*48=")), label="1776")

        def make_ctx():
            return GenerateContext(batcher, tokenizer=TOK, rollout=RolloutConfig(n_samples_per_prompt=8, batch_size=1), config=cfg, tools=kit,
                                   evaluation=False)

        params = SamplingParams(max_new_tokens=budget)
        return (await run_samples(multi_turn, make_ctx, [new_sample(prompt, 0)], params, cfg, batcher,
                                  num_engines=1, decode=lambda x: TOK.decode(x)))[0]

    return asyncio.run(main())


async def calculator(name, arguments):
    return str(eval(arguments["expression"]))  # noqa: S307 - the test's own expressions


def test_tool_call_then_answer():
    engine = ScriptedEngine([call_text("37*48"), "1776"])
    s = run_multi_turn(engine, calculator)
    call, turn, answer = ids(call_text("37*48")) + [EOS], ids("<tool_response>1776</tool_response>"), ids("1776") + [EOS]
    assert s.status == "completed" and s.error is None
    assert s.response_ids == call + turn + answer
    assert s.loss_mask == [1] * len(call) + [0] * len(turn) + [1] * len(answer)
    assert s.rollout_logprobs == [-0.25] * len(call) + [0.0] * len(turn) + [-0.25] * len(answer)
    assert s.metadata == {"turns": 2, "tool_calls": 1, "tool_errors": 0}
    assert s.response_text.endswith("<tool_response>1776</tool_response>1776")
    # the second turn's cap is what the first left of the budget
    assert engine.calls == [[40], [40 - len(call) - len(turn)]]


def test_a_tool_that_raises_fails_the_sample_with_the_error():
    async def broken(name, arguments):
        raise ConnectionError("calculator service unreachable")

    s = run_multi_turn(ScriptedEngine([call_text("37*48"), "1776"]), broken)
    assert s.status == "failed"
    assert s.error.startswith("ToolError: tool calc(") and "ConnectionError: calculator service unreachable" in s.error
    assert s.response_ids == ids(call_text("37*48")) + [EOS] and not s.trainable


def test_a_tool_that_hangs_fails_the_sample_after_the_tool_timeout():
    async def hangs(name, arguments):
        await asyncio.sleep(60)

    s = run_multi_turn(ScriptedEngine([call_text("37*48"), "1776"]), hangs, timeout=0.2)
    assert s.status == "failed" and "did not answer within --generate-tool-timeout 0.2s" in s.error


def test_unknown_tools_and_unreadable_calls_are_answered_not_failed():
    kit = ToolKit(execute=calculator, specs=[{"type": "function", "function": {"name": "calc"}}])
    unknown = asyncio.run(kit.run(parse_tool_call_tags(call_text("1+1", name="search"))[0]))
    assert unknown == {"role": "tool", "name": "search", "content": "error: unknown tool 'search'; the tools are ['calc']"}
    [bad] = parse_tool_call_tags("<tool_call>12</tool_call>")
    assert "could not read the tool call '12'" in asyncio.run(kit.run(bad))["content"]
    # in a trajectory: the unreadable call is answered (an error message in the tool turn), then the answer
    s = run_multi_turn(ScriptedEngine(["<tool_call>12</tool_call>", "2"]), calculator, budget=400)
    assert s.status == "completed" and s.metadata == {"turns": 2, "tool_calls": 1, "tool_errors": 1}


def test_max_turns_ends_a_trajectory_on_its_tool_turn_as_truncated():
    s = run_multi_turn(ScriptedEngine([call_text("1+1")]), calculator, max_turns=2)
    assert s.status == "truncated" and s.metadata["turns"] == 2 and s.loss_mask[-1] == 0


def test_the_token_budget_truncates():
    s = run_multi_turn(ScriptedEngine([call_text("37*48"), "1776"]), calculator, budget=6)
    assert s.status == "truncated" and len(s.response_ids) == 6 and s.finish_reason == "length"


def test_parser_reads_arguments_given_as_a_json_string():
    [call] = parse_tool_call_tags('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    assert call.name == "calc" and call.arguments == {"expression": "2*3"} and call.error is None


def test_a_template_that_rewrites_history_is_refused():
    class Rewriting:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
            return ("[%d]" % len(messages)) + "".join(m.get("content") or "" for m in messages)

    kit = ToolKit(execute=calculator)
    with pytest.raises(ToolError, match="cannot be appended"):
        kit.turn_ids(Rewriting(), [{"role": "tool", "name": "calc", "content": "4"}])


# --- the real engine and the trainer ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tool_model")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    _example("make_tokenizer").save_tokenizer(TOK, path)
    return str(path)


GEN = '''
from dataclasses import replace
from miles.rollout.tools import ToolKit

KIT = ToolKit(execute=None)

async def two_turns(ctx, sample, params):
    """A model turn, a tool turn from the chat template, another model turn: whatever the model says."""
    prompt = list(sample.prompt.prompt_ids)
    g = await ctx.generate(prompt, replace(params, max_new_tokens=5))
    sample.append(g.response_ids, g.logprobs, trained=True)
    sample.append(KIT.turn_ids(ctx.tokenizer, [{"role": "tool", "name": "calc", "content": "1776"}]), trained=False)
    g = await ctx.generate(prompt + sample.response_ids, replace(params, max_new_tokens=4))
    sample.append(g.response_ids, g.logprobs, trained=True)
    return sample
'''


@pytest.mark.parametrize("engine_name", ["embedded", "fast"])
def test_real_trajectories_line_up_with_the_trainers_recomputation(tool_model, tmp_path, monkeypatch, engine_name):
    # FastEngine too (what CUDA runs get, whose turns each carry their own cap)
    from miles.rollout.engines.embedded.engine import EmbeddedEngine
    from miles.rollout.engines.fast.engine import FastEngine
    from miles.training.batch import make_train_batch
    from miles.training.torch.trainer import Trainer

    (tmp_path / "gen.py").write_text(GEN)
    monkeypatch.chdir(tmp_path)
    engine = (EmbeddedEngine if engine_name == "embedded" else FastEngine)(tool_model, device="cpu", dtype="float32",
                                                                          seed=0)
    prompts = [Prompt(index=i, text=t, prompt_ids=tuple(ids(t)), label="0") for i, t in
               enumerate(["37*48=", "12*3=", "99*99="])]
    rollout = RolloutConfig(batch_size=3, n_samples_per_prompt=2, max_response_len=24, temperature=1.0,
                            rm_type="deterministic_random")
    executor = RolloutExecutor(prompts=prompts, eval_sets={}, rollout=rollout, algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                               eval=EvalConfig(temperature=0.0), shuffle=False, tokenizer=TOK, engines=[engine], seed=0,
                               generate=GenerateConfig(custom_generate_function_path="gen.py:two_turns"))
    samples = asyncio.run(executor.generate(0)).samples
    assert all(s.status == "completed" and 0 in s.loss_mask for s in samples)
    trainer = Trainer(tool_model, train=TrainConfig(micro_batch_size=2), algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                      rollout=rollout, device="cpu")
    batch = trainer.prepare(make_train_batch(samples, trainer.pad_id))
    mask = batch.loss_mask
    for i, s in enumerate(samples):            # the batch's mask is the samples' (prompt and padding off)
        p = len(s.prompt.prompt_ids)
        assert mask[i, p:p + s.response_length].int().tolist() == s.loss_mask
    diff = (batch.old_logprobs - batch.rollout_logprobs).abs()
    # on the model's tokens the engine's logprobs are the trainer's (float32, same weights) ...
    assert float(diff[mask].max()) < 1e-4
    # ... while on the tool tokens the trainer's are far from anything the engine reported
    tool = torch.zeros_like(mask)
    for i, s in enumerate(samples):
        p = len(s.prompt.prompt_ids)
        tool[i, p:p + s.response_length] = torch.tensor([m == 0 for m in s.loss_mask])
    assert float(batch.old_logprobs[tool].abs().min()) > 0.1
