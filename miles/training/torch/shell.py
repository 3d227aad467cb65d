"""The shell the trainer and the critic share: one float32 model under AdamW on one device.

What lives here, once: the seeding, the device and the autocast compute dtype, AdamW with the
run's betas (with --decoupled-lr the input embedding and output layer in groups of their own), the
learning-rate and weight-decay schedules by optimizer step, the finite-gradient
step (clip, refuse a non-finite norm before it reaches a weight, set the rate, step; under float16
the loss scaling of `miles.training.torch.loss_scale`: the gradients unscaled before the clip, and a
non-finite norm is an overflow whose step is skipped, not an error), the
micro-batches of a global batch (--micro-batch-size rows, or with --use-dynamic-batch-size token-budget
groups of at most --max-tokens-per-gpu tokens, packed into one row when the model packs; on CUDA without
--max-tokens-per-gpu a budget planned from the free memory: `miles.training.torch.microbatch`,
`miles.training.torch.memory_plan`), the optimizer state and step count on disk (written on a thread of its own from a CPU snapshot with
--async-save: `miles.checkpoint.background`), the optimizer state's move to host memory while a colocated engine
needs the GPU (`offload`, --offload-train; from then on each step streams it through the GPU a chunk
at a time: `miles.training.torch.offload`), and the disposal. What a model computes (policy loss, value loss) and
what else it saves are the subclass's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from miles.checkpoint.background import BackgroundWrites
from miles.config import TrainConfig
from miles.training.batch import TrainBatch
from miles.training.torch.loss_scale import loss_scaler
from miles.training.torch.memory_plan import cuda_token_budget
from miles.training.torch.microbatch import HostRows, padded_tokens, plan_micro_batches, take_rows
from miles.training.packing import to_device
from miles.training.rng import seed_everything
from miles.training.torch.offload import DEFAULT_CHUNK_BYTES, HostOffload
from miles.training.torch.shadows import weight_shadows
from miles.training.torch.shards import clip_grad_norm, local, step_shards
from miles.training.schedule import lr_schedule, wd_schedule
from miles.weights.hf import resolve_device, resolve_dtype

OPTIMIZER_FILE = "optimizer.pt"


def _into_existing(write, path: Path, *args) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is gone: its save was aborted before the background write began")
    write(path, *args)


class OptimizedModel:
    """Subclasses set `role` (in messages), `state_file` (the step count's file) and `lr_hint` (what
    to lower when a gradient blows up), load their model, then call `_start_optimizer(model)`."""

    role = "model"
    state_file = "state.json"
    lr_hint = "--lr"
    decouples_lr = False        # --decoupled-lr: the embedding and output layer get their own rate (the policy's)

    def __init__(self, *, train: TrainConfig, device: str, dtype: str):
        seed_everything(train.seed)
        self.device = resolve_device(device)
        if train.use_dynamic_batch_size and train.max_tokens_per_gpu is None and self.device.type != "cuda":
            raise ValueError(f"--use-dynamic-batch-size needs --max-tokens-per-gpu N off CUDA (the {self.role} is on "
                             f"{self.device.type}; on CUDA the budget is planned from the free memory)")
        self.compute_dtype = resolve_dtype(dtype, self.device)
        self._scaler = loss_scaler(train, self.compute_dtype)     # float16: a loss scale; else none
        self._train_cfg = train
        self._max_grad_norm = train.clip_grad if train.clip_grad > 0 else math.inf
        self._lr_at = lr_schedule(train)
        self._wd_at = wd_schedule(train)
        self._decoupled_lr_at = lr_schedule(train, decoupled=True) if train.decoupled_lr is not None else None
        self._decoupled_groups: list[bool] = [False]    # per AdamW group: on the decoupled schedule
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._num_steps = 0
        self._host: HostOffload | None = None       # made at the first offload (at the start: --optimizer-cpu-offload)
        self._packed = False         # token-budget micro-batches run packed (the subclass decides: use_packing)
        self._computed = [0, 0]      # positions the forwards computed, real tokens among them (a train call)
        self._memory_budget: int | None = None       # the last memory-planned token budget (CUDA, no --max-tokens-per-gpu)
        self._writes = BackgroundWrites()            # --async-save: the checkpoint files still being written

    def _start_optimizer(self, model: nn.Module) -> None:
        t = self._train_cfg
        self._model = model
        groups = self._param_groups(model)
        self._decoupled_groups = [g["decoupled"] for g in groups]
        self._optimizer = torch.optim.AdamW([{"params": g["params"]} for g in groups], lr=t.lr,
                                            weight_decay=self._wd_at(0), betas=(t.adam_beta1, t.adam_beta2),
                                            eps=t.adam_eps)
        if t.optimizer_cpu_offload:     # the state is made chunk by chunk in the first streamed step, then lives on the host
            self._host = HostOffload(self._optimizer, model, resident=True, chunk_bytes=self._offload_chunk_bytes())

    def _param_groups(self, model: nn.Module) -> list[dict]:
        """One group of every trainable parameter (a frozen one, LoRA's base, has no optimizer state); with
        --decoupled-lr the parameters cut into runs, in `model.parameters()` order, of those on the
        decoupled schedule (the input embedding and the output layer, one parameter when tied) and the
        others: the state dict's parameter indices stay those of one group, so a checkpoint of either layout loads into the other (`_fit_groups`)."""
        # LoRA: the adapters alone. Otherwise every parameter, a frozen one too (the critic's untied LM head:
        # no gradient, so no state), so the state dict's indices stay those of checkpoints written before
        params = [p for p in model.parameters() if p.requires_grad or not self._train_cfg.lora_rank]
        if self._decoupled_lr_at is None:
            return [{"params": params, "decoupled": False}]
        if not self.decouples_lr:
            raise ValueError(f"--decoupled-lr is not supported for the {self.role} yet: its parameters take one "
                             f"rate ({self.lr_hint}); drop --decoupled-lr")
        special = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
                   if m is not None}
        groups: list[dict] = []
        for p in params:
            flag = id(p) in special
            if not groups or groups[-1]["decoupled"] != flag:
                groups.append({"params": [], "decoupled": flag})
            groups[-1]["params"].append(p)
        return groups

    def _fit_groups(self, saved: dict) -> dict:
        """A saved optimizer state dict laid out as this optimizer's groups: the parameter indices are
        the same in every layout (`_param_groups`), so a checkpoint written with one group (or without
        --decoupled-lr) loads with --decoupled-lr and back; each group takes the saved first group's
        hyperparameters (the rate and the weight decay are set again at every step)."""
        mine = [len(g["params"]) for g in self._optimizer.param_groups]
        theirs = [len(g["params"]) for g in saved["param_groups"]]
        if mine == theirs:
            return saved
        if sum(mine) != sum(theirs):
            raise ValueError(f"the saved optimizer state has {sum(theirs)} parameters, this {self.role}'s "
                             f"optimizer {sum(mine)}: not this model's")
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        hyper = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        starts = [sum(mine[:k]) for k in range(len(mine))]
        groups = [{**hyper, "params": ids[a:a + n]} for a, n in zip(starts, mine)]
        return {"state": saved["state"], "param_groups": groups}

    def _schedule_metrics(self) -> dict[str, float]:
        """What the optimizer's groups hold after a step: lr (the main schedule's), decoupled_lr with
        --decoupled-lr, weight_decay when it is scheduled (--weight-decay-incr-style linear/cosine)."""
        out: dict[str, float] = {}
        for group, decoupled in zip(self._optimizer.param_groups, self._decoupled_groups, strict=True):
            out.setdefault("decoupled_lr" if decoupled else "lr", float(group["lr"]))
        if self._train_cfg.weight_decay_incr_style != "constant":
            out["weight_decay"] = float(self._optimizer.param_groups[0]["weight_decay"])
        return out

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken since the initial weights (restored by `load`)."""
        return self._num_steps

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)

    def _shadowed(self, model: nn.Module, *, grads: bool):
        """The context of a micro-batch loop over `model`: with --trainer-weight-shadows its decoder's
        Linear weights in the compute dtype, cast once for the loop, with --gradient-accumulation-fusion
        their weight gradients added up by the matmuls too (`miles.training.torch.shadows`)."""
        t = self._train_cfg
        if not t.shadows:
            return contextlib.nullcontext()
        return weight_shadows(model, self.compute_dtype, grads=grads, fuse=t.grad_accum_fusion)

    def _backward(self, loss: Tensor) -> None:
        """The backward of a micro-batch's loss, scaled under float16 (`_optimizer_step` unscales)."""
        self._scaler.scaled(loss).backward()

    def _optimizer_step(self) -> dict[str, float]:
        """Unscale and clip the accumulated gradients, and step; the gradient norm before clipping, and
        under float16 the loss scale the step's backward used and whether the step was skipped."""
        scale = self._scaler.scale
        params = [p for p in self._live().parameters() if p.grad is not None]
        self._scaler.unscale([local(p.grad) for p in params])
        grad_norm = clip_grad_norm(params, self._max_grad_norm)
        overflow = not math.isfinite(grad_norm)     # the same on every rank: the norm is all-reduced
        if overflow and (not self._scaler.skips_overflow or self._scaler.at_floor):
            # stepping would write NaN/inf into every weight; stop with the weights still good
            floor = f" with the loss scale at --min-loss-scale {scale}" if self._scaler.at_floor else ""
            raise FloatingPointError(f"{self.role} gradient norm is {grad_norm} at optimizer step {self._num_steps}"
                                     f"{floor}; lower {self.lr_hint}, set --clip-grad, or look for bad samples")
        self._scaler.update(overflow)
        start = time.perf_counter()
        if overflow:        # float16: the scale was too large; weights and moments stay, the schedule does not advance
            self._optimizer.zero_grad(set_to_none=True)
        else:
            self._apply_step()
        if self.device.type == "cuda":      # the update's kernels done: its time, not its launches'
            torch.cuda.synchronize(self.device)
        # the optimizer's own time, apart from the forward and backward: under --offload-train or
        # --optimizer-cpu-offload the moments' trip through host memory is in it (HostOffload.step)
        timed = {"optimizer_step_s": time.perf_counter() - start}
        if not self._scaler.skips_overflow:
            return {"grad_norm": grad_norm, **timed}
        return {"grad_norm": math.nan if overflow else grad_norm, "loss_scale": scale, "skipped_steps": float(overflow),
                **timed}

    def _apply_step(self) -> None:
        """Set the scheduled rates and weight decay and step the optimizer on the (unscaled, clipped) gradients."""
        step = self._num_steps
        lr, wd = self._lr_at(step), self._wd_at(step)
        for group, decoupled in zip(self._optimizer.param_groups, self._decoupled_groups, strict=True):
            group["lr"] = self._decoupled_lr_at(step) if decoupled else lr
            group["weight_decay"] = wd
        if self._host is not None:
            self._host.step()           # the state lives in host memory since the first offload
        else:
            step_shards(self._optimizer)    # torch's step; under FSDP2 on each parameter's local shard
        # nothing reads the gradients after the step: their 4 B/param go back to the allocator now (a
        # colocated engine's KV cache gets them during the rollout) instead of at the next step's start
        self._optimizer.zero_grad(set_to_none=True)
        self._num_steps += 1

    def _step_averages(self, steps: list[dict[str, float]]) -> dict[str, float]:
        """The metrics of a train call's optimizer steps: each averaged over the steps, but under float16
        `skipped_steps` counted and `grad_norm` averaged over the applied steps (nan: none applied), and
        `loss_scale` the one the next step uses."""
        out = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        if self._scaler.skips_overflow:
            applied = [s["grad_norm"] for s in steps if not s["skipped_steps"]]
            out.update(grad_norm=sum(applied) / len(applied) if applied else math.nan,
                       skipped_steps=float(sum(s["skipped_steps"] for s in steps)), loss_scale=self._scaler.scale)
        return out

    # --- micro-batches -----------------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch, micro_batch_size: int | None = None, *,
                       forward_only: bool = False) -> list[tuple[Tensor, TrainBatch]]:
        """(row indices [b] on the device, micro-batch) pairs covering `batch`: --micro-batch-size rows
        (or `micro_batch_size`), or token-budget groups with --use-dynamic-batch-size. All are made
        before the first forward, each with its `HostLayout`: the loop over them reads nothing back.
        `forward_only`: for a pass without a backward (--log-probs-max-tokens-per-gpu budgets it)."""
        host = HostRows.of(batch)
        groups = self._plan_groups(list(range(batch.size)), micro_batch_size, host, forward_only=forward_only)
        return [self._take(batch, rows, host) for rows in groups]

    def _plan_groups(self, rows: list[int], micro_batch_size: int | None, host: HostRows, *,
                     forward_only: bool = False) -> list[list[int]]:
        """`rows` of `batch` in micro-batches: --micro-batch-size rows or token-budget groups (packed
        real tokens when packing; a forward-only pass's by --log-probs-max-tokens-per-gpu when given),
        further split by the memory plan on CUDA without a budget."""
        t = self._train_cfg
        if not rows:
            return []
        budget = (t.log_probs_max_tokens_per_gpu if forward_only else None) or t.max_tokens_per_gpu
        planned = self._plan_memory(host) if self.device.type == "cuda" and budget is None else None
        groups = plan_micro_batches([host.lengths[r] for r in rows], micro_batch_size=micro_batch_size or t.micro_batch_size,
                                    max_tokens_per_gpu=(budget or planned) if t.use_dynamic_batch_size
                                    else None, packed=self._packed,
                                    memory_tokens=None if t.use_dynamic_batch_size else planned)
        return [[rows[i] for i in g] for g in groups]

    def _take(self, batch: TrainBatch, rows: list[int], host: HostRows) -> tuple[Tensor, TrainBatch]:
        """(`rows` on the device, their micro-batch), counted in tokens_computed_per_real."""
        mb = take_rows(batch, rows, host=host, packed=self._packed)
        real = mb.layout.real_tokens
        self._computed[0] += real if mb.layout.pack is not None else padded_tokens(mb)
        self._computed[1] += real
        return to_device(torch.tensor(rows, dtype=torch.long), self.device), mb

    def _memory_plan_args(self) -> dict:
        """What `cuda_token_budget` sizes a step by: the model whose config gives the activations
        (`model`), whether the forward makes [T, V] logits (`logits`) and the rows of a logprob chunk
        (`chunk_rows`; 0: none). The subclass's forward decides."""
        raise NotImplementedError

    def _plan_memory(self, host: HostRows) -> int:
        """The token budget the free CUDA memory allows now (`miles.training.torch.memory_plan`)."""
        self._memory_budget = cuda_token_budget(
            optimizer=self._optimizer, device=self.device, compute_bytes=torch.finfo(self.compute_dtype).bits // 8,
            recompute=self._train_cfg.recompute_activations, min_tokens=max(host.lengths),
            streamed=self._host is not None, **self._memory_plan_args())
        return self._memory_budget

    def _save_optimizer(self, path: Path, *, optimizer: bool = True, state: dict | None = None,
                        counters: dict | None = None) -> None:
        """The step count, and the optimizer state unless `optimizer` is False (--no-save-optim: a
        resume from `path` starts a fresh optimizer; the state file says so). `state`: what to write in
        place of `self._optimizer.state_dict()` (a sharded optimizer's state gathered whole, or a
        background save's snapshot); `counters`: the state file as the snapshot took it (`_counters`;
        default: now)."""
        if optimizer:
            torch.save(self._optimizer.state_dict() if state is None else state, path / OPTIMIZER_FILE)
        (path / self.state_file).write_text(json.dumps(self._counters(optimizer) if counters is None else counters))

    def _counters(self, optimizer: bool = True) -> dict:
        """The state file's contents now: the step count, whether the optimizer state is saved, and the
        float16 loss scaler's state (kept with the optimizer's, as Megatron-LM does: --no-save-optim
        drops it too)."""
        scaler = self._scaler.state_dict() if optimizer else None
        return {"num_steps": self._num_steps, "optimizer": optimizer, **({"loss_scaler": scaler} if scaler else {})}

    def _optimizer_snapshot(self) -> dict:
        """`self._optimizer.state_dict()` with every tensor copied to the CPU: what a background save
        writes while later steps change the live state (on the device, or in host buffers)."""
        saved = self._optimizer.state_dict()
        return {"state": {i: {k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v
                              for k, v in st.items()} for i, st in saved["state"].items()},
                "param_groups": [dict(g, params=list(g["params"])) for g in saved["param_groups"]]}

    def _write(self, background: bool, write, path: Path, *args) -> None:
        """`write(path, *args)` now, or queued on the background writer (--async-save: `args` must be
        the snapshot's own copies); `wait_saved` waits for the queue. A background write's folder is
        made now, while the driver's temporary folder around it surely exists; the write itself only
        goes into it if it is still there (an aborted save's folder is never made again)."""
        if not background:
            write(path, *args)
            return
        path.mkdir(parents=True, exist_ok=True)
        self._writes.submit(_into_existing, write, path, *args)

    def wait_saved(self) -> float:
        """Block until every background save's files are written (`save(..., background=True)`);
        seconds waited. Raises the first write's error. The driver calls it on a thread of the actor's
        own (a Ray concurrency group), beside whatever the actor runs."""
        return self._writes.wait()

    def _load_scaler_state(self, state: dict, optimizer: bool = True) -> None:
        """The loss scaler's state from a state file's `state`, when it has one and the optimizer's state is
        asked for (--no-load-optim, --finetune: the scale starts again at --initial-loss-scale)."""
        if optimizer and "loss_scaler" in state:
            self._scaler.load_state_dict(state["loss_scaler"])

    def _saved_with_optimizer(self, path: Path) -> bool:
        state = path / self.state_file
        return not state.is_file() or json.loads(state.read_text()).get("optimizer", True)

    def _load_optimizer(self, path: Path, *, optimizer: bool = True, step: bool = True) -> None:
        """Optimizer state and step count, each when `path` holds it and it is asked for (--no-load-optim:
        not the state, a fresh optimizer; --finetune: neither). Offloaded (the run offloads before it
        resumes: miles.checkpoint.restore), the state goes to the host buffers, never whole on the device."""
        if optimizer and (path / OPTIMIZER_FILE).is_file():
            if self._host is not None and self._host.holds_state:
                saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
                self._host.load_state_dict(self._fit_groups(saved))
            else:
                saved = torch.load(path / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
                self._optimizer.load_state_dict(self._fit_groups(saved))
        if (path / self.state_file).is_file():
            state = json.loads((path / self.state_file).read_text())
            self._load_scaler_state(state, optimizer)
            if step:
                self._num_steps = state["num_steps"]

    def _offload_chunk_bytes(self) -> int:
        mb = self._train_cfg.offload_chunk_mb      # --offload-train-disk-chunk-mb
        return DEFAULT_CHUNK_BYTES if mb is None else mb << 20

    def offload(self) -> int:
        """The optimizer state to host memory, the gradients dropped (--offload-train); the bytes of
        state held there. It stays there: every later step streams it (`HostOffload.step`)."""
        if self._host is None:
            self._host = HostOffload(self._optimizer, self._live(), chunk_bytes=self._offload_chunk_bytes())
        return self._host.offload()

    def release_cached_memory(self) -> None:
        """Return the CUDA blocks the allocator keeps cached (activations of the last step) to the
        device, for a colocated engine to take."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> int:
        """Back from `offload`: nothing to move (the optimizer state stays on the host, streamed by
        each step); bytes moved."""
        return 0 if self._host is None else self._host.onload()

    def _live(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError(f"the {self.role} was disposed; create a new one")
        return self._model

    def _release(self) -> None:
        """What a subclass holds besides the model and the optimizer (dropped by `dispose`)."""

    def dispose(self) -> None:
        """Free the model and the optimizer state (and the CUDA cache). Idempotent. The actor itself
        is the run's."""
        self._writes.close()
        self._release()
        if self._host is not None:
            self._host.dispose()
        self._model = self._optimizer = self._host = None
        if self.device.type == "cuda":      # see miles.rollout.engines.embedded.engine.EmbeddedEngine.dispose
            gc.collect()
            torch.cuda.empty_cache()
