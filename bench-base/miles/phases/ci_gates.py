"""miles' CI gates on a run's numbers. Each failure raises `CICheckFailed`, which takes the run's fail
route (draining, the teardown, an `error` in the trace, exit 1), as --ci-test's checks do.

- The metric gate (--ci-metric-checker-key KEY --ci-metric-checker-threshold X, under --ci-test as in
  miles): every eval must log KEY (one that does not fails the run there); once the run has trained all
  its rollouts and its evals have settled, at least one eval must have reached X (value >= X), as miles'
  MetricChecker asks when it is disposed. miles' KEY `eval/<set>` (the set's mean reward) is
  `eval/<set>/reward_mean` here.
- Gradient norms (--ci-save-grad-norm PATH / --ci-load-grad-norm PATH): each optimizer step's norm,
  keyed `<role>/<rollout_id>/<step>` (role actor or critic, step its index in the rollout) in a JSON
  object; PATH may hold miles' {role}, {rollout_id}, {step_id} fields, which spread the keys over
  several files. A later run on the same seed compares step by step within miles' tolerance; a step the
  file does not hold fails the run too.
- The model hash (--ci-save-model-hash / --ci-check-model-hash, under --ci-test as in miles): each
  checkpoint under --save holds `model_hash.json`, the sha256 of the trainer's weights in float32 taken
  when it is saved; a run resuming from it under --load compares the weights it just loaded.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.config import RunConfig
from miles.training.protocol import STEP_GRAD_NORMS

MODEL_HASH_FILE = "model_hash.json"       # in a checkpoint's folder, next to rollout.json
GRAD_NORM_REL_TOL = GRAD_NORM_ABS_TOL = 0.01   # miles' (math.isclose in its megatron train loop)
MILES_SET_SCORE = "reward_mean"           # what miles logs as eval/<set>
ROLE_KEYS = {"actor": STEP_GRAD_NORMS, "critic": f"critic/{STEP_GRAD_NORMS}"}


class CICheckFailed(RuntimeError):
    """A --ci-test check or one of miles' CI gates failed."""


def metric_name(key: str) -> str:
    """The metric --ci-metric-checker-key names: miles' eval/<set> is the set's reward_mean."""
    return f"{key}/{MILES_SET_SCORE}" if key.count("/") == 1 else key


class MetricGate:
    """--ci-metric-checker-key/-threshold: each eval must log the key; some eval must reach the threshold."""

    def __init__(self, key: str, threshold: float):
        self.key, self.metric, self.threshold = key, metric_name(key), threshold
        self.values: list[float] = []

    def on_eval(self, step: int, metrics: dict[str, Any]) -> bool:
        """Record the eval after `step` rollouts; whether it reached the threshold."""
        if self.metric not in metrics:
            logged = ", ".join(sorted(k for k in metrics if k.startswith("eval/"))) or "nothing"
            raise CICheckFailed(f"--ci-metric-checker-key {self.key}: the eval at step {step} logged no "
                                f"{self.metric} (it logged {logged}); name one of those")
        value = float(metrics[self.metric])
        self.values.append(value)
        return value >= self.threshold

    def finish(self) -> None:
        """At the run's end: some eval reached the threshold."""
        if not self.values:
            raise CICheckFailed(f"--ci-metric-checker-key {self.key}: no eval ran, so the gate checked nothing; "
                                "evaluate at least once (--eval-interval N, or without --skip-eval-before-train)")
        if not any(v >= self.threshold for v in self.values):
            raise CICheckFailed(f"--ci-metric-checker-key {self.key}: no eval reached --ci-metric-checker-threshold "
                                f"{self.threshold} (the evals gave {', '.join(f'{v:.4g}' for v in self.values)})")


class GradNormRecord:
    """--ci-save-grad-norm (`save`) or --ci-load-grad-norm: each optimizer step's gradient norm,
    written to or compared with the JSON file(s) of `template`."""

    def __init__(self, template: str, *, save: bool):
        self.template, self.save = template, save
        self.flag = "--ci-save-grad-norm" if save else "--ci-load-grad-norm"
        self._files: dict[Path, dict[str, float]] = {}   # save: what this run wrote; load: what was read

    def path(self, role: str, rollout_id: int, step: int) -> Path:
        return Path(self.template.format(role=role, rollout_id=rollout_id, step_id=step))

    def take(self, role: str, rollout_id: int, norms: list[float]) -> None:
        """Record the rollout's norms (save), or compare them with the recorded ones."""
        (self._record if self.save else self._compare)(role, rollout_id, norms)

    def _record(self, role: str, rollout_id: int, norms: list[float]) -> None:
        touched = set()
        for step, norm in enumerate(norms):
            path = self.path(role, rollout_id, step)
            self._files.setdefault(path, {})[f"{role}/{rollout_id}/{step}"] = norm     # a fresh record per run
            touched.add(path)
        for path in touched:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(self._files[path], indent=1))
            os.replace(tmp, path)

    def _compare(self, role: str, rollout_id: int, norms: list[float]) -> None:
        for step, norm in enumerate(norms):
            path, key = self.path(role, rollout_id, step), f"{role}/{rollout_id}/{step}"
            expected = self._read(path).get(key)
            if expected is None:
                raise CICheckFailed(f"{self.flag} {path}: no gradient norm recorded for {key} (the {role}'s step "
                                    f"{step} of rollout {rollout_id}); record it with --ci-save-grad-norm on a run "
                                    "of the same flags")
            if not _norms_match(norm, expected):
                raise CICheckFailed(f"{self.flag} {path}: the {role}'s gradient norm at rollout {rollout_id} step "
                                    f"{step} is {norm:.6g}, the recorded one {expected:.6g} (tolerance: relative "
                                    f"{GRAD_NORM_REL_TOL}, absolute {GRAD_NORM_ABS_TOL})")

    def _read(self, path: Path) -> dict[str, float]:
        if path not in self._files:
            if not path.is_file():
                raise CICheckFailed(f"{self.flag} {path}: no such file; write it with --ci-save-grad-norm first")
            self._files[path] = json.loads(path.read_text())
        return self._files[path]


def _norms_match(actual: float, expected: float) -> bool:
    """Within miles' tolerance; two NaNs (a float16 step skipped on both runs) match."""
    if math.isnan(actual) or math.isnan(expected):
        return math.isnan(actual) and math.isnan(expected)
    return math.isclose(actual, expected, rel_tol=GRAD_NORM_REL_TOL, abs_tol=GRAD_NORM_ABS_TOL)


def write_model_hash(folder: Path, digest: str) -> None:
    (folder / MODEL_HASH_FILE).write_text(json.dumps({"trainer_float32_sha256": digest}))


def check_model_hash(folder: Path, digest: str) -> None:
    """--ci-check-model-hash: the weights just loaded from `folder` hash to what its save wrote."""
    path = folder / MODEL_HASH_FILE
    if not path.is_file():
        raise CICheckFailed(f"--ci-check-model-hash: {path} does not exist; the checkpoint was not saved with "
                            "--ci-test --ci-save-model-hash")
    expected = json.loads(path.read_text()).get("trainer_float32_sha256")
    if digest != expected:
        raise CICheckFailed(f"--ci-check-model-hash: the trainer's weights loaded from {folder} hash to {digest}, "
                            f"not to {expected} as when they were saved ({path}): the checkpoint round trip "
                            "changed them")


@dataclass
class CIGates:
    """The gates a run's flags ask for (None: not asked)."""

    metric: MetricGate | None = None
    grad_norms: GradNormRecord | None = None
    model_hash_saved: bool = False      # --ci-save-model-hash
    model_hash_checked: bool = False    # --ci-check-model-hash

    @classmethod
    def of(cls, cfg: RunConfig) -> CIGates:
        key, path = cfg.ci_metric_checker_key, cfg.ci_save_grad_norm or cfg.ci_load_grad_norm
        return cls(metric=MetricGate(key, cfg.ci_metric_checker_threshold) if key is not None else None,
                   grad_norms=GradNormRecord(path, save=cfg.ci_save_grad_norm is not None) if path else None,
                   model_hash_saved=cfg.ci_save_model_hash, model_hash_checked=cfg.ci_check_model_hash)

    def after_train(self, rollout_id: int, metrics: dict[str, Any]) -> dict[str, int]:
        """Take the step norms out of a train call's `metrics` (they are not a row's numbers) and record
        or compare them; per role, how many steps were."""
        norms = {role: metrics.pop(key) for role, key in ROLE_KEYS.items() if key in metrics}
        if self.grad_norms is None:
            return {}
        for role, values in norms.items():
            self.grad_norms.take(role, rollout_id, values)
        return {role: len(values) for role, values in norms.items()}
