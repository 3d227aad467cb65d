"""Device-side sampling and per-slot bookkeeping for the fast engine: no host sync per token.

Sampling is an exponential race: with E_i ~ Exp(1) drawn from the call's torch.Generator,
argmax_i (logits_i / T - log E_i) is distributed as softmax(logits / T) (the Gumbel-max trick in
another dress). It needs one argmax instead of a multinomial, so it fuses with the log-softmax and
runs without host round trips. Top-k / top-p set the truncated logits to -inf before the race (the
same `_truncate` as the embedded engine); the reported logprob is log_softmax(logits / T) at the
sampled token, of the untruncated distribution, as the trainer recomputes it. Greedy (T = 0) takes
the argmax and reports logprobs at T = 1.

`advance` records one sampled token per slot and decides on the device whether each slot stops
(a stop token, or its request's own max_new_tokens reached): the host learns which slots finished
only when it reads the `active` flags, every few steps.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from miles.rollout.engines.embedded.engine import _truncate
from miles.types import SamplingParams

STOP, LENGTH = 1, 2    # finish codes in the per-request `reason` buffer (0: not finished)

# logits [b, V] (model dtype) -> (tokens [b] int64, logprobs [b] float32)
Sampler = Callable[[Tensor], tuple[Tensor, Tensor]]


def greedy(logits: Tensor) -> tuple[Tensor, Tensor]:
    x = logits.float()
    tokens = x.argmax(dim=-1)
    return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)


def race(logits: Tensor, noise: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor]:
    """Sample from softmax(logits / temperature) with exponential noise [b, V] (one fused pass)."""
    scaled = logits.float() / temperature
    tokens = (scaled - noise.log()).argmax(dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def truncated_race(logits: Tensor, noise: Tensor, temperature: Tensor, top_k: int,
                   top_p: float) -> tuple[Tensor, Tensor]:
    scaled = logits.float() / temperature
    tokens = (_truncate(scaled, top_k, top_p) - noise.log()).argmax(dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


class NoisySampler:
    """A race sampler that draws its noise into a preallocated buffer [>= b, V] from `generator`."""

    def __init__(self, fn: Callable[..., tuple[Tensor, Tensor]], noise: Tensor, temperature: float,
                 generator: torch.Generator):
        self._fn, self._noise, self._generator = fn, noise, generator
        self._temperature = torch.tensor(temperature, dtype=torch.float32, device=noise.device)

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        noise = self._noise[:logits.shape[0]].exponential_(generator=self._generator)
        return self._fn(logits, noise, self._temperature)


def make_sampler(params: SamplingParams, noise: Tensor, generator: torch.Generator, *,
                 fused_greedy: Sampler = greedy, fused_race=race) -> Sampler:
    """The sampler for one call, chosen once (`fused_*`: the compiled kernels, when the engine has them)."""
    if params.temperature == 0:
        return fused_greedy
    if params.top_k == -1 and params.top_p >= 1.0:
        return NoisySampler(fused_race, noise, params.temperature, generator)

    def truncated(logits, noise_, temperature):
        return truncated_race(logits, noise_, temperature, params.top_k, params.top_p)

    return NoisySampler(truncated, noise, params.temperature, generator)


def stop_table(stop_ids: set[int], vocab: int, device: torch.device) -> Tensor:
    """[V] bool, True at stop tokens: one gather per step (`torch.isin` would sync with the host)."""
    table = torch.zeros(vocab, dtype=torch.bool)
    table[torch.tensor([i for i in stop_ids if 0 <= i < vocab], dtype=torch.long)] = True  # others never come
    return table.to(device)


def bar_stops(logits: Tensor, rows: Tensor, is_stop: Tensor) -> None:
    """min_new_tokens: the stop tokens (`is_stop` [V]) of the rows marked in `rows` [b] bool can not be
    sampled; in place on `logits` [b, V], no host sync."""
    logits.masked_fill_(rows[:, None] & is_stop[None, :], float("-inf"))


def advance(tokens: Tensor, logprobs: Tensor, active: Tensor, req: Tensor, ngen: Tensor,
            out: CallOutputs, is_stop: Tensor, caps: Tensor, routed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Record each active slot's sampled token; -> (still active [b] bool, tokens generated [b]).

    All inputs are per slot [b]: `req` the request a slot serves, `ngen` the tokens it has
    generated so far; `is_stop` is `stop_table`'s [V], `caps` each request's max_new_tokens
    [requests + 1] (the last: the spare row's); `routed` [b, MoE layers, k] (a mixture-of-experts
    model's) the experts of the position whose logits sampled each token. Inactive slots write only to
    the outputs' spare row, so their (garbage) samples never reach a request.
    """
    spare = out.lengths.shape[0] - 1
    row = torch.where(active, req, spare)
    col = torch.where(active, ngen, 0)
    out.tokens[row, col] = tokens
    out.logprobs[row, col] = logprobs
    if routed is not None:
        out.routed[row, col] = routed.to(out.routed.dtype)
    n = ngen + active.long()
    out.lengths[row] = n
    stopped = active & is_stop[tokens]
    done = stopped | (active & (n >= caps[req]))
    out.reason[torch.where(done, req, spare)] = torch.where(stopped, STOP, LENGTH)
    return active & ~done, n


class CallOutputs:
    """Per-request results of one generate call, on the device, plus one spare row for idle slots."""

    def __init__(self, n_requests: int, max_new_tokens: int, device: torch.device,
                 routing: tuple[int, int, int] | None = None):
        """`routing` (MoE layers, k, experts) of a mixture-of-experts model: each token's experts are kept too."""
        rows = n_requests + 1
        self.tokens = torch.zeros((rows, max_new_tokens), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.reason = torch.zeros(rows, dtype=torch.long, device=device)
        # [requests + 1, max_new_tokens, MoE layers, k]: one byte an id for up to 256 experts (Qwen3-MoE: 128),
        # an eighth of int64's (256 requests x 8,192 tokens of Qwen3-30B-A3B's 48 x 8: 0.8 GB)
        if routing is None:
            self.routed = None
        else:
            layers, k, experts = routing
            self.routed = torch.zeros((rows, max_new_tokens, layers, k), device=device,
                                      dtype=torch.uint8 if experts <= 256 else torch.int16)

    def to_host(self) -> tuple[list[list[int]], list[list[float]], list[int], list[int]]:
        """(tokens, logprobs, lengths, reasons) of the real requests: one device sync."""
        return (self.tokens[:-1].tolist(), self.logprobs[:-1].tolist(), self.lengths[:-1].tolist(),
                self.reason[:-1].tolist())

    def routed_to_host(self, lengths: list[int]) -> list[np.ndarray] | None:
        """Each request's experts (Generation.routed_experts, a `miles.types.Routing`): one numpy array [its
        length, MoE layers, k] (uint8, int16 past 256 experts; not nested lists: 256 x 1,024 tokens of 48
        layers x top-8 as Python ints took 8.3 s of a 42 s call on an H200, and not one array per token: those
        pickle at ~5 us a token on every hop between actors); None for a dense model."""
        if self.routed is None:
            return None
        host = self.routed[:-1].cpu().numpy()     # one device copy
        # each request's own copy of its tokens: the samples kept across steps (partial rollout, the fully-async
        # buffer) then hold their routing only, not the whole [requests, max_new_tokens] call beneath views
        return [host[i, :n].copy() for i, n in enumerate(lengths)]
