"""PPO's critic: an HF causal LM's backbone with a scalar value head, trained on GAE returns.

A value sits where the project's per-token tensors sit (see `miles.algorithms.entropy`): values[:, t]
is V(tokens[:, :t]), the value of the prefix before token t, read from the hidden state at t - 1;
position 0 is 0. So `gae(token_rewards, values, loss_mask, ...)` sees V(s_t) for each response token.

One rollout, as the train phase drives it (critic first, as miles does):

    values = critic.values(samples)                               # old values, before the critic's step
    returns = trainer.prepare_rollout(samples, rid, values)       # GAE with the policy's KL in the rewards
    critic.train(samples, values, returns, rid)                   # 0.5 (V - R)^2, value-clipped around `values`
    trainer.train(samples, rid)                                   # skipped for --num-critic-only-steps rollouts

Its micro-batches are the policy's (the shell's plan): --micro-batch-size rows, or token-budget groups
with --use-dynamic-batch-size (packed into one row when the backbone packs); each micro-batch's value
loss is divided by the global batch's tokens, so the gradient does not depend on the split.

Where the critic starts (`init_from`, --critic-load): an HF causal-LM folder (default: the policy's
--hf-checkpoint) gets a new zero-initialised head, so every first value is 0; a folder written by
`Critic.save` restores backbone, head, optimizer and step count; a checkpoint root (CheckpointStore)
means its newest complete checkpoint's `critic/` folder.

A plain class; the composition root makes it a Ray actor.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import structlog
import torch
from torch import Tensor, nn

from miles.algorithms import masked_mean, token_mean, value_loss
from miles.checkpoint.checkpointer import CRITIC_DIR   # the critic's folder inside a checkpoint
from miles.config import AlgorithmConfig, TrainConfig
from miles.training.batch import TrainBatch, make_train_batch, split
from miles.training.packing import Pack, use_packing
from miles.training.protocol import STEP_GRAD_NORMS
from miles.training.shell import OptimizedModel
from miles.training.terms import TermSums
from miles.training.threads import cpu_threads
from miles.types import Sample
from miles.weights.checksum import state_dict_to_cpu
from miles.weights.hf import load_causal_lm, load_tokenizer, load_weights, model_weights

log = structlog.get_logger().bind(role="critic")

# a critic folder is an HF folder of the backbone (save_pretrained) plus these
HEAD_FILE, STATE_FILE = "value_head.safetensors", "critic_state.json"      # and the shell's OPTIMIZER_FILE


class ValueModel(nn.Module):
    """A causal LM's backbone (its lm_head unused) + Linear(hidden, 1)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)    # start at V = 0: no made-up baseline before any data
        nn.init.zeros_(self.value_head.bias)
        head = lm.get_output_embeddings()
        if head is not None and head.weight is not lm.get_input_embeddings().weight:
            # an untied LM head is never used (values read the backbone), so it never has a gradient or
            # optimizer state; frozen, it is not expected to have state when a sharded critic loads one
            head.requires_grad_(False)

    def get_decoder(self) -> nn.Module:
        """The backbone's decoder (as on an HF causal LM): FSDP shards its layers one unit each."""
        return self.lm.get_decoder()

    def forward(self, input_ids: Tensor, attention_mask: Tensor, pack: Pack | None = None) -> Tensor:
        """[B, T] values, aligned to tokens: out[:, t] from the hidden state at t - 1, out[:, 0] = 0.
        `pack` (the rows' `Pack`): their real tokens run as one row (`miles.training.packing`; the
        backbone's attention switched by `enable_packing`), the values come back in the rows' layout."""
        if pack is not None:
            hidden = self.lm.base_model(input_ids=pack.pack(input_ids), use_cache=False,
                                        **pack.model_kwargs()).last_hidden_state
            v = pack.unpack(self.value_head(hidden).squeeze(-1).float())
        else:
            hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            v = self.value_head(hidden).squeeze(-1).float()
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def resolve_critic_source(path: str) -> tuple[str, Path | None]:
    """(HF folder to build the backbone from, critic folder to restore or None) for --critic-load `path`."""
    from miles.checkpoint.store import CheckpointStore

    p = Path(path)
    for folder in (p, p / CRITIC_DIR):
        if (folder / HEAD_FILE).is_file():
            return str(folder), folder
    if (p / "config.json").is_file():
        return str(p), None
    found = CheckpointStore(p).latest() if p.is_dir() else None
    if found is not None and (found[1] / CRITIC_DIR / HEAD_FILE).is_file():
        return str(found[1] / CRITIC_DIR), found[1] / CRITIC_DIR
    raise FileNotFoundError(f"--critic-load {path}: neither an HF model folder (config.json), a critic folder "
                            f"({HEAD_FILE}) nor a checkpoint root whose newest checkpoint has {CRITIC_DIR}/")


class Critic(OptimizedModel):
    role, state_file, lr_hint = "critic", STATE_FILE, "--critic-lr"
    world_size = 1      # critic processes training together (the CPU ranks of one machine share its cores)

    def __init__(self, model_path: str, *, train: TrainConfig, algorithm: AlgorithmConfig, init_from: str | None = None,
                 device: str = "auto", dtype: str = "auto"):
        """`train` is the run's with lr = --critic-lr (the composition root's): the schedule runs at it."""
        super().__init__(train=train, device=device, dtype=dtype)
        self._value_clip = algorithm.value_clip or None      # 0 turns value clipping off
        backbone, restore = resolve_critic_source(init_from or model_path)
        self._model = ValueModel(load_causal_lm(backbone, device=self.device, dtype=torch.float32)).to(self.device)
        self._tokenizer = tokenizer = load_tokenizer(backbone)
        self.pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self._start_optimizer(self._model)
        # the policy's micro-batching (the shell's): with --use-dynamic-batch-size token-budget groups, packed
        # into one row when the backbone can pack
        self._packed = use_packing(train, self._model.lm, device=self.device)
        if restore is not None:          # the backbone came from the folder already; head, optimizer, steps
            self._load_state(restore)
        # on the CPU inside a Ray actor, the cores its process may use (the trainer's rule: miles.training.threads);
        # the critic and the trainer take turns in the train phase, so each may use them all
        threads = cpu_threads(self.device, share=self.world_size)
        log.info("critic_ready", backbone=backbone, restored=str(restore) if restore else None, device=str(self.device),
                 cpu_threads=threads, packed=self._packed)

    # --- values and training -------------------------------------------------------------------
    @torch.no_grad()
    def values(self, samples: list[Sample]) -> Tensor:
        """[B, T] float32 CPU values of the packed samples (`make_train_batch` layout), 0 off the response."""
        batch = make_train_batch(samples, self.pad_id).to(self.device)
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=self.device)
        pairs = self._micro_batches(batch, forward_only=True)    # planned before the shadows take their memory
        with self._shadowed(self._model, grads=False):
            for rows, mb in pairs:
                out[rows, :mb.tokens.shape[1]] = self._forward(mb)
        return torch.where(batch.loss_mask, out, torch.zeros((), device=self.device)).cpu()

    def train(self, samples: list[Sample], values: Tensor, returns: Tensor, rollout_id: int) -> dict[str, float]:
        """Value-loss steps on one rollout, one per global batch; `values` are `values(samples)` from
        before this call (the clipping anchor), `returns` the trainer's GAE targets. Metrics are
        prefixed `critic/`."""
        batch = make_train_batch(samples, self.pad_id)
        if values.shape != batch.tokens.shape or returns.shape != batch.tokens.shape:
            raise ValueError(f"values {tuple(values.shape)} / returns {tuple(returns.shape)} do not match the packed "
                             f"samples {tuple(batch.tokens.shape)}")
        batch = replace(batch, values=values.float(), returns=returns.float()).to(self.device)
        self._computed = [0, 0]
        size = self._train_cfg.global_batch(batch.size)
        steps = [self._step(gb) for gb in split(batch, size)]
        metrics = {f"critic/{k}": v for k, v in self._step_averages(steps).items()}
        mask = batch.loss_mask
        metrics.update({"critic/values_mean": float(masked_mean(batch.values, mask)),
                        "critic/returns_mean": float(masked_mean(batch.returns, mask)),
                        "critic/num_steps": float(len(steps)),
                        "critic/tokens_computed_per_real": self._computed[0] / max(self._computed[1], 1)})
        if self._memory_budget is not None:
            metrics["critic/memory_token_budget"] = float(self._memory_budget)
        log.info("critic_train_done", rollout_id=rollout_id, **{k: round(v, 6) for k, v in metrics.items()})
        metrics[f"critic/{STEP_GRAD_NORMS}"] = [s["grad_norm"] for s in steps]
        return metrics

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        start = time.perf_counter()
        self._optimizer.zero_grad(set_to_none=True)
        sums = self._accumulate_gradients(batch)
        return {**sums, **self._optimizer_step(), "step_time_s": time.perf_counter() - start}

    def _accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """The global batch's value-loss gradients, micro-batch by micro-batch (the policy's: --micro-batch-size
        rows or token-budget groups); its loss terms and `micro_batches`, how many there were. Every
        micro-batch term is divided by the global batch's tokens, so the gradient is the same for any split."""
        normalizer = max(batch.num_tokens, 1)
        sums = TermSums()
        pairs = self._micro_batches(batch)       # planned before the shadows take their memory
        with self._shadowed(self._model, grads=True):
            for _, mb in pairs:
                loss, terms = self._micro_loss(mb, normalizer)
                self._backward(loss)
                sums.add({**terms, "micro_batches": 1.0})
        return sums.floats()

    def _micro_loss(self, mb: TrainBatch, normalizer: int) -> tuple[Tensor, dict[str, Tensor]]:
        """A micro-batch's share of the global batch's value loss (divided by the global batch's
        `normalizer` tokens), and its share of the terms reported (on the device: `TermSums`)."""
        v = self._forward(mb)
        loss, m = value_loss(v, mb.values, mb.returns, mb.loss_mask, value_clip=self._value_clip,
                             reduce=token_mean, normalizer=normalizer)
        return loss, {"value_loss": loss.detach(),
                      "value_clip_frac": m["value_clip_frac"] * (mb.num_tokens / normalizer)}

    def _forward(self, mb: TrainBatch) -> Tensor:
        with self._autocast():
            return self._model(mb.tokens, mb.attention_mask, mb.pack() if self._packed else None)

    def _memory_plan_args(self) -> dict:
        """The backbone's activations; no [T, V] logits (values read the last hidden state)."""
        return dict(model=self._live().lm, logits=False, chunk_rows=0)

    # --- state -----------------------------------------------------------------------------------
    def save(self, path: str | Path, *, optimizer: bool = True, background: bool = False) -> None:
        """Into the folder `path`: the backbone as an HF folder (save_pretrained, with the tokenizer), the
        value head, the optimizer state (unless `optimizer` is False: --no-save-optim) and the step count.
        `background` (--async-save): a CPU snapshot now, the files on the writer thread (`wait_saved`)."""
        weights = state_dict_to_cpu(model_weights(self._live()))
        state = (self._optimizer_snapshot() if background else self._optimizer.state_dict()) if optimizer else None
        self._write(background, self._write_folder, Path(path), weights, state, self._counters(optimizer))

    def _write_folder(self, path: Path, weights: dict[str, Tensor], optimizer_state: dict | None,
                      counters: dict | None = None) -> None:
        """`save`'s folder from whole CPU `weights` (the ValueModel's names, tied aliases once) and
        the optimizer state keyed by parameter index (None: not saved); also what the critic's rank 0
        writes on many ranks, so either loads the other's. `counters`: the snapshot's state file (default: now)."""
        from safetensors.torch import save_file

        lm = {n.removeprefix("lm."): t for n, t in weights.items() if n.startswith("lm.")}
        head = {n.removeprefix("value_head."): t for n, t in weights.items() if n.startswith("value_head.")}
        self._live().lm.save_pretrained(str(path), state_dict=lm)
        self._tokenizer.save_pretrained(str(path))
        save_file(head, str(path / HEAD_FILE))
        self._save_optimizer(path, optimizer=optimizer_state is not None, state=optimizer_state, counters=counters)

    def load(self, path: str | Path, *, optimizer: bool = True, rng: bool = True, step: bool = True) -> None:
        """Restore what `save` wrote: backbone, head, optimizer state, step count (the parts as in
        `Trainer.load`; the critic keeps no RNG state of its own)."""
        path = Path(path)
        if not (path / HEAD_FILE).is_file():
            raise FileNotFoundError(f"critic checkpoint {path} lacks {HEAD_FILE}; pass a folder written by Critic.save")
        saved = load_causal_lm(str(path), device=self.device, dtype=torch.float32)   # sharded or not
        load_weights(self._live().lm, model_weights(saved))
        self._load_state(path, optimizer=optimizer, step=step)

    def _load_state(self, path: Path, *, optimizer: bool = True, step: bool = True) -> None:
        from safetensors.torch import load_file

        load_weights(self._live().value_head, load_file(str(path / HEAD_FILE)))
        self._load_optimizer(path, optimizer=optimizer, step=step)
