"""--custom-pg-loss-reducer-function-path: miles' policy-loss reducer on this trainer's [B, T] rows.

miles' hook is `get_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)
-> reducer`, built per micro-batch; `reducer(x)` turns the per-token policy loss `x` (the responses'
tokens of the micro-batch, sample after sample, flat) into the micro-batch's share, a sum over its
samples (its default: each sample's masked token mean, summed), which miles then divides by the global
batch's size (or by its trained tokens with --calculate-per-token-loss). Only the policy loss is reduced
by it; the KL and entropy terms and the metrics keep --loss-agg-mode's reduction.

Here the policy loss is [B, T] right-padded rows (`miles.training.batch`): row i holds prompt + response,
its loss under the response tokens. `miles_reduction` cuts each row's response out, calls the user's
function with miles' arguments (`total_lengths` prompt + response, `response_lengths`, `loss_masks` one
float tensor per sample over its response, `calculate_per_token_loss` = `--loss-agg-mode token_mean`)
and divides the reducer's result by the global batch's normalizer of --loss-agg-mode (trained tokens
for token_mean, else the number of samples with trained tokens: miles counts every sample, the same
unless some were aborted, failed or removed). A response starts at its row's first trained token; a
row without trained tokens (aborted, failed, removed) comes with response length 0 and adds nothing.
The lengths are Python lists, as miles passes them: one device-to-host read per micro-batch, paid only
when the flag is set.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from miles.user_code import check_signature, display_name, import_user_function

FLAG = "--custom-pg-loss-reducer-function-path"
GetReducer = Callable[[list[int], list[int], list[Tensor], bool], Callable[[Tensor], Tensor]]


def load_reducer(path: str) -> GetReducer:
    """The user's reducer factory, checked to take miles' four arguments; ConfigError naming the flag."""
    fn = import_user_function(path, FLAG)
    check_signature(fn, FLAG, path, 4, "get_reducer(total_lengths, response_lengths, loss_masks, "
                    "calculate_per_token_loss) -> reducer(x) -> Tensor")
    return fn


def response_spans(attention_mask: Tensor, loss_mask: Tensor) -> tuple[list[int], list[int]]:
    """(total_lengths, response starts) per row: prompt + response tokens, and the row's first trained
    position (its total length when it has none, so its response is empty)."""
    total = attention_mask.sum(dim=1)                                   # [B]
    trained = loss_mask.bool()
    first = torch.where(trained.any(dim=1), trained.int().argmax(dim=1), total)
    return total.tolist(), first.tolist()


def miles_reduction(get_reducer: GetReducer, per_token: Tensor, loss_mask: Tensor, attention_mask: Tensor, *,
                    per_token_loss: bool, normalizer: float) -> Tensor:
    """The policy loss [B, T] reduced by the user's reducer, as a share of the global batch (module docstring)."""
    totals, starts = response_spans(attention_mask, loss_mask)
    lengths = [t - s for t, s in zip(totals, starts)]
    x = torch.cat([per_token[i, s:t] for i, (s, t) in enumerate(zip(starts, totals))])
    masks = [loss_mask[i, s:t].to(per_token.dtype) for i, (s, t) in enumerate(zip(starts, totals))]
    out = get_reducer(totals, lengths, masks, per_token_loss)(x)
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise TypeError(f"{FLAG} {display_name(get_reducer)}: its reducer returned "
                        f"{type(out).__name__ if not isinstance(out, Tensor) else f'a tensor of shape {tuple(out.shape)}'}"
                        "; expected a scalar tensor (the micro-batch's summed policy loss)")
    return out.reshape(()) / normalizer
