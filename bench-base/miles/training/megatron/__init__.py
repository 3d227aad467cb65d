"""The Megatron training backend (`--train-backend megatron`, `pip install miles[megatron]`).

    conversion.py  HF <-> megatron-core weights (Llama/Llama 3, Qwen2, Qwen3), sharded by tensor parallelism: pure torch
    layout.py      the parallel layout (TP x CP x DP x PP ranks, pipeline stages, data-parallel rows): pure
    checks.py      what makes a run unfit for this backend, said before any actor starts
    model.py       megatron-core objects: the GPTModel of one rank, its bf16 wrapper, DDP, the optimizer
    steps.py       batches through megatron's pipeline schedule; per-rank results gathered on every rank
    worker.py      one rank: loads, prepares, trains, exports, saves and loads its shard
    group.py       the trainer the phases talk to: a group of rank actors over torch.distributed
    cpu_shim.py    points megatron-core's CUDA-only calls at the CPU, for gloo runs without a GPU

model.py, steps.py, worker.py and cpu_shim.py import megatron-core, inside their functions: the
package imports without it (validation says when it is missing), and only a rank loads it.
"""
