"""The trainer's input: scored samples packed into right-padded [B, T] tensors.

Row i holds prompt + response of sample i, then padding. Per-token tensors follow the project's
alignment (see `miles.algorithms.entropy`): position t holds the value for tokens[:, t], so the
response's logprobs sit under the response tokens and position 0 (a prompt token) is never used.

The loss mask is the sample's (`Sample.mask()`): True on the tokens the model sampled, False on the
prompt, on tool / environment tokens inside a multi-turn response, on padding, and on every token of
an aborted or failed sample. Advantages and rollout logprobs are 0 off the mask; the sample's reward
sits on its last trained token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from miles.training.packing import Pack
from miles.types import Sample


@dataclass(frozen=True)
class HostLayout:
    """What the step needs to know of a micro-batch, worked out on the host before the step's first
    forward (`miles.training.torch.microbatch.take_rows` with the batch's `HostRows`): read from the device
    inside the loop, each of these would make the host wait for the GPU to finish the work queued so
    far, leaving it idle until the next launch."""

    num_tokens: int      # trained tokens (True in the loss mask)
    real_tokens: int     # prompt and response tokens (the attention mask's)
    pack: Pack | None    # where its real tokens go when the forward packs them (`miles.training.packing`)
    trained: Tensor      # [n] int64 on the device: the flat positions of the trained tokens in the
                         # forward's layout ([b * W] padded rows, [L] a pack), row-major


@dataclass
class TrainBatch:
    tokens: Tensor            # [B, T] int64, prompt + response, right-padded with pad_id
    loss_mask: Tensor         # [B, T] bool, True on the response tokens the model sampled (trained)
    advantages: Tensor        # [B, T] float32, the sample's advantage on its trained tokens, 0 elsewhere
    token_rewards: Tensor     # [B, T] float32, the sample's reward on its last trained token, 0 elsewhere
    rollout_logprobs: Tensor  # [B, T] float32, the engine's logprobs on trained tokens, 0 elsewhere
    attention_mask: Tensor    # [B, T] int64, 1 on prompt + response, 0 on padding
    weight_version: int       # oldest weight version among the samples
    old_logprobs: Tensor | None = None  # [B, T] float32, the trainer's before this rollout's steps
    ref_logprobs: Tensor | None = None  # [B, T] float32, the frozen reference model's
    is_weights: Tensor | None = None    # [B, T] float32, truncated importance-sampling weights (--use-tis)
    values: Tensor | None = None        # [B, T] float32, the critic's values before its step (PPO)
    returns: Tensor | None = None       # [B, T] float32, the critic's GAE targets (PPO)
    teacher_logprobs: Tensor | None = None  # [B, T] float32, the OPD teacher's (--use-opd), 0 off the mask
    # a mixture-of-experts model's routing (miles.training.moe), [B, T, L, k] int64 over its L MoE layers, -1 where
    # none: the rollout's experts at the position that produced each response token (column t - 1 for the token
    # at t, the position whose logits score it), and the old-logprob pass's experts (--use-routing-replay)
    routed_experts: Tensor | None = None
    old_routed_experts: Tensor | None = None
    # a micro-batch's layout, known on the host (`HostLayout`); None on a global batch, and dropped by
    # every change of rows, columns or device
    layout: HostLayout | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        """Trained tokens (the loss's tokens); known on the host when the layout is."""
        return self.layout.num_tokens if self.layout is not None else int(self.loss_mask.sum())

    def pack(self) -> Pack | None:
        """Where this micro-batch's real tokens go when a packing trainer's forward packs them: its
        layout's pack (None: the rows run as they are, their padding negligible), else worked out from
        the attention mask (one host read)."""
        if self.layout is not None:
            return self.layout.pack
        return Pack.of(self.attention_mask)

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, layout=None, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                             if isinstance(getattr(self, f.name), Tensor)})


def _check_sample(i: int, s: Sample) -> None:
    if len(s.prompt.prompt_ids) == 0:
        raise ValueError(f"sample {i} (prompt index {s.prompt.index}) has an empty prompt; "
                         f"training needs at least one prompt token before the response")
    if len(s.rollout_logprobs) != len(s.response_ids):
        raise ValueError(f"sample {i} (prompt index {s.prompt.index}) has {len(s.response_ids)} response ids "
                         f"but {len(s.rollout_logprobs)} rollout logprobs; they must pair one to one")
    if s.teacher_logprobs is not None and len(s.teacher_logprobs) != len(s.response_ids):
        raise ValueError(f"sample {i} (prompt index {s.prompt.index}) has {len(s.response_ids)} response ids "
                         f"but {len(s.teacher_logprobs)} teacher logprobs; the teacher scores every response token")
    if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
        raise ValueError(f"sample {i} (prompt index {s.prompt.index}) has {len(s.response_ids)} response ids "
                         f"but a loss mask of {len(s.loss_mask)}; a generate function must extend all three "
                         "lists together (Sample.append)")


def make_train_batch(samples: list[Sample], pad_id: int) -> TrainBatch:
    """Pack `samples` into a right-padded TrainBatch (T = longest prompt + response)."""
    if not samples:
        raise ValueError("make_train_batch needs at least one sample")
    for i, s in enumerate(samples):
        _check_sample(i, s)
    # each field is read from the samples' lists once, end to end, into one flat array and put in place
    # by a mask of the positions it fills (row-major, the samples' order): per token, Python only
    # iterates; a list per row and field cost 0.5 s for 256 samples of 4k tokens
    n = len(samples)
    prompt_len = np.fromiter((len(s.prompt.prompt_ids) for s in samples), np.int64, n)
    response_len = np.fromiter((len(s.response_ids) for s in samples), np.int64, n)
    length = prompt_len + response_len
    width = int(length.max())
    column = np.arange(width)
    real = column < length[:, None]                                    # prompt + response
    response = real & (column >= prompt_len[:, None])

    def flat(values, dtype, count):
        return np.fromiter(chain.from_iterable(values), dtype, int(count))

    tokens = np.full((n, width), pad_id, np.int64)
    tokens[real] = flat((chain(s.prompt.prompt_ids, s.response_ids) for s in samples), np.int64, length.sum())
    loss_mask = np.zeros((n, width), bool)
    loss_mask[response] = flat((s.mask() for s in samples), bool, response_len.sum())
    rollout_logprobs = np.zeros((n, width), np.float32)
    rollout_logprobs[response] = flat((s.rollout_logprobs for s in samples), np.float32, response_len.sum())
    rollout_logprobs[~loss_mask] = 0.0
    advantage = np.fromiter((s.advantage for s in samples), np.float32, n)
    advantages = np.where(loss_mask, advantage[:, None], np.float32(0.0))
    token_rewards = np.zeros((n, width), np.float32)                   # the reward on the last trained token
    rows = np.flatnonzero(loss_mask.any(axis=1))
    last = width - 1 - loss_mask[rows, ::-1].argmax(axis=1)
    token_rewards[rows, last] = np.fromiter((samples[i].reward for i in rows), np.float32, len(rows))
    teacher_logprobs = None
    if any(s.teacher_logprobs is not None for s in samples):     # --opd-type sglang: scored in the rollout
        unscored = [i for i, s in enumerate(samples) if s.teacher_logprobs is None and any(s.mask())]
        if unscored:
            raise ValueError(f"samples {unscored[:8]} are trained on but have no teacher logprobs while others "
                             "do; the OPD teacher must score every trained sample")
        teacher_logprobs = np.zeros((n, width), np.float32)
        teacher_logprobs[response] = flat((s.teacher_logprobs or [0.0] * s.response_length for s in samples),
                                          np.float32, response_len.sum())
        teacher_logprobs[~loss_mask] = 0.0
        teacher_logprobs = torch.from_numpy(teacher_logprobs)
    routed_experts = _routed_experts(samples, prompt_len, width)
    return TrainBatch(tokens=torch.from_numpy(tokens), loss_mask=torch.from_numpy(loss_mask),
                      advantages=torch.from_numpy(advantages), token_rewards=torch.from_numpy(token_rewards),
                      rollout_logprobs=torch.from_numpy(rollout_logprobs),
                      attention_mask=torch.from_numpy(real.astype(np.int64)),
                      weight_version=min(s.weight_version for s in samples), teacher_logprobs=teacher_logprobs,
                      routed_experts=routed_experts)


def _routed_experts(samples: list[Sample], prompt_len: np.ndarray, width: int) -> Tensor | None:
    """[B, T, L, k] the samples' rollout routing (`Sample.rollout_routed_experts`) at the positions that
    produced their response tokens, -1 elsewhere; None when no sample carries any. A sample's routing is one
    array [tokens, L, k] or a list of per-token entries (arrays or nested lists; an empty one: no routing)."""
    def shapes(routed) -> Iterator[tuple[int, ...]]:
        if isinstance(routed, np.ndarray):
            yield from [routed.shape[1:]] if len(routed) else []
        else:          # len, not truth: a numpy entry has no single truth value
            yield from (np.shape(r) for r in routed if len(r))

    shape = next((sh for s in samples if s.rollout_routed_experts is not None
                  for sh in shapes(s.rollout_routed_experts)), None)
    if shape is None:
        return None
    out = np.full((len(samples), width, *shape), -1, np.int64)
    for i, s in enumerate(samples):
        routed = s.rollout_routed_experts
        if routed is None:
            continue
        if len(routed) != len(s.response_ids):
            raise ValueError(f"sample {i} (prompt index {s.prompt.index}) has {len(s.response_ids)} response ids "
                             f"but the routing of {len(routed)}; they must pair one to one")
        if isinstance(routed, np.ndarray):
            rows, values = np.arange(len(routed)), routed
        else:
            rows = np.asarray([t for t, r in enumerate(routed) if len(r)], np.int64)
            values = np.asarray([routed[t] for t in rows], np.int64)
        if len(rows):
            if values.shape[1:] != shape:
                raise ValueError(f"sample {i} (prompt index {s.prompt.index}) has routing of shape "
                                 f"{values.shape[1:]} per token; others have {shape} (MoE layers, top-k)")
            out[i, int(prompt_len[i]) - 1 + rows] = values
    return torch.from_numpy(out)


def split(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Consecutive pieces of `size` rows (the last may be smaller). Each piece drops the columns
    that are padding in all of its rows, so short micro-batches do not pay for long ones."""
    if size < 1:
        raise ValueError(f"split size must be >= 1, got {size}")
    pieces = []
    for start in range(0, batch.size, size):
        rows = slice(start, start + size)
        width = int(batch.attention_mask[rows].sum(dim=1).max())  # right padding: real tokens come first
        pieces.append(replace(batch, layout=None, **{f.name: getattr(batch, f.name)[rows, :width] for f in fields(batch)
                                        if isinstance(getattr(batch, f.name), Tensor)}))
    return pieces
