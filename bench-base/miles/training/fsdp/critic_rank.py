"""One rank of PPO's critic on N ranks: the one-process `Critic`, its `ValueModel` sharded with FSDP2
(`miles.training.fsdp.sharding`), data parallel over each global batch, as `FSDPRank` is the policy's.

Every rank receives the whole rollout, its old values and its returns, and packs the same [B, T]
batch, so each computes the global batch's token count (the loss's normalizer) itself. A rank runs
only its contiguous share of each global batch's rows (`rank_rows`), in the policy's micro-batches
(--micro-batch-size rows, or token-budget groups with --use-dynamic-batch-size: `DataParallelRank`,
the shell's plan), padded to the same count on every rank (an empty micro-batch runs row 0 for
the collectives and contributes nothing); FSDP sums the gradients over the ranks, so the step is
the one-process step. The values and the loss terms are summed over the ranks: every rank answers
the same. The step goes through the shell (`OptimizedModel._optimizer_step`), which clips and steps
each parameter's local shard.

The layout is `FSDPRank`'s: a unit per decoder layer of the backbone, computing in the compute
dtype through FSDP's mixed precision (bf16 on CUDA, float32 on the CPU) without autocast.

Checkpoints are the one-process `Critic.save` folder, so either loads the other's and any number
of ranks loads any other's: the weights are gathered whole one tensor at a time and the optimizer
state whole (`whole_optimizer_state`), both onto rank 0's CPU, which writes the folder; a load
reads the whole files on every rank and keeps its shards (`load_full`). Rank 0's host memory holds
the whole weights and AdamW state while it saves (three float32 copies of the model), and every
rank's while it loads.

A plain class; `miles.training.fsdp.critic_group.FSDPCritic` makes one Ray actor of it per rank.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import structlog
import torch
from torch import Tensor

from miles.config import AlgorithmConfig, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch
from miles.training.critic import HEAD_FILE, Critic
from miles.training.fsdp.checkpoint import load_full, whole_optimizer_state
from miles.training.fsdp.rank import DataParallelRank
from miles.training.fsdp.sharding import (all_reduce_sum, decoder_layers, full_tensor, reshard_all,
                                          shard_model, sum_over_ranks)
from miles.training.shell import OPTIMIZER_FILE
from miles.training.terms import TermSums
from miles.types import Sample
from miles.weights.hf import load_causal_lm, model_weights

log = structlog.get_logger().bind(role="critic-rank")


class FSDPCriticRank(DataParallelRank, Critic):
    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rank: int, world_size: int,
                 init_from: str | None = None, device: str = "auto", dtype: str = "auto"):
        """Remembers the configuration; `setup` joins the group, then loads and shards the model."""
        self.rank, self.world_size = rank, world_size
        self._init_args = (model_path, dict(train=train, algorithm=algorithm, init_from=init_from, device=device,
                                            dtype=dtype))
        self._model = self._root = None

    def setup(self, address: str, port: int) -> None:
        """Join the group (all ranks at once), then build the critic with its model sharded (and
        restored, when --critic-load names a critic folder)."""
        model_path, kwargs = self._init_args
        self._join_group(kwargs["device"], address, port)
        super().__init__(model_path, **kwargs)

    def _start_optimizer(self, model: torch.nn.Module) -> None:
        self._root = shard_model(model, compute_dtype=self.compute_dtype, world_size=self.world_size)
        super()._start_optimizer(model)
        log.info("rank_sharded", rank=self.rank, world_size=self.world_size, units=len(decoder_layers(model)) + 1)

    def _autocast(self):
        """As `FSDPRank._autocast`: none (FSDP's mixed precision casts each unit's parameters)."""
        return contextlib.nullcontext()

    def _forward(self, mb: TrainBatch) -> Tensor:
        """Inside the FSDP root, so the root unit's parameters (embeddings, norm, head) are gathered."""
        with self._autocast():
            return self._root(lambda model: model(mb.tokens, mb.attention_mask, mb.pack() if self._packed else None))

    # --- data parallel ---------------------------------------------------------------------------
    @torch.no_grad()
    def values(self, samples: list[Sample]) -> Tensor:
        """The one-process critic's values: each rank computes its rows, the rows summed over the ranks."""
        batch = make_train_batch(samples, self.pad_id).to(self.device)
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        for rows, mb in self._micro_batches(batch, forward_only=True):
            v = self._forward(mb)
            if rows.numel():
                out[rows, :mb.tokens.shape[1]] = v
        reshard_all(self._root)      # no backward frees what the no-grad forward gathered
        all_reduce_sum(out)
        return torch.where(batch.loss_mask, out, torch.zeros((), device=self.device)).cpu()

    def _accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """The one-process critic's, over this rank's rows; the terms summed over the ranks."""
        normalizer = max(batch.num_tokens, 1)
        sums = TermSums()
        pairs = list(self._micro_batches(batch))        # as many on every rank
        for i, (rows, mb) in enumerate(pairs):
            # gradients accumulate unsharded until the last micro-batch, which reduce-scatters them once
            last = i == len(pairs) - 1
            self._root.set_requires_gradient_sync(last)
            self._root.set_reshard_after_backward(last)
            loss, terms = self._micro_loss(mb, normalizer)
            real = rows.numel() > 0
            self._backward(loss if real else loss * 0.0)
            sums.add(terms, 1.0 if real else 0.0)
            sums.add({"micro_batches": float(real)})
        return sum_over_ranks(sums.floats(), self.device)

    # --- checkpoint ----------------------------------------------------------------------------------
    def save(self, path: str | Path, optimizer: bool = True) -> None:
        """The one-process `Critic.save` folder, written by rank 0 from the gathered weights and
        optimizer state (collectives: every rank calls it; `optimizer` positional for `RankGroup.all`)."""
        import torch.distributed as dist

        model, keep = self._live(), self.rank == 0
        weights = {}
        for name, t in model_weights(model).items():       # one tensor whole on the device at a time
            whole = full_tensor(t.detach())
            if keep:
                weights[name] = whole.to("cpu", copy=True).contiguous()
            del whole
        state = whole_optimizer_state(model, self._optimizer) if optimizer else None
        if keep:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            self._write_folder(path, weights, state)
        dist.barrier()          # the caller commits the folder once rank 0 has written it

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """What `save` (or the one-process `Critic.save`, on any number of ranks) wrote; the parts as in
        `Critic.load`."""
        path = Path(path)
        if not (path / HEAD_FILE).is_file():
            raise FileNotFoundError(f"critic checkpoint {path} lacks {HEAD_FILE}; pass a folder written by Critic.save")
        self._load_state(path, optimizer=optimizer, step=step)

    def _load_state(self, path: Path, *, optimizer: bool = True, step: bool = True) -> None:
        """Backbone, head, optimizer state and step count from the whole files, each rank keeping its
        shards. At start-up (--critic-load of a critic folder) the backbone was built from the same
        files: it is read once more here, for one load routine."""
        from safetensors.torch import load_file

        backbone = model_weights(load_causal_lm(str(path), device=torch.device("cpu"), dtype=torch.float32))
        weights = {**{f"lm.{n}": t for n, t in backbone.items()},
                   **{f"value_head.{n}": t for n, t in load_file(str(path / HEAD_FILE)).items()}}
        state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True) \
            if optimizer and (path / OPTIMIZER_FILE).is_file() else None
        load_full(self._live(), weights, self._optimizer, state)
        if (path / self.state_file).is_file():
            saved = json.loads((path / self.state_file).read_text())
            self._load_scaler_state(saved, optimizer)
            if step:
                self._num_steps = saved["num_steps"]

    def dispose(self) -> None:
        """The critic's model and optimizer state, then this rank's process group (`_leave_group`).
        Idempotent."""
        if self._model is not None:
            super().dispose()
        self._root = None
        self._leave_group()
