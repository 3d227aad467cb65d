"""The rollout executor: prompts → engines → rewards → groups → advantages → a RolloutBatch.

It owns the prompt iterator (its position is part of every checkpoint) and the reward function; it
uses the engines but does not own them (the run does). A plain class with async methods; the
composition root makes it an async Ray actor, and engines are anything with an awaitable
`generate(prompts, params)` — Ray actor handles in a run, plain objects in unit tests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Protocol, Sequence

import torch

from miles.algorithms import get_advantage_estimator, normalize_advantages
from miles.config import AlgorithmConfig, EvalConfig, RolloutConfig
from miles.data.iterator import PromptIterator
from miles.eval.metrics import pass_at_k
from miles.rollout.rewards import load_reward_fn, score_group
from miles.types import Generation, Prompt, RolloutBatch, Sample, SamplingParams

GenerateFn = Callable[[int, list[list[int]], SamplingParams], Awaitable[list[Generation]]]


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class RolloutExecutor:
    def __init__(self, *, prompts: list[Prompt], eval_sets: dict[str, list[Prompt]], rollout: RolloutConfig,
                 algorithm: AlgorithmConfig, eval: EvalConfig, shuffle: bool, tokenizer: Decoder,  # noqa: A002
                 engines: Sequence[Any]):
        self._cfg, self._eval_cfg = rollout, eval
        self._iterator = PromptIterator(prompts, rollout.batch_size, shuffle=shuffle, seed=rollout.seed)
        self._eval_sets = eval_sets
        self._tokenizer = tokenizer
        self._engines = list(engines)
        self._reward_fn = load_reward_fn(rollout.rm_type, rollout.custom_rm_path)
        self._advantages = _estimator(algorithm)
        self._pending: tuple[int, list[Prompt]] | None = None   # prompts of a rollout not yet delivered

    # -- state ----------------------------------------------------------------------------------
    def num_batches_per_epoch(self) -> int:
        return self._iterator.num_batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"iterator": self._iterator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._iterator.load_state_dict(state["iterator"])

    def set_engines(self, engines: Sequence[Any]) -> None:
        """Use these engines from now on (after the run restarted a dead one)."""
        self._engines = list(engines)

    def dispose(self) -> None:
        """Drop the engine handles. The engines themselves are the run's, torn down after this."""
        self._engines.clear()

    # -- rollout --------------------------------------------------------------------------------
    async def generate(self, rollout_id: int) -> RolloutBatch:
        """Sample n responses for the next batch of prompts, score them and compute advantages."""
        t0 = time.monotonic()
        if self._pending is None or self._pending[0] != rollout_id:
            self._pending = (rollout_id, self._iterator.next_batch())
        prompts = self._pending[1]
        n = self._cfg.n_samples_per_prompt
        params = SamplingParams(temperature=self._cfg.temperature, top_p=self._cfg.top_p, top_k=self._cfg.top_k,
                                max_new_tokens=self._cfg.max_response_len, seed=self._seed(rollout_id))
        samples = await self._sample(prompts, n, params)
        gen_s = time.monotonic() - t0
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        for s, a in zip(samples, self._advantages(rewards, n).tolist()):
            s.advantage = a
        metrics = rollout_metrics(samples, n, rollout_id)
        metrics.update(gen_time_s=gen_s, gen_tokens_per_s=metrics["gen_tokens"] / max(gen_s, 1e-9),
                       epoch=self._iterator.epoch)
        self._pending = None
        return RolloutBatch(rollout_id=rollout_id, samples=samples, n_samples_per_prompt=n, metrics=metrics)

    async def generate_split(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """`generate` as (samples, metrics): as a two-return Ray call the samples go from the object
        store straight to the trainer while the driver reads only the metrics."""
        batch = await self.generate(rollout_id)
        return batch.samples, batch.metrics

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Every eval dataset once: mean reward, truncation and pass@k for k in {1, n}."""
        e, out = self._eval_cfg, {}
        params = SamplingParams(temperature=e.temperature, top_p=1.0 if e.temperature == 0 else self._cfg.top_p,
                                max_new_tokens=e.max_response_len or self._cfg.max_response_len,
                                seed=self._seed(rollout_id) + 7)
        for name, prompts in self._eval_sets.items():
            t0 = time.monotonic()
            samples = await self._sample(prompts, e.n_samples_per_prompt, params)
            out.update({f"eval/{name}/{k}": v for k, v in eval_metrics(samples, e.n_samples_per_prompt).items()})
            out[f"eval/{name}/time_s"] = time.monotonic() - t0
        return out

    async def _sample(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[Sample]:
        """n samples per prompt, spread over the engines in contiguous slices, then scored per group."""
        requests = [list(p.prompt_ids) for p in prompts for _ in range(n)]
        generations = await self._generate_on_engines(requests, params)
        samples = []
        for i, g in enumerate(generations):
            prompt = prompts[i // n]
            samples.append(Sample(prompt=prompt, group=i // n, response_ids=g.response_ids,
                                  rollout_logprobs=g.logprobs, finish_reason=g.finish_reason,
                                  weight_version=g.weight_version,
                                  response_text=self._tokenizer.decode(g.response_ids, skip_special_tokens=True)))
        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        scores = await asyncio.gather(*(score_group(self._reward_fn, g[0].prompt, [s.response_text for s in g],
                                                    g[0].prompt.label) for g in groups))
        for group, group_scores in zip(groups, scores):
            for s, r in zip(group, group_scores):
                s.reward = float(r)
        return samples

    async def _generate_on_engines(self, requests: list[list[int]], params: SamplingParams) -> list[Generation]:
        k = len(self._engines)
        size = -(-len(requests) // k)
        slices = [requests[i * size:(i + 1) * size] for i in range(k)]
        calls = [_call(engine.generate, chunk, _with_seed(params, params.seed, i))
                 for i, (engine, chunk) in enumerate(zip(self._engines, slices)) if chunk]
        return [g for part in await asyncio.gather(*calls) for g in part]

    def _seed(self, rollout_id: int) -> int:
        # a function of (seed, rollout id) only, so a resumed run samples what the uninterrupted one did
        return (self._cfg.seed * 1_000_003 + rollout_id * 1_009) % (2**31)


def _with_seed(params: SamplingParams, seed: int | None, engine: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, seed=None if seed is None else seed + engine)


async def _call(method: Any, *args: Any) -> Any:
    """Call an engine method: a Ray actor method (`.remote`), an async function or a plain one."""
    remote = getattr(method, "remote", None)
    result = remote(*args) if remote is not None else method(*args)
    return await result if asyncio.isfuture(result) or hasattr(result, "__await__") else result


def _estimator(algorithm: AlgorithmConfig) -> Callable[[torch.Tensor, int], torch.Tensor]:
    name = algorithm.advantage_estimator
    if name in ("grpo", "gspo"):
        return get_advantage_estimator(name, std_norm=not algorithm.disable_grpo_std_normalization)
    base = get_advantage_estimator(name)
    if name == "reinforce_plus_plus_baseline":   # REINFORCE++-baseline whitens over the whole batch
        return lambda rewards, n: normalize_advantages(base(rewards, n))
    return base


def rollout_metrics(samples: list[Sample], n: int, rollout_id: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
    groups = rewards.view(-1, n)
    return {
        "rollout_id": rollout_id,
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "response_len_mean": lengths.mean().item(),
        "response_len_max": lengths.max().item(),
        "truncated_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "zero_std_group_ratio": (groups.std(dim=1, unbiased=False) == 0).double().mean().item(),
        "gen_tokens": float(lengths.sum().item()),
        "num_samples": float(len(samples)),
        "weight_version_min": float(min(s.weight_version for s in samples)),
        "staleness_max": float(max(rollout_id - s.weight_version for s in samples)),
    }


def eval_metrics(samples: list[Sample], n: int) -> dict[str, float]:
    correct = [sum(s.reward > 0 for s in samples[i:i + n]) for i in range(0, len(samples), n)]
    out = {"reward_mean": sum(s.reward for s in samples) / len(samples),
           "truncated_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
           "pass@1": sum(pass_at_k(n, c, 1) for c in correct) / len(correct)}
    if n > 1:
        out[f"pass@{n}"] = sum(pass_at_k(n, c, n) for c in correct) / len(correct)
    return out
