"""FastEngine: our own Llama/Qwen2 forward, paged KV cache, CUDA graphs and GPU sampling."""
