"""The megatron trainer's parallel layout, as arithmetic: which coordinates a rank has, which layers a
pipeline stage holds, which rows of a batch a data-parallel rank trains, how long sequences are
padded, and which positions a context-parallel rank holds.

Ranks are numbered in megatron-core's default order ("tp-cp-ep-dp-pp", expert parallelism 1), the
tensor-parallel rank varying fastest:

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)),   DP = world / (TP * CP * PP)

so the TP group of a rank is consecutive ranks (one node's GPUs first), and a pipeline stage is a
contiguous block of TP * CP * DP ranks. `tests/unit/test_megatron_layout.py` checks this order
against megatron-core's own rank generator when it is installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RankCoords:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None   # --decoder-first-pipeline-num-layers (None: an even share)
    last_stage_layers: int | None = None    # --decoder-last-pipeline-num-layers

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return RankCoords(tp=tp, cp=cp, dp=dp, pp=pp)

    def rank(self, c: RankCoords) -> int:
        return c.tp + self.tp * (c.cp + self.cp * (c.dp + self.dp * c.pp))

    def stage_layers(self, pp_rank: int, num_layers: int) -> range:
        """The (global) layer indices pipeline stage `pp_rank` holds: the first and last stage's counts
        when given (megatron-core's num_layers_in_first/last_pipeline_stage), the others an even split of
        the rest."""
        counts = self.stage_counts(num_layers)
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])

    def stage_counts(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage (`layout_problems` says when they do not come out whole)."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if self.pp == 1:
            return [num_layers]
        middle = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        each = rest // middle if middle else 0
        counts = [each] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def dp_rows(self, dp_rank: int, rows: int) -> range:
        """Data-parallel rank `dp_rank`'s rows of a batch of `rows`: contiguous, sizes differing by at most one."""
        base, extra = divmod(rows, self.dp)
        start = dp_rank * base + min(dp_rank, extra)
        return range(start, start + base + (dp_rank < extra))

    @property
    def seq_multiple(self) -> int:
        """Sequence lengths are padded to a multiple of this: sequence parallelism scatters the sequence
        over the TP ranks, context parallelism cuts it into 2 * CP chunks."""
        return math.lcm(self.tp if self.sequence_parallel else 1, 2 * self.cp if self.cp > 1 else 1)

    def cp_positions(self, cp_rank: int, seq_len: int) -> Tensor:
        """The positions (sorted) context-parallel rank `cp_rank` holds of a sequence of `seq_len`
        (a multiple of 2 * CP): megatron's load-balanced split, chunks `cp_rank` and `2 CP - 1 - cp_rank`
        of 2 * CP, so every rank gets as much of the causal mask's work as the others."""
        if seq_len % (2 * self.cp):
            raise ValueError(f"sequence length {seq_len} is not a multiple of 2 * CP = {2 * self.cp}")
        chunk = seq_len // (2 * self.cp)
        first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
        second = torch.arange((2 * self.cp - 1 - cp_rank) * chunk, (2 * self.cp - cp_rank) * chunk)
        return torch.cat([first, second])


def layout_problems(world_size: int, tp: int, pp: int, cp: int, sequence_parallel: bool,
                    num_layers: int | None = None, first: int | None = None, last: int | None = None) -> list[str]:
    """Why these sizes do not make a layout (empty: they do)."""
    sizes = (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
             ("--context-parallel-size", cp))
    problems = [f"{flag} {n}: must be >= 1" for flag, n in sizes if n < 1]
    if problems:
        return problems
    if world_size % (tp * pp * cp):
        problems.append(f"the trainer's {world_size} GPU(s) are not a multiple of TP {tp} x PP {pp} x CP {cp} "
                        f"= {tp * pp * cp}; give it a multiple of that many GPUs (--actor-num-nodes x "
                        f"--actor-num-gpus-per-node) or lower the sizes")
    if sequence_parallel and tp == 1:
        problems.append("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence "
                        "over the TP ranks); drop it or raise TP")
    if (first is not None or last is not None) and pp == 1:
        problems.append("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return problems
    if any(n is not None and n < 1 for n in (first, last)):
        problems.append(f"--decoder-first-pipeline-num-layers {first} / --decoder-last-pipeline-num-layers {last}: "
                        "a stage holds at least one layer")
        return problems
    if num_layers is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if first is None and last is None and num_layers % pp:
            problems.append(f"--pipeline-model-parallel-size {pp} does not divide the model's {num_layers} layers "
                            "(--decoder-first/last-pipeline-num-layers give the first and last stages their own)")
        elif first is not None or last is not None:
            if rest < middle or (middle and rest % middle) or (not middle and rest):
                problems.append(f"the model's {num_layers} layers do not split into {pp} stages with "
                                f"--decoder-first-pipeline-num-layers {first} and --decoder-last-pipeline-num-layers "
                                f"{last}: the other {middle} stage(s) must share the other {rest} evenly, one or "
                                "more each")
    return problems


def batch_problems(layout: ParallelLayout, rollout_samples: int, global_batch: int, micro_batch_size: int) -> list[str]:
    """Each optimizer step's samples (`global_batch`: `TrainConfig.global_batch`, from --global-batch-size
    or --num-steps-per-rollout) split evenly over the data-parallel ranks; with pipeline parallelism
    every micro-batch has the same shape (the stages exchange fixed-size activations)."""
    gbs = global_batch
    if gbs % layout.dp:
        return [f"the global batch of {gbs} samples (--global-batch-size, or the rollout's {rollout_samples} samples "
                f"/ --num-steps-per-rollout) does not split over the {layout.dp} data-parallel ranks; use a "
                f"multiple of {layout.dp}"]
    if layout.pp > 1 and (gbs // layout.dp) % micro_batch_size:
        return [f"with --pipeline-model-parallel-size {layout.pp}, each data-parallel rank's {gbs // layout.dp} "
                f"samples per step must be a multiple of --micro-batch-size {micro_batch_size}"]
    return []
