"""Where a run's numbers go and what is checked on them: the metrics sinks (metrics.jsonl always;
TensorBoard, W&B, MLflow when asked), the live progress display, the processes' structured logs, the
training-curve plot, and the checks on each rollout's metrics (the reward watch, miles' CI gates).
Not the trace: the runtime writes that (`miles.runtime.trace`) and `miles.traceview` reads it."""
