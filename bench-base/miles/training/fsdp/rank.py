"""One rank of the torch trainer on N ranks: the one-process `Trainer`, its model sharded with FSDP2
(`miles.training.fsdp.sharding`), data parallel over each global batch.

Every rank receives the whole rollout and packs the same [B, T] batch, so each computes the global
batch's normalizers itself. A rank runs only its contiguous share of the rows (`rank_rows`), in
micro-batches of --micro-batch-size rows (or --max-tokens-per-gpu tokens), padded to the same count
on every rank; the gradients are summed over the ranks by FSDP's reduce-scatter. What must be whole
on every rank is summed over the ranks: the no-grad logprobs (old and reference; the advantages may
normalise over the rollout), the logprobs a step records in place of a skipped pass, and the loss
terms. So the metrics are the same on every rank, and the step is the one-rank step.

The frozen KL reference is sharded like the policy (no gradients, no optimizer state); its no-grad
pass runs data parallel too, and --ref-update-interval copies the policy's shards into it.

Every forward runs inside its model's FSDP root (`sharding.Root`), so the chunked hidden-state
logprobs (CUDA's path: the LM head applied outside the model's own forward) read a gathered head and
its gradient is reduce-scattered like the others. On CUDA the decoder layers are torch.compiled
after `fully_shard` as on the one-process trainer (--no-trainer-compile turns it off), and there is
no autocast: FSDP's mixed-precision policy casts each unit's parameters to bf16 once per gather.

A plain class; `miles.training.fsdp.group.FSDPTrainer` makes one Ray actor of it per rank.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import structlog
import torch
from torch import Tensor

from miles.config import AlgorithmConfig, RolloutConfig, TrainConfig
from miles.training.batch import TrainBatch
from miles.training.fsdp.buckets import GatheredWeights
from miles.training.fsdp.checkpoint import is_sharded_checkpoint, load_full, rng_file, save_sharded
from miles.training.fsdp.sharding import (Root, all_reduce_sum, bucket_names, decoder_layers, full_tensor, join_group,
                                          padded_count, rank_rows, reshard_all, shard_model, sum_over_ranks)
from miles.training.microbatch import HostRows, take_rows
from miles.training.rng import rng_state, set_rng_state
from miles.training.shell import OPTIMIZER_FILE
from miles.training.terms import TermSums
from miles.training.trainer import REF_FILE, STATE_FILE, Trainer
from miles.weights.hf import model_weights, resolve_device
from miles.weights.transport import DEFAULT_BUCKET_BYTES, BucketSender, HostWeights, WeightBucket

log = structlog.get_logger().bind(role="trainer-rank")


class DataParallelRank:
    """What the policy's rank and the critic's share (both `OptimizedModel`s, whose `_plan_groups` and
    `_take` plan micro-batches; `rank`, `world_size` set): joining and leaving the ranks' process group,
    and the micro-batches of the rank's share of a batch."""

    _distributed = False        # this rank made the process's group (and destroys it on leaving)

    def _join_group(self, device: str, address: str, port: int) -> None:
        self._distributed = join_group(resolve_device(device), address, port, rank=self.rank,
                                       world_size=self.world_size)     # False: the process's group, kept

    def _leave_group(self) -> None:
        """Destroy the group this rank made. Idempotent. `destroy_process_group` does not join the gloo
        group's worker threads (DTensor's caches and FSDP's meshes keep the group alive): end the
        process without the interpreter's finalization afterwards, as `RankGroup.dispose` does
        (`ray.kill`), since a worker still releasing a finished collective's tensors then takes the GIL
        and aborts the process (SIGABRT; see `end_rank_process` in tests/unit/test_fsdp_ranks.py)."""
        import torch.distributed as dist

        if self._distributed:
            self._distributed = False
            dist.destroy_process_group()

    def _micro_batches(self, batch: TrainBatch, micro_batch_size: int | None = None, *,
                       forward_only: bool = False) -> list[tuple[Tensor, TrainBatch]]:
        """This rank's (row indices, micro-batch) pairs, as many as on the rank with the most, all made
        before the first forward; an empty index marks a padding micro-batch (row 0, run for the
        collectives, contributing nothing). `forward_only` as the one-process trainer's."""
        host = HostRows.of(batch)
        groups = self._plan_groups(rank_rows(batch.size, self.rank, self.world_size), micro_batch_size, host,
                                   forward_only=forward_only)
        pairs = [self._take(batch, rows, host) for rows in groups]
        padding = take_rows(batch, [0], host=host, packed=self._packed)
        empty = torch.zeros(0, dtype=torch.long, device=batch.tokens.device)
        return pairs + [(empty, padding)] * (padded_count(len(groups), self.device) - len(groups))


class FSDPRank(DataParallelRank, Trainer):
    decouples_lr = False    # its checkpoints (DCP, and the whole state by name) keep one AdamW group

    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig,
                 rank: int, world_size: int, device: str = "auto", dtype: str = "auto",
                 hidden_forward: bool | None = None, layers_per_unit: int = 1, sync_every_micro_batch: bool = False):
        """Remembers the configuration; `setup` joins the group, then loads and shards the model.
        `hidden_forward` as the one-process trainer's (None: the chunked path on CUDA only);
        `layers_per_unit`: consecutive decoder layers per FSDP unit (`sharding.shard_model`);
        `sync_every_micro_batch`: reduce-scatter each micro-batch's gradients and accumulate them
        sharded (on N ranks the units also reshard after each backward: the least memory, the most
        communication), instead of accumulating whole float32 gradients until the step's last."""
        self.rank, self.world_size, self.layers_per_unit = rank, world_size, layers_per_unit
        self.sync_every_micro_batch = sync_every_micro_batch
        self._init_args = (model_path, dict(train=train, algorithm=algorithm, rollout=rollout, device=device,
                                            dtype=dtype, hidden_forward=hidden_forward))
        self._model = None
        self._roots: dict[int, Root] = {}      # id(model) -> its FSDP root: the policy's (and the reference's)

    def setup(self, address: str, port: int) -> None:
        """Join the group (all ranks at once), then build the trainer with its model sharded. A process
        whose default group exists already (a program that made it; several one-rank trainers in one
        process, as the FSDP bench interleaves them) uses that group if its rank and size are this
        rank's, and leaves it to its maker on `dispose` (`sharding.join_group`)."""
        model_path, kwargs = self._init_args
        self._join_group(kwargs["device"], address, port)
        super().__init__(model_path, **kwargs)
        forward = self._forward         # every forward runs inside its model's root (see sharding.Root)
        self._forward = lambda model, mb, *flags: self._roots[id(model)](lambda lm: forward(lm, mb, *flags))

    def _shard(self, model: torch.nn.Module) -> Root:
        root = shard_model(model, compute_dtype=self.compute_dtype, world_size=self.world_size,
                           layers_per_unit=self.layers_per_unit)
        self._roots[id(model)] = root
        return root

    def _make_reference(self, algorithm: AlgorithmConfig):
        """The one-process trainer's reference, sharded like the policy (no optimizer, no gradients):
        its no-grad logprob pass runs data parallel, as the policy's."""
        ref = super()._make_reference(algorithm)
        if ref is not None:
            self._shard(ref)
        return ref

    def _start_optimizer(self, model: torch.nn.Module) -> None:
        self._root = self._shard(model)
        super()._start_optimizer(model)
        log.info("rank_sharded", rank=self.rank, world_size=self.world_size,
                 units=-(-len(decoder_layers(model)) // self.layers_per_unit) + 1)

    def _autocast(self):
        """None: FSDP's mixed-precision policy already casts each unit's parameters to the compute
        dtype once per gather; autocast on top would only add its per-op dispatch."""
        return contextlib.nullcontext()

    # --- data parallel ---------------------------------------------------------------------------
    def accumulate_gradients(self, batch: TrainBatch, micro_batch_size: int | None = None, *,
                             record: Tensor | None = None) -> dict[str, float]:
        """The one-rank trainer's, over this rank's rows; terms and `record` summed over the ranks."""
        normalizer, num_tokens = self._objective.normalizers(batch)
        sums = TermSums()
        pairs = list(self._micro_batches(batch, micro_batch_size))     # as many on every rank
        for i, (rows, mb) in enumerate(pairs):
            # gradients accumulate unsharded until the last micro-batch, which reduce-scatters them
            # once (not once per micro-batch); the units stay gathered between the micro-batches
            last = i == len(pairs) - 1
            self._root.set_requires_gradient_sync(last or self.sync_every_micro_batch)
            self._root.set_reshard_after_backward(last or (self.sync_every_micro_batch and self.world_size > 1))
            real = rows.numel() > 0
            if self._moe is not None:        # an MoE model: a padding micro-batch adds no routing stats
                self._moe.counting = real
            loss, terms, logprobs = self._micro_loss(mb, normalizer, num_tokens)
            if self._moe is not None and (router := self._moe.router_loss(len(pairs) * self.world_size)) is not None:
                loss = loss + router         # the mean over every rank's micro-batches, as the gradients sum
            self._backward(loss if real else loss * 0.0)
            if record is not None and real:
                record[rows, :logprobs.shape[1]] = logprobs.detach()
            sums.add(terms, 1.0 if real else 0.0)
        if record is not None:
            all_reduce_sum(record)
        if self._moe is not None:
            self._moe.counting = True
        return sum_over_ranks(sums.floats(), self.device)

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> Tensor:
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        # --use-routing-replay (an MoE model): the policy's routing of this pass, from every rank's rows
        routing = self._moe.no_routing(batch) if self._moe is not None and self._moe.old_replay and \
            model is self._model else None
        for rows, mb in self._micro_batches(batch):
            if self._moe is not None:
                self._moe.counting = bool(rows.numel())
            logprobs = self._forward(model, mb, False, False)[0]
            if rows.numel():
                out[rows, :mb.tokens.shape[1]] = logprobs
            if routing is not None:
                routing = self._moe.record_old(routing, rows, mb, batch)
        if self._moe is not None:
            self._moe.counting = True
        reshard_all(self._roots[id(model)])
        all_reduce_sum(out)
        if routing is not None:         # each row is one rank's: -1 elsewhere, so the sum of (experts + 1) is its own
            routing += 1
            all_reduce_sum(routing)
            routing -= 1
        self._old_routing = routing
        return out

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        return sum_over_ranks(values, self.device)

    # --- weights -----------------------------------------------------------------------------------
    def weight_buckets(self, bucket_bytes: int) -> list[list[str]]:
        """The weights' HF names (tied aliases once) in buckets of at most `bucket_bytes` when whole."""
        return bucket_names(model_weights(self._live()), bucket_bytes)

    def gathered_weights(self, names: list[str], everywhere: bool = False) -> dict[str, Tensor]:
        """Whole CPU float32 copies of the weights `names` on rank 0 (on every rank with `everywhere`),
        {} on the others; a collective: every rank calls it with the same names. One tensor is whole
        on the device at a time. They cross Ray as `HostWeights` (numpy bytes, out of band)."""
        live = model_weights(self._live())
        out: dict[str, Tensor] = HostWeights()
        for name in names:
            whole = full_tensor(live[name].detach())
            if everywhere or self.rank == 0:
                out[name] = whole.to("cpu", copy=True).contiguous()
            del whole
        return out

    def weight_bucket_count(self, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """The buckets of the weights cast to `dtype` (planned once, from the shards' global shapes;
        `miles.training.fsdp.buckets`); CUDA IPC buffers on CUDA, host bytes elsewhere."""
        if self._sender is None:
            self._sender = BucketSender(lambda: GatheredWeights(model_weights(self._live()), dtype), dtype=dtype,
                                        bucket_bytes=bucket_bytes, ipc=self.device.type == "cuda")
        return self._sender.num_buckets

    def weight_bucket(self, index: int, version: int) -> WeightBucket | None:
        """Bucket `index` filled with the current weights (a collective): this rank's IPC copy on CUDA;
        off CUDA rank 0's bytes, None on the other ranks (which only take part in the gathers)."""
        if self._sender.ipc or self.rank == 0:
            return self._sender.bucket(index, version)
        GatheredWeights(model_weights(self._live()), self._sender.dtype).take_part(
            [m.name for m in self._sender.plans[index].metas])
        return None

    def weights(self) -> dict[str, Tensor]:
        """Every weight whole, on every rank (a collective)."""
        return self.gathered_weights(list(model_weights(self._live())), everywhere=True)

    @torch.no_grad()
    def _refresh_reference(self) -> None:
        """The policy's shards into the reference's (same names, same sharding: no communication)."""
        ref = model_weights(self._ref)
        for name, t in model_weights(self._live()).items():
            ref[name].to_local().copy_(t.to_local())

    def _set_reference(self, weights: dict[str, Tensor]) -> None:
        load_full(self._ref, weights)

    def weights_checksum(self, dtype: torch.dtype | None = None) -> str:
        from miles.weights.checksum import state_dict_checksum

        return state_dict_checksum(self.weights(), dtype=dtype)

    # --- checkpoint ----------------------------------------------------------------------------------
    def save(self, path: str | Path, optimizer: bool = True) -> None:
        """This rank's part of the sharded checkpoint (`miles.training.fsdp.checkpoint`) in `path`."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        path = Path(path)
        rng_file(path, self.rank).parent.mkdir(parents=True, exist_ok=True)
        save_sharded(self._live(), self._optimizer if optimizer else None, path)
        torch.save(rng_state(), rng_file(path, self.rank))
        # the reference gathered whole (a collective), written by rank 0 like the one-process file
        ref = {n: full_tensor(t.detach()).cpu().contiguous() for n, t in model_weights(self._ref).items()} \
            if self._ref_interval else None
        if self.rank == 0:
            (path / STATE_FILE).write_text(json.dumps({**self._counters(optimizer), "world_size": self.world_size}))
            if ref is not None:
                save_file(ref, str(path / REF_FILE))
        dist.barrier()          # the caller commits the folder once every rank has written

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """What `save` wrote, on any number of ranks (`Trainer._load_sharded`), or what the one-process
        trainer saved (its whole weights and optimizer state, sharded here); the parts as in `Trainer.load`."""
        path = Path(path)
        if is_sharded_checkpoint(path):
            self._load_sharded(path, optimizer=optimizer, rng=rng, step=step)
        else:
            self._load_whole(path, optimizer=optimizer, rng=rng, step=step)

    def _load_whole(self, path: Path, *, optimizer: bool, rng: bool, step: bool) -> None:
        from safetensors.torch import load_file

        from miles.training.trainer import MODEL_FILE, RNG_FILE

        with_optimizer = self._saved_with_optimizer(path)
        needed = (MODEL_FILE, RNG_FILE, STATE_FILE) + ((OPTIMIZER_FILE,) if with_optimizer else ())
        missing = [f for f in needed if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"trainer checkpoint {path} lacks {', '.join(missing)}; pass a folder written "
                                    "by the torch trainer's save (on one rank or several)")
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True) \
            if with_optimizer and optimizer else None
        load_full(self._live(), load_file(str(path / MODEL_FILE)), self._optimizer, optimizer_state)
        state = json.loads((path / STATE_FILE).read_text())
        self._load_scaler_state(state, optimizer)
        if step:
            self._num_steps = state["num_steps"]
        if rng:
            set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
        if step and self._ref_interval and (path / REF_FILE).is_file():
            self._set_reference(load_file(str(path / REF_FILE)))
        self._prepared = None

    def dispose(self) -> None:
        """The trainer's state, then this rank's process group (`_leave_group`). Idempotent."""
        if self._model is not None:
            super().dispose()
        self._roots, self._root = {}, None
        self._leave_group()
