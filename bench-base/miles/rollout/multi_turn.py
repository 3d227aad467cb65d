"""Multi-turn generation with tools: the generate function `--generate-execute-tool-function-path`
selects (or `--custom-generate-function-path miles.rollout.multi_turn:generate`).

Each turn the model answers from the whole trajectory so far (token ids in, token ids out). When its
answer holds tool calls (`--generate-tool-call-parser`), each is run by the tool executor and the
tool turn's tokens (the chat template's rendering of the tool messages, then the next generation
prompt) are appended, untrained; the model's tokens are appended as generated, trained, with the
engine's logprobs. The trajectory ends when the model answers without a tool call (completed), hits
the token budget (`--rollout-max-response-len` over the whole response, tool tokens included) or
`--generate-max-turns` (truncated). A tool that raises or hangs fails the sample (`ToolError`).

metadata: `turns` (model turns), `tool_calls` (calls answered), `tool_errors` (calls that could
not be read, answered with an error message).
"""

from __future__ import annotations

from dataclasses import replace

from miles.rollout.generation import GenerateContext
from miles.types import Sample, SamplingParams


async def generate(ctx: GenerateContext, sample: Sample, params: SamplingParams) -> Sample:
    kit = ctx.tools
    if kit is None:
        raise RuntimeError("multi-turn generation needs --generate-execute-tool-function-path (the tool executor)")
    budget = params.max_new_tokens
    prompt = list(sample.prompt.prompt_ids)
    sample.metadata.update(turns=0, tool_calls=0, tool_errors=0)
    sample.status = "truncated"                 # unless a turn ends it on its own
    for _ in range(ctx.config.max_turns):
        left = budget - len(sample.response_ids)
        if left < 1:
            break
        g = await ctx.generate(prompt + sample.response_ids, replace(params, max_new_tokens=left))
        sample.append(g.response_ids, g.logprobs, trained=True, routed_experts=g.routed_experts)
        sample.finish_reason = g.finish_reason
        sample.metadata["turns"] += 1
        if g.finish_reason == "abort":
            sample.status = "aborted"
            break
        calls = kit.parse(ctx.tokenizer.decode(g.response_ids, skip_special_tokens=False))
        if g.finish_reason == "length" or not calls:
            sample.status = "truncated" if g.finish_reason == "length" else "completed"
            break
        messages = [await kit.run(call) for call in calls]
        sample.metadata["tool_calls"] += len(calls)
        sample.metadata["tool_errors"] += sum(call.error is not None for call in calls)
        turn = kit.turn_ids(ctx.tokenizer, messages)
        if len(sample.response_ids) + len(turn) >= budget:
            break                               # no room for the tool turn and an answer after it
        sample.append(turn, trained=False)
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample
