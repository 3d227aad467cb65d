"""Every flag of Megatron-LM's argument parser with its fate here, as data.

miles' parser is Megatron-LM's parser plus miles' own flags, so a miles launch script may pass any
Megatron-LM flag. Each one has a fate here, by family:

- implemented with Megatron's meaning (`IMPLEMENTED`: in `miles.config.flags.FLAGS`);
- in the tables of the flags miles' launch scripts pass (`SCRIPTS`: checked against
  --hf-checkpoint's config.json, accepted with one value, or accepted; `miles.config.megatron_flags`);
- `ACCEPTED`: families that only tune Megatron-LM's kernels, memory, logging or I/O, or that set up
  what this build takes from elsewhere (initialization, the data loader's workers): taken, with
  their note in `--help`, and no effect;
- `ALIASES`: another name of one of this build's flags;
- `FAMILIES`: families this build does not train or run (MoE, MLA, FP8, BERT/T5, vision, Megatron's
  own inference and RL loops, ...): refused with one line per family;
- `REFUSED`: single flags, refused with one line each (what the flag does; what to use here).

A flag is written NAME (a switch), NAME= (one value), NAME* (several values: nargs) or NAME?
(argparse's BooleanOptionalAction: --NAME and --no-NAME). The kinds are Megatron-LM's: argparse here
takes the accepted ones as Megatron-LM does, and the values of a refused flag are never read as flags.
tests/data/megatron_lm_flags.txt is the snapshot of Megatron-LM's list the tests check this against.
Pure data: imports nothing of miles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

NOT_YET = "not supported yet"
KINDS_BY_MARK = {"=": "value", "*": "list", "?": "optional"}


def parse(spec: str) -> dict[str, str]:
    """'a b= c*' -> {'a': 'switch', 'b': 'value', 'c': 'list'}."""
    out = {}
    for token in spec.split():
        mark = token[-1] if token[-1] in KINDS_BY_MARK else ""
        out[token[:-1] if mark else token] = KINDS_BY_MARK.get(mark, "switch")
    return out


# -- fates kept elsewhere ---------------------------------------------------------------------------------
# implemented (miles.config.flags.FLAGS), with Megatron's meaning
IMPLEMENTED = parse("""
    lr= min-lr= lr-decay-style= lr-decay-iters= lr-warmup-iters= lr-warmup-fraction= lr-warmup-init=
    lr-wsd-decay-style= lr-wsd-decay-iters= weight-decay= clip-grad= adam-beta1= adam-beta2= adam-eps= seed=
    micro-batch-size= global-batch-size= recompute-activations
    moe-router-load-balancing-type* moe-router-dtype= moe-aux-loss-coeff* moe-z-loss-coeff=
    tensor-model-parallel-size= pipeline-model-parallel-size= context-parallel-size= sequence-parallel
    decoder-first-pipeline-num-layers= decoder-last-pipeline-num-layers=
    save= save-interval= save-retain-interval= no-save-optim no-load-optim no-load-rng finetune load= ckpt-step=
    exit-on-missing-checkpoint eval-interval= tensorboard-dir= wandb-project= optimizer-cpu-offload async-save
    loss-scale= initial-loss-scale= min-loss-scale= loss-scale-window= hysteresis=
    weight-decay-incr-style= start-weight-decay= end-weight-decay= decoupled-lr= decoupled-min-lr=
""")
# in miles.config.megatron_flags: CHECKED, REQUIRED, ACCEPTED, SETS (the flags miles' launch scripts pass)
SCRIPTS = parse("""
    num-layers= hidden-size= ffn-hidden-size= num-attention-heads= group-query-attention num-query-groups= kv-channels=
    qk-layernorm rotary-base= rotary-percent= use-rotary-position-embeddings position-embedding-type= use-rope-scaling
    rotary-scaling-factor= rope-scaling-factor= rope-type= max-position-embeddings= normalization= norm-epsilon= swiglu
    disable-bias-linear add-qkv-bias untie-embeddings-and-output-weights vocab-size= padded-vocab-size=
    attention-dropout= hidden-dropout= expert-model-parallel-size= expert-tensor-parallel-size= optimizer=
    recompute-granularity= recompute-method= recompute-num-layers= tokenizer-type=
    overlap-grad-reduce overlap-param-gather no-gradient-accumulation-fusion use-flash-attn no-masked-softmax-fusion
    no-bias-swiglu-fusion no-bias-dropout-fusion no-bias-gelu-fusion no-rope-fusion tp-comm-overlap
    no-persist-layer-norm cross-entropy-loss-fusion use-mcore-models no-create-attention-mask-in-dataloader
    attention-softmax-in-fp32 transformer-impl= attention-backend= cp-comm-type* bf16 accumulate-allreduce-grads-in-fp32
    use-distributed-optimizer distributed-backend= distributed-timeout-minutes= ckpt-format= seq-length=
    make-vocab-size-divisible-by= calculate-per-token-loss fp16
""")
# in miles.config.miles_flags.MEGATRON_REFUSED (one line each): none since --fp16 and --async-save were built
SCRIPTS_REFUSED: dict[str, str] = {}


# -- accepted: no effect here ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    line: str                  # what the family is in Megatron-LM; what happens here
    flags: dict[str, str]      # name -> kind
    prefixes: tuple[str, ...] = ()     # FAMILIES: any other flag starting with one of these belongs too


_NO_EFFECT = ": no effect"
ACCEPTED: dict[str, Group] = {
    "kernels and communication": Group(
        "tunes Megatron-LM's kernels or communication; here the backend picks its own" + _NO_EFFECT, parse("""
        te-rng-tracker use-te-activation-func use-fused-weighted-squared-relu cross-entropy-fusion-impl=
        no-clone-scatter-output-in-embedding no-async-tensor-model-parallel-allreduce tp-comm-overlap-cfg=
        tp-comm-bootstrap-backend= disable-tp-comm-overlap-ag disable-tp-comm-overlap-rs tp-comm-overlap-rs-dgrad
        disable-tp-comm-bulk-dgrad disable-tp-comm-bulk-wgrad disable-tp-comm-split-ag disable-tp-comm-split-rs
        pipeline-model-parallel-comm-backend= high-priority-stream-groups* no-overlap-p2p-communication
        overlap-p2p-communication-warmup-flush defer-embedding-wgrad-compute wgrad-deferral-limit= no-align-grad-reduce
        ddp-num-buckets= ddp-bucket-size= ddp-pad-buckets-for-high-nccl-busbw ddp-reduce-scatter-with-fp32-accumulation
        ddp-average-in-collective overlap-param-gather-with-optimizer-step no-align-param-gather
        no-scatter-gather-tensors-in-pipeline use-ring-exchange-p2p use-nccl-ub disable-symmetric-registration use-sharp
        sharp-enabled-group= no-gradient-reduce-div-fusion nccl-communicator-config-path= use-tp-pp-dp-mapping
        hierarchical-context-parallel-sizes* disable-gloo-process-groups enable-cuda-graph external-cuda-graph
        cuda-graph-impl= cuda-graph-scope= cuda-graph-warmup-steps= enable-experimental
    """)),
    "memory": Group(
        "Megatron-LM's memory housekeeping; here the trainer manages its own (--offload-train, "
        "--recompute-activations)" + _NO_EFFECT, parse("""
        empty-unused-memory-level= manual-gc manual-gc-interval= no-manual-gc-eval no-pin-cpu-grads no-pin-cpu-params
        distribute-saved-activations train-sync-interval=
    """)),
    "logging": Group(
        "Megatron-LM's console and TensorBoard logging; here each step's metrics go to metrics.jsonl and the sinks "
        "you turn on (--use-tensorboard, --use-wandb)" + _NO_EFFECT, parse("""
        log-interval= log-params-norm log-num-zeros-in-grad log-throughput log-progress log-energy timing-log-level=
        timing-log-option= no-barrier-with-level-1-timing tensorboard-log-interval= tensorboard-queue-size=
        log-timers-to-tensorboard no-log-loss-scale-to-tensorboard log-validation-ppl-to-tensorboard
        log-memory-to-tensorboard log-world-size-to-tensorboard logging-level=
    """)),
    "NVIDIA telemetry": Group(
        "NVIDIA's one-logger telemetry and Multi-Storage Client; neither is used here" + _NO_EFFECT, parse("""
        no-one-logger one-logger-project= one-logger-run-name= one-logger-async app-tag-run-name= app-tag-run-version=
        disable-msc
    """)),
    "initialization": Group(
        "how Megatron-LM initializes new weights; here they come from --hf-checkpoint (or --load)" + _NO_EFFECT,
        parse("""
        init-method-std= embedding-init-method-std= init-method-xavier-uniform data-parallel-random-init
        use-cpu-initialization no-initialization init-model-with-meta-device
    """)),
    "launcher": Group(
        "set by Megatron-LM's launcher; here Ray places the ranks and phase deadlines bound a hang" + _NO_EFFECT,
        parse("local-rank= lazy-mpu-init= distributed-timeout-seconds-after-init=")),
    "checkpoint I/O": Group(
        "tunes how Megatron-LM writes or reads checkpoints; here megatron-core's dist-checkpointing "
        "(--train-backend megatron) or safetensors, and --load detects the format" + _NO_EFFECT, parse("""
        ckpt-fully-parallel-save no-ckpt-fully-parallel-save ckpt-fully-parallel-load ckpt-assume-constant-structure
        dist-ckpt-strictness= dist-ckpt-save-pre-mcore-014 dist-ckpt-optim-fully-reshardable
        distrib-optim-fully-reshardable-mem-efficient use-dist-ckpt dist-ckpt-format= auto-detect-ckpt-format
        use-persistent-ckpt-worker no-strict-fsdp-dtensor-load ckpt-convert-update-legacy-dist-opt-format
    """)),
    "data loader": Group(
        "tunes Megatron-LM's pretraining data loader or its document masking; here prompts come from --prompt-data "
        "and the loss covers response tokens" + _NO_EFFECT, parse("""
        num-workers= num-dataset-builder-threads= no-mmap-bin-files data-cache-path= object-storage-cache-path=
        mid-level-dataset-surplus= reset-position-ids reset-attention-mask eod-mask-loss allow-ambiguous-pad-tokens
    """)),
    "optimizer offload details": Group(
        "how Megatron-LM's optimizer offload moves its copies, or its precision-aware optimizer keeps the state; "
        "here --optimizer-cpu-offload overlaps its copies with the updates already, and the state is float32 (the "
        "precision-aware optimizer's default dtypes: the same numbers)" + _NO_EFFECT,
        parse("overlap-cpu-optimizer-d2h-h2d use-precision-aware-optimizer")),
    "scheduler on resume": Group(
        "takes the learning-rate schedule from the flags, not the checkpoint; here it always does (a resume "
        "continues it from the step count)" + _NO_EFFECT,
        parse("override-opt_param-scheduler override-opt-param-scheduler")),
}

# Megatron-LM's other name of one of this build's flags: name -> (its kind, this build's argparse dest)
ALIASES: dict[str, tuple[str, str]] = {
    "persistent-save-interval": ("value", "save_interval"),
    "wandb-entity": ("value", "wandb_team"),
    "wandb-save-dir": ("value", "wandb_dir"),
}

# -- refused by family: one line for all of a family's flags ----------------------------------------------
_DENSE = "this build trains dense models with full attention in bf16, fp16 or fp32 (docs/coming-from-miles.md): "
_DECODER = "this build trains decoder-only causal LMs from --hf-checkpoint"
FAMILIES: dict[str, Group] = {
    "MoE": Group("Megatron-LM's mixture-of-experts layers (expert parallelism, its router variants); this build "
                 "trains Qwen3-MoE from --hf-checkpoint on the torch trainer (docs/moe.md: R3, --moe-aux-loss-coeff, "
                 "--moe-z-loss-coeff, --moe-router-dtype fp32); drop the flag", parse("""
        num-experts= moe-layer-freq= moe-ffn-hidden-size= moe-shared-expert-intermediate-size= moe-shared-expert-overlap
        moe-grouped-gemm moe-use-legacy-grouped-gemm moe-layer-recompute moe-extended-tp moe-use-upcycling
        moe-router-fusion moe-router-score-function= moe-router-topk=
        moe-router-pre-softmax moe-router-num-groups= moe-router-group-topk= moe-router-topk-scaling-factor=
        moe-router-enable-expert-bias moe-router-bias-update-rate= moe-router-force-load-balancing
        moe-router-padding-for-fp8 moe-input-jitter-eps= moe-per-layer-logging
        moe-token-dispatcher-type= moe-enable-deepep moe-deepep-num-sms= moe-permute-fusion moe-expert-capacity-factor=
        moe-pad-expert-input-to-capacity moe-token-drop-policy= moe-apply-probs-on-input moe-upcycling-granularity=
        moe-pad-experts-for-cuda-graph-inference overlap-moe-expert-parallel-comm delay-wgrad-compute
        freeze-e-score-correction-bias
    """)),       # no "moe-" prefix: --moe-aux-loss-coeff & co. are implemented (docs/moe.md);
    # freeze-e-score-correction-bias: miles' Megatron-LM fork's (DeepSeek-V4's router bias)
    "MLA": Group(f"multi-latent attention (DeepSeek); {_DENSE}train a model with standard attention", parse("""
        multi-latent-attention q-lora-rank= kv-lora-rank= qk-head-dim= qk-pos-emb-head-dim= v-head-dim= mscale=
        mscale-all-dim= cache-mla-latents
    """), ("mla-",)),
    # miles' own flags (not Megatron-LM's)
    "DSA": Group(f"DeepSeek sparse attention; {_DENSE}train a model with full attention",
                 parse("use-dsa index-topk= index-head-dim= index-n-heads="), ("dsa-",)),
    # miles' Megatron-LM fork's (scripts/models/deepseek-v4-*.py)
    "DeepSeek-V4": Group(f"DeepSeek-V4's attention (compressed, hashed and windowed layers, grouped output "
                         f"projection) in miles' Megatron-LM fork; {_DENSE}train a model with standard attention",
                         parse("experimental-attention-variant= no-activation-func-clamp-shared-expert"), ("dsv4-",)),
    "FP8/FP4": Group(f"FP8/FP4 training; {_DENSE}use --dtype bfloat16", parse("""
        fp8-format= fp8-recipe= fp8-quantizer-factory= fp8-margin= fp8-interval= fp8-amax-history-len=
        fp8-amax-compute-algo= no-fp8-wgrad fp8-param-gather first-last-layers-bf16 num-layers-at-start-in-bf16=
        num-layers-at-end-in-bf16= fp4-format= fp4-recipe= fp4-quantizer-factory= fp4-param-gather
        reuse-grad-buf-for-mxfp8-param-ag keep-fp8-transpose-cache kitchen-config-file= kitchen-recipe-number=
        fp8 fp4 te-precision-config-file=
    """), ("fp8-", "fp4-", "kitchen-")),     # te-precision-config-file: miles' fork's per-layer precision recipe
    "MTP": Group(f"multi-token-prediction layers; {_DENSE}drop them (the model's MTP head is not trained)",
                 parse("mtp-num-layers= mtp-loss-scaling-factor="), ("mtp-",)),
    "architecture variants": Group(
        "a Megatron-LM architecture variant this build does not check against config.json; the model is "
        "--hf-checkpoint's architecture: drop the flag", parse("""
        softmax-type= window-size= window-attn-skip-freq= relative-attention-num-buckets= relative-attention-max-distance=
        rotary-interleaved rotary-seq-len-interpolation-factor= no-rope-freq= no-position-embedding mrope-section*
        apply-layernorm-1p apply-residual-connection-post-layernorm openai-gelu squared-relu quick-geglu
        activation-func-clamp-value= glu-linear-offset= qk-l2-norm fp32-residual-connection
        apply-query-key-layer-scaling onnx-safe= spec* heterogeneous-layers-config-path=
        heterogeneous-layers-config-encoded-json=
        attention-output-gate post-self-attn-layernorm post-mlp-layernorm beta-fast= beta-slow=
        original-max-position-embeddings=
    """)),   # the last six are miles' Megatron-LM fork's: Qwen3.5's gated attention, GLM-4's extra norms, YaRN's RoPE
    "BERT/T5": Group(f"BERT and T5 (encoder) models; {_DECODER}", parse("""
        encoder-num-layers= decoder-num-layers= encoder-seq-length= decoder-seq-length= bert-no-binary-head
        output-bert-embeddings bert-embedder-type= bert-load= mask-prob= short-seq-prob= vocab-extra-ids=
    """)),
    "Mamba/hybrid": Group(f"Mamba and hybrid models; {_DECODER} with attention layers", parse("""
        is-hybrid-model hybrid-attention-ratio= hybrid-mlp-ratio= hybrid-override-pattern= mamba-state-dim=
        mamba-head-dim= mamba-num-groups= mamba-num-heads= disable-mamba-mem-eff-path
    """), ("mamba-", "hybrid-")),
    "Retro": Group(f"Retro retrieval-augmented pretraining; {_DECODER}", parse("""
        retro-project-dir= retro-add-retriever retro-cyclic-train-iters= retro-encoder-layers=
        retro-encoder-hidden-dropout= retro-encoder-attention-dropout= retro-num-neighbors= retro-num-retrieved-chunks=
        retro-attention-gate= retro-no-verify-neighbor-count
    """), ("retro-",)),
    "ICT/biencoder": Group(f"ICT and biencoder retriever training; {_DECODER}", parse("""
        ict-head-size= ict-load= biencoder-projection-dim= biencoder-shared-query-context-model titles-data-path=
        query-in-block-prob= use-one-sent-docs evidence-data-path= retriever-report-topk-accuracies*
        retriever-score-scaling retriever-seq-length= block-data-path= embedding-path= indexer-batch-size=
        indexer-log-interval=
    """), ("ict-", "biencoder-", "indexer-")),
    "vision": Group(f"vision models (ViT, DINO, inpainting); {_DECODER} on text prompts", parse("""
        num-classes= img-h= img-w= num-channels= patch-dim= classes-fraction= data-per-class-fraction= no-data-sharding
        head-lr-mult= vision-pretraining vision-pretraining-type= vision-backbone-type= swin-backbone-type= mask-type=
        mask-factor= iter-per-epoch= dino-local-img-size= dino-local-crops-number= dino-head-hidden-size=
        dino-bottleneck-size= dino-freeze-last-layer= dino-norm-last-layer dino-warmup-teacher-temp= dino-teacher-temp=
        dino-warmup-teacher-temp-epochs=
    """), ("vision-", "dino-", "swin-")),
    "Megatron-LM inference": Group(
        "Megatron-LM's own inference engine; here generation runs on --rollout-engine (SGLang server flags as "
        "--sglang-<flag>)", parse("""
        inference-batch-times-seqlen-threshold= max-tokens-to-oom= flash-decode use-legacy-static-engine
        inference-max-requests= inference-max-seq-length= inference-max-batch-size= inference-dynamic-batching
        inference-dynamic-batching-buffer-size-gb= inference-dynamic-batching-block-size=
        inference-dynamic-batching-buffer-guaranteed-fraction= inference-dynamic-batching-buffer-overflow-factor=
        inference-dynamic-batching-max-requests-override= inference-dynamic-batching-max-tokens-override=
        inference-dynamic-batching-num-cuda-graphs= inference-dynamic-batching-track-paused-request-events
        decode-only-cuda-graphs inference-dynamic-batching-unified-memory-level= symmetric-ar-type=
        nccl-all-reduce-for-prefill mlp-chunks-for-prefill= disable-chunked-prefill inference-wandb-logging-step-interval=
        inference-rng-tracker
    """), ("inference-",)),
    "Megatron-LM RL": Group(
        "Megatron-LM's built-in GRPO loop; here miles is the RL loop: --n-samples-per-prompt, --eps-clip, "
        "--kl-loss-coef, ... (miles train --help)", parse("""
        perform-rl-step rl-prompts-per-eval= grpo-prompts-per-step= grpo-group-size= grpo-iterations=
        grpo-clamp-eps-lower= grpo-clamp-eps-upper= grpo-kl-beta= grpo-entropy-term-weight=
        grpo-filter-groups-with-same-reward grpo-default-temperature= grpo-default-top-p= langrl-inference-server-type=
        langrl-inference-server-conversation-template= langrl-external-server? langrl-env-config=
        rl-offload-optimizer-during-inference rl-offload-kv-cache-during-training? rl-remove-kv-cache-during-training?
        rl-reset-cuda-graphs? rl-partial-rollouts? rl-inference-logprobs-is-correction?
        rl-importance-sampling-truncation-coef= rl-calculate-intra-group-similarity? rl-use-sequence-packing
        rl-sequence-packing-bin-size= rl-sequence-packing-algo=
    """), ("grpo-", "langrl-", "rl-")),
    "Muon/SGD": Group("optimizers other than Adam; here always AdamW (--optimizer adam)",
                      parse("""sgd-momentum= muon-momentum= muon-no-split-qkv muon-use-nesterov muon-scale-mode=
                               muon-fp32-matmul-prec= muon-num-ns-steps= muon-tp-mode= muon-extra-scale-factor="""),
                      ("muon-",)),
    "pretraining data": Group(
        "Megatron-LM's pretraining data; here prompts come from --prompt-data (a .jsonl or .parquet file) and "
        "evals from --eval-prompt-data", parse("""
        data-path* split= train-data-path* valid-data-path* test-data-path* data-args-path= per-split-data-args-path=
        mock-data sample-rate= dataloader-type=
    """)),
    "tokenizer files": Group(
        "Megatron-LM's tokenizer files; here the tokenizer is --hf-checkpoint's: drop the flag", parse("""
        vocab-file= merge-file= tokenizer-model= tokenizer-metadata= tiktoken-pattern= tiktoken-num-special-tokens=
        tiktoken-special-tokens* legacy-tokenizer no-use-tokenizer-model-from-checkpoint-args
    """)),
    "sample-counted schedules": Group(
        f"counts training and schedules in samples, or ramps the batch size; {NOT_YET}: schedules count optimizer "
        "steps (--lr-*-iters), --num-rollout sets the length", parse("""
        train-samples= lr-decay-samples= lr-wsd-decay-samples= lr-warmup-samples= rampup-batch-size*
        decrease-batch-size-if-needed
    """)),
    "run length": Group(
        "Megatron-LM's run length in iterations or minutes; here --num-rollout (or --num-epoch) sets it and "
        "--debug-exit-after-rollout stops early", parse("train-iters= exit-interval= exit-duration-in-mins=")),
    "validation loss": Group(
        "Megatron-LM's validation-loss evals; here evals generate and score --eval-prompt-data datasets every "
        "--eval-interval rollouts", parse("eval-iters= full-validation multiple-validation-sets test-mode")),
    "profiling": Group(
        f"profiling, memory snapshots and straggler detection; {NOT_YET}: each step's timings are in metrics.jsonl",
        parse("""
        profile profile-step-start= profile-step-end= use-pytorch-profiler profile-ranks* record-memory-history
        memory-snapshot-path= log-straggler disable-straggler-on-startup straggler-ctrlr-port= straggler-minmax-count=
        run-workload-inspector-server
    """)),
    "result validation": Group(
        f"Megatron-LM's rerun state machine (result checks, fault injection, skipped iterations); {NOT_YET}: "
        "--inject-fault rehearses failures here", parse("""
        rerun-mode= error-injection-rate= error-injection-type= check-for-spiky-loss check-for-large-grads
        result-rejected-tracker-filename= iterations-to-skip* check-weight-hash-across-dp-replicas-interval=
    """)),
    "NVIDIA fault tolerance": Group(
        "NVIDIA's in-process restart, FT package and ADLR autoresume; here dead engines restart "
        "(--engine-max-restarts) and a run resumes with --load", parse("""
        inprocess-restart inprocess-max-iterations= inprocess-monitor-thread-interval=
        inprocess-monitor-process-interval= inprocess-progress-watchdog-interval= inprocess-heartbeat-interval=
        inprocess-soft-timeout= inprocess-hard-timeout= inprocess-heartbeat-timeout= inprocess-barrier-timeout=
        inprocess-completion-timeout= inprocess-last-call-wait= inprocess-termination-grace-time=
        inprocess-granularity= inprocess-active-world-size= inprocess-empty-cuda-cache enable-ft-package
        calc-ft-timeouts adlr-autoresume adlr-autoresume-interval=
    """), ("inprocess-",)),
    "local checkpoints": Group(
        f"non-persistent and replicated local checkpoints; {NOT_YET}: every save is persistent, under --save "
        "(--save-retain-interval, --keep-last-checkpoints)", parse("""
        non-persistent-save-interval= non-persistent-ckpt-type= non-persistent-global-ckpt-dir=
        non-persistent-local-ckpt-dir= non-persistent-local-ckpt-algo= replication replication-jump=
        replication-factor=
    """), ("non-persistent-",)),
    "FSDP in Megatron-LM": Group(
        f"Megatron FSDP or torch FSDP2 inside Megatron-LM; {NOT_YET} with --train-backend megatron, which shards "
        "the optimizer state (distributed optimizer)", parse("""
        use-megatron-fsdp use-torch-fsdp2 torch-fsdp2-no-reshard-after-forward data-parallel-sharding-strategy=
        fsdp-double-buffer suggested-communication-unit-size= enable-full-sharding-in-hsdp
        num-distributed-optimizer-instances=
    """)),
    "virtual or uneven pipeline": Group(
        f"virtual pipeline stages or a layout by layer; {NOT_YET}: --pipeline-model-parallel-size splits the layers "
        "evenly, or --decoder-first/last-pipeline-num-layers give the first and last stages their own",
        parse("""
        pipeline-model-parallel-layout= num-layers-per-virtual-pipeline-stage= num-virtual-stages-per-pipeline-rank=
        microbatch-group-size-per-virtual-pipeline-stage= account-for-embedding-in-pipeline-split
        account-for-loss-in-pipeline-split
    """)),
    "optimizer state": Group(
        f"partial optimizer offload and low-precision optimizer state; {NOT_YET}: the state is fp32, and "
        "--optimizer-cpu-offload keeps all of it in host memory", parse("""
        optimizer-offload-fraction= use-torch-optimizer-for-cpu-offload main-grads-dtype= main-params-dtype=
        exp-avg-dtype= exp-avg-sq-dtype=
    """)),
}

# -- refused one by one: "what it does; what to use here" ---------------------------------------------------
_FROM_FLAGS = "here the model is --hf-checkpoint's config.json and the parallelism is the flags given"
REFUSED: dict[str, str] = {
    "batch-size=": "Megatron-LM's old name of --micro-batch-size: use --micro-batch-size",
    "warmup=": "Megatron-LM's old warmup flag: use --lr-warmup-iters",
    "model-parallel-size=": "Megatron-LM's old name of --tensor-model-parallel-size: use --tensor-model-parallel-size",
    "checkpoint-activations": "Megatron-LM's old name of --recompute-activations: use --recompute-activations",
    "use-legacy-models": "Megatron-LM's legacy models; here the model is the HF architecture (megatron-core layers "
                         "with --train-backend megatron): drop it",
    "no-check-for-nan-in-loss-and-grad": "turns off the NaN check; here a non-finite gradient norm always stops the "
                                         "step with the weights unchanged: drop it",
    "deterministic-mode": f"deterministic kernels; {NOT_YET}",
    "recompute-modules*": "selective recomputation of submodules; here --recompute-activations recomputes whole "
                          "layers",
    "cpu-offloading-num-layers=": f"offloads layers' activations to the CPU; {NOT_YET}: --recompute-activations "
                                  "saves activation memory",
    "dump-param-to-param-group-map=": f"a file of parameter groups; {NOT_YET}: one AdamW group",
    "use-checkpoint-opt_param-scheduler": "takes the learning-rate schedule from the checkpoint; here it always comes "
                                          "from the flags: give the run's --lr-* flags again",
    "use-checkpoint-opt-param-scheduler": "takes the learning-rate schedule from the checkpoint; here it always comes "
                                          "from the flags: give the run's --lr-* flags again",
    "grad-reduce-in-bf16": f"reduces gradients in bf16; {NOT_YET}: gradients are reduced in fp32",
    "fp16-lm-cross-entropy": "the LM loss in fp16; here the logprobs and the loss are float32 under every --dtype "
                             "(--fp16 too): drop it",
    "disable-bf16-reduced-precision-matmul": f"turns off reduced-precision bf16 matmul accumulation; {NOT_YET}",
    "exit-signal-handler": "saves and stops on SIGTERM; here SIGINT/SIGTERM stop the run within --stop-timeout, and "
                           "it resumes from the last --save-interval save: drop it",
    "pretrained-checkpoint=": "a checkpoint to finetune from; here the starting weights are --hf-checkpoint "
                              "(--load resumes a run)",
    "use-checkpoint-args": f"takes the model's flags from the checkpoint; {_FROM_FLAGS}",
    "use-mp-args-from-checkpoint-args": f"takes the parallelism flags from the checkpoint; {_FROM_FLAGS}",
    "load-main-params-from-ckpt": f"loads fp32 main parameters from the checkpoint; {NOT_YET}",
    "no-save-rng": f"saves without RNG states; {NOT_YET}",
    "ckpt-convert-format=": "converts a checkpoint to another format; not a training option here: --load reads "
                            "torch_dist checkpoints as they are (--train-backend megatron)",
    "ckpt-convert-save=": "where a converted checkpoint goes; not a training option here: --load reads torch_dist "
                          "checkpoints as they are (--train-backend megatron)",
    "skip-train": "evaluates without training; here --machine eval_only",
    "trust-remote-code": f"lets HF run a model's or tokenizer's own code; {NOT_YET}: --hf-checkpoint must be an "
                         "architecture transformers has",
    "wandb-exp-name=": "the W&B run name; here the W&B run's name and id are the miles run id: drop it",
    "config-logger-dir=": f"dumps every layer's config; {NOT_YET}",
    "yaml-cfg=": "Megatron-LM's YAML config; here --config FILE takes a YAML of miles flag names",
    "sft": "Megatron-LM's SFT training; here --loss-type sft_loss (with --response-key)",
    "sft-tokenizer-prompt-format=": "the SFT prompt format; here --apply-chat-template uses the tokenizer's chat "
                                    "template (--chat-template-path for another)",
}
REFUSED_KINDS = {name: kind for spec in REFUSED for name, kind in parse(spec).items()}
REFUSED_LINES = {next(iter(parse(spec))): line for spec, line in REFUSED.items()}


def accepted() -> dict[str, tuple[str, str]]:
    """Every accepted flag: name -> (kind, its family's line)."""
    return {name: (kind, g.line) for g in ACCEPTED.values() for name, kind in g.flags.items()}


@functools.cache
def kinds() -> dict[str, str]:
    """Every Megatron-LM flag this table knows: name -> kind."""
    out = {**IMPLEMENTED, **SCRIPTS, **SCRIPTS_REFUSED, **REFUSED_KINDS, **{n: k for n, (k, _) in ALIASES.items()}}
    for g in (*ACCEPTED.values(), *FAMILIES.values()):
        out.update(g.flags)
    return out


def takes_values(name: str) -> bool:
    """Whether the tokens after refused flag `name` are its values (a flag not in the table: yes)."""
    return kinds().get(name, "value") not in ("switch", "optional")
