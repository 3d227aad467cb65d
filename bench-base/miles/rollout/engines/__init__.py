"""The inference engines, one package each: `embedded` (transformers), `fast` (our own forward, KV
cache and CUDA graphs), `sglang` (SGLang servers behind a router). The seam they implement and the
registry `--rollout-engine` picks from are `miles.rollout.protocol`'s."""
