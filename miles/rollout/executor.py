"""The rollout executor: prompts → engines → rewards → groups → filters → shaping → advantages → a RolloutBatch.

It owns the prompt iterator (its position is part of every checkpoint) and the reward function; it
uses the engines but does not own them (the run does). A plain class with async methods; the
composition root makes it an async Ray actor, and engines are anything with an awaitable
`generate(prompts, params)` — Ray actor handles in a run, plain objects in unit tests.

How a rollout's samples are collected is chosen once, at construction:
- plain: `--rollout-batch-size` prompts, `--n-samples-per-prompt` responses each;
- dynamic sampling (`--dynamic-sampling-filter-path`, DAPO): rounds of `--over-sampling-batch-size`
  prompts until `--rollout-batch-size` groups pass the filter (see `miles.rollout.filters`); after
  `--dynamic-sampling-max-rounds` rounds, filtered-out groups fill what is missing;
- SFT (`--loss-type sft_loss`): the next prompts with their responses from the data, no engine.
Then DAPO's overlong penalty (`--overlong-buffer-len`) is added to the rewards, and sequence-level
advantages are computed (grpo, gspo, rloo, reinforce_plus_plus_baseline). Token-level estimators
(ppo, reinforce_plus_plus) need the reference's KL and the critic's values, so the trainer computes
them (`Trainer.prepare_rollout`); their samples leave here with advantage 0.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any, Awaitable, Callable, Protocol, Sequence

import torch

from miles.algorithms import TOKEN_LEVEL_ESTIMATORS, get_advantage_estimator, normalize_advantages, overlong_penalty
from miles.config import AlgorithmConfig, EvalConfig, RolloutConfig
from miles.data.iterator import PromptIterator
from miles.eval.metrics import pass_at_k
from miles.rollout.filters import load_filter
from miles.rollout.rewards import load_reward_fn, score_group
from miles.types import Generation, Prompt, RolloutBatch, Sample, SamplingParams

Collected = tuple[list[Sample], dict[str, float]]   # a rollout's samples, grouped, and how they were collected


# sampling seeds are a function of (run seed, rollout id, round) only, so a resumed run samples what the
# uninterrupted one did; distinct primes keep nearby runs, rollouts and rounds from sharing a seed
RUN_SEED_PRIME, ROLLOUT_SEED_PRIME, ROUND_SEED_STEP = 1_000_003, 1_009, 104_729
EVAL_SEED_OFFSET = 7           # an eval at step r does not replay rollout r's sampling
SEED_RANGE = 2**31             # seeds stay non-negative 32-bit ints


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class RolloutExecutor:
    def __init__(self, *, prompts: list[Prompt], eval_sets: dict[str, list[Prompt]], rollout: RolloutConfig,
                 algorithm: AlgorithmConfig, eval: EvalConfig, shuffle: bool, tokenizer: Decoder,  # noqa: A002
                 engines: Sequence[Any], seed: int, sft_responses: dict[int, tuple[int, ...]] | None = None):
        self._cfg, self._eval_cfg = rollout, eval
        dynamic = rollout.dynamic_sampling_filter_path
        per_round = (rollout.over_sampling_batch_size or rollout.batch_size) if dynamic else rollout.batch_size
        self._base_seed = seed                # RunConfig.rollout_seed: prompt order and sampling
        self._iterator = PromptIterator(prompts, per_round, shuffle=shuffle, seed=seed)
        self._eval_sets = eval_sets
        self._tokenizer = tokenizer
        self._engines = list(engines)
        self._reward_fn = load_reward_fn(rollout.rm_type, rollout.custom_rm_path)
        self._advantages = _estimator(algorithm)
        self._sft_responses = sft_responses
        self._filter = load_filter(dynamic) if dynamic else None
        self._collect: Callable[[int], Awaitable[Collected]] = (
            self._sft_samples if algorithm.loss_type == "sft_loss" else
            self._dynamic_samples if dynamic else self._plain_samples)
        self._shape = (partial(overlong_penalty, max_len=rollout.max_response_len, buffer_len=rollout.overlong_buffer_len,
                               factor=rollout.overlong_penalty_factor) if rollout.overlong_buffer_len else None)
        self._pending: tuple[int, list[list[Prompt]]] | None = None   # prompts drawn for a rollout not yet delivered

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
        """Collect the rollout's samples (generated and scored, or read for SFT), shape the rewards and
        compute sequence-level advantages."""
        t0 = time.monotonic()
        samples, collect_metrics = await self._collect(rollout_id)
        gen_s = time.monotonic() - t0
        n = self._group_size
        if self._shape is not None:
            lengths = torch.tensor([s.response_length for s in samples])
            penalties = self._shape(lengths).tolist()
            for s, p in zip(samples, penalties):
                s.reward += p
            collect_metrics["overlong_penalty_mean"] = sum(penalties) / len(penalties)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        for s, a in zip(samples, self._advantages(rewards, n).tolist()):
            s.advantage = a
        metrics = rollout_metrics(samples, n, rollout_id)
        metrics.update(collect_metrics, gen_time_s=gen_s, gen_tokens_per_s=metrics["gen_tokens"] / max(gen_s, 1e-9),
                       epoch=self._iterator.epoch)
        self._pending = None
        return RolloutBatch(rollout_id=rollout_id, samples=samples, n_samples_per_prompt=n, metrics=metrics)

    @property
    def _group_size(self) -> int:
        return 1 if self._sft_responses is not None else self._cfg.n_samples_per_prompt

    def _prompts(self, rollout_id: int, round_: int) -> list[Prompt]:
        """The prompts of round `round_` of this rollout: drawn once, so a rollout retried after an
        engine restart re-serves the same prompts."""
        if self._pending is None or self._pending[0] != rollout_id:
            self._pending = (rollout_id, [])
        drawn = self._pending[1]
        if round_ == len(drawn):
            drawn.append(self._iterator.next_batch())
        return drawn[round_]

    def _params(self, rollout_id: int, round_: int = 0) -> SamplingParams:
        c = self._cfg
        seed = (self._seed(rollout_id) + round_ * ROUND_SEED_STEP) % SEED_RANGE
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.max_response_len, seed=seed)

    async def _plain_samples(self, rollout_id: int) -> Collected:
        return await self._sample(self._prompts(rollout_id, 0), self._group_size, self._params(rollout_id)), {}

    async def _dynamic_samples(self, rollout_id: int) -> Collected:
        """DAPO dynamic sampling: rounds of prompts until `batch_size` groups pass the filter."""
        n, want = self._cfg.n_samples_per_prompt, self._cfg.batch_size
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        rounds = 0
        while len(kept) < want and rounds < self._cfg.dynamic_sampling_max_rounds:
            samples = await self._sample(self._prompts(rollout_id, rounds), n, self._params(rollout_id, rounds))
            for group in (samples[i:i + n] for i in range(0, len(samples), n)):
                (kept if self._filter(group) else dropped).append(group)
            rounds += 1
        fill = max(0, want - len(kept))
        groups = kept[:want] + dropped[:fill]
        if len(groups) < want:
            raise RuntimeError(f"dynamic sampling produced {len(groups)} groups in {rounds} rounds, fewer than "
                               f"--rollout-batch-size {want}; raise --over-sampling-batch-size or "
                               f"--dynamic-sampling-max-rounds")
        for index, group in enumerate(groups):
            for s in group:
                s.group = index
        metrics = {"dynamic_sampling_rounds": float(rounds), "dynamic_sampling_filled_groups": float(fill),
                   "dynamic_sampling_pass_ratio": len(kept) / (len(kept) + len(dropped))}
        return [s for g in groups for s in g], metrics

    async def _sft_samples(self, rollout_id: int) -> Collected:
        """SFT: the next prompts with their responses from the data; nothing is generated or scored."""
        prompts = self._prompts(rollout_id, 0)
        samples = []
        for i, p in enumerate(prompts):
            response = list(self._sft_responses[p.index])
            samples.append(Sample(prompt=p, group=i, response_ids=response, rollout_logprobs=[0.0] * len(response),
                                  finish_reason="stop", weight_version=rollout_id, response_text=p.label or ""))
        return samples, {}

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
                                seed=self._seed(rollout_id) + EVAL_SEED_OFFSET)
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
        return (self._base_seed * RUN_SEED_PRIME + rollout_id * ROLLOUT_SEED_PRIME) % SEED_RANGE


def _with_seed(params: SamplingParams, seed: int | None, engine: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, seed=None if seed is None else seed + engine)


async def _call(method: Any, *args: Any) -> Any:
    """Call an engine method: a Ray actor method (`.remote`), an async function or a plain one."""
    remote = getattr(method, "remote", None)
    result = remote(*args) if remote is not None else method(*args)
    return await result if asyncio.isfuture(result) or hasattr(result, "__await__") else result


def _zero_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros_like(rewards)


def _estimator(algorithm: AlgorithmConfig) -> Callable[[torch.Tensor, int], torch.Tensor]:
    name = algorithm.advantage_estimator
    if algorithm.loss_type == "sft_loss" or name in TOKEN_LEVEL_ESTIMATORS:
        return _zero_advantages    # SFT has none; token-level ones are the trainer's (see the module docstring)
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
