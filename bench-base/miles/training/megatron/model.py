"""megatron-core objects of one rank: the GPTModel of its pipeline stage (Transformer Engine's layer
spec when TE is installed, megatron's local spec otherwise, with miles' context-parallel attention
when CP > 1), its bf16 wrapper, DDP, and the optimizer.

Called only inside a rank whose torch.distributed and megatron parallel state are initialised
(`miles.training.megatron.worker`). Gradients are summed, not averaged, over the data-parallel
ranks (`calculate_per_token_loss`): miles' losses are already divided by the global batch's
normalizer (see `miles.algorithms.reduce`), so the sum is the global batch's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.config import TrainConfig
from miles.training.megatron.checks import installed
from miles.training.megatron.conversion import ModelSpec, llama3_inv_freq, padded_vocab
from miles.training.megatron.layout import ParallelLayout


@dataclass
class RankModel:
    """What one rank trains: `gpt` (the bare GPTModel, for state dicts), `module` (what runs: the
    bf16 wrapper and DDP around `gpt`), the optimizer (None for a frozen reference)."""

    gpt: torch.nn.Module
    module: torch.nn.Module
    optimizer: object | None
    use_te: bool


def transformer_config(spec: ModelSpec, layout: ParallelLayout, *, dtype: torch.dtype, on_cpu: bool,
                       recompute: bool = False):
    """`recompute` (--recompute-activations): every transformer layer's activations are recomputed
    in the backward (megatron's full, uniform, one layer per unit: what the torch trainer does)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute_options = dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1) if recompute else {}
    return TransformerConfig(**recompute_options,
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm, hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        context_parallel_size=layout.cp, sequence_parallel=layout.sequence_parallel,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        pipeline_dtype=dtype, calculate_per_token_loss=True,
        # the weights come from the HF checkpoint: no random init; on the CPU no CUDA allocation
        perform_initialization=False, use_cpu_initialization=on_cpu)


def build_gpt(spec: ModelSpec, layout: ParallelLayout, config, *, pp_rank: int) -> tuple[torch.nn.Module, bool]:
    """This stage's GPTModel (full-vocabulary logits on the last stage) and whether it uses TE's layers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    use_te = installed("transformer_engine")
    layer_spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm) if use_te
                  else get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm))
    if layout.cp > 1 and not use_te:
        # megatron's local DotProductAttention refuses CP > 1 (its CP attention is Transformer Engine's)
        from miles.training.megatron.context_parallel import GatheredKVAttention

        layer_spec.submodules.self_attention.submodules.core_attention = GatheredKVAttention
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=padded_vocab(spec, layout.tp),
        max_sequence_length=spec.max_position_embeddings, pre_process=pp_rank == 0, post_process=pp_rank == layout.pp - 1,
        # gather the vocabulary shards: miles' logprob and entropy functions read whole rows
        parallel_output=False, share_embeddings_and_output_weights=spec.tied, position_embedding_type="rope",
        rotary_base=spec.rope_theta)
    if spec.llama3_rope is not None:
        # Llama 3's scaled frequencies, as transformers computes them (see conversion.py); megatron's
        # own rope_scaling fixes three of the four parameters. Set before any forward: the rotary
        # module caches the tables it makes from them.
        rope = model.rotary_pos_emb
        rope.inv_freq = llama3_inv_freq(spec).to(rope.inv_freq.device)
    return model, use_te


def wrap(model: torch.nn.Module, config, *, train: TrainConfig | None, distributed_optimizer: bool):
    """bf16 wrapper (inputs cast to, outputs from, the parameters' dtype) and, when `train` is
    given, DDP and the optimizer; returns (module, optimizer or None)."""
    from megatron.core.transformer.module import Float16Module

    module = Float16Module(config, model) if config.bf16 else model
    if train is None:
        return module.eval(), None
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=train.lr, weight_decay=train.weight_decay, adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2, adam_eps=train.adam_eps, clip_grad=train.clip_grad, bf16=config.bf16,
        params_dtype=config.params_dtype, use_distributed_optimizer=distributed_optimizer), [ddp])
    return ddp, optimizer
