"""Where a run's metrics go: metrics.jsonl always; TensorBoard, W&B and MLflow when asked; behind one `Tracker`.

The phases call `ctx.c.metrics.log(step, row)` once per trained rollout and once per eval; the
`Tracker` hands each row to every sink. `init` opens the sinks one at a time (`open_sinks`) and
registers each with the run's disposer as it opens, so a W&B login that fails still leaves the
metrics file and the TensorBoard writer to be closed by the teardown; `draining` flushes them.

TensorBoard and W&B are optional extras (`pip install miles[tensorboard]`, `miles[wandb]`), MLflow a
package of its own (`pip install mlflow`): asking for one that is not installed is a configuration
error, found with the flags (`tracking_problems`).
Both get numbers only, tagged `<kind>/<key>` (`train/reward_mean`) unless the key already has a
section (`eval/arith/pass@1`), against the rollout id; W&B plots them over its own `rollout` axis
because evals of the async machine can arrive after the next rollout's row.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

from miles.config import ConfigError, RunConfig, TrackingConfig
from miles.config.checks import check
from miles.config.packages import missing_package
from miles.tracking.metrics import MetricsWriter

EXTRAS = {"use_tensorboard": ("tensorboard", "--use-tensorboard", "tensorboard"),
          "use_wandb": ("wandb", "--use-wandb", "wandb"),
          "use_mlflow": ("mlflow", "--use-mlflow", None)}   # field: (module, flag, extra or None: pip install module)


class Sink(Protocol):
    resource_name: str

    def log(self, step: int, row: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def dispose(self) -> None: ...


class Tracker:
    """Fan-out of metrics rows to the run's sinks. Owns none of them: each sink is registered with
    the run's disposer where `init` opens it, and closed by the teardown."""

    def __init__(self, sinks: list[Sink] | None = None):
        self.sinks: list[Sink] = list(sinks or [])

    def add(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()


def tracking_problems(cfg: TrackingConfig) -> list[str]:
    """Sinks asked for whose package is missing, each with the install line that fixes it."""
    problems = []
    for field_name, (module, flag, extra) in EXTRAS.items():
        if getattr(cfg, field_name) and (problem := missing_package(flag, module, module, extra)):
            problems.append(f"{problem} (or drop {flag})")
    return problems


def open_sinks(cfg: TrackingConfig, *, run_dir: Path, run_id: str, run_config: dict[str, Any]) -> Iterator[Sink]:
    """Open the run's sinks one by one: the caller registers each with the disposer before the next opens."""
    problems = tracking_problems(cfg)
    if problems:
        raise ConfigError(problems)
    yield MetricsWriter(run_dir / "metrics.jsonl")
    if cfg.use_tensorboard:
        yield TensorBoardSink(Path(cfg.tensorboard_dir or run_dir / "tensorboard"))
    if cfg.use_wandb:
        yield WandbSink(cfg, run_dir=run_dir, run_id=run_id, run_config=run_config)
    if cfg.use_mlflow:
        yield MlflowSink(run_dir=run_dir, run_id=run_id, run_config=run_config)


def scalars(step: int, row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers as `section/key` tags (bools and the bookkeeping keys left out)."""
    kind = row.get("kind") or "train"
    out = {}
    for key, value in row.items():
        if key in ("step", "kind", "rollout_id") or isinstance(value, bool):
            continue
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key if "/" in key else f"{kind}/{key}"] = float(value)
    return out


class TensorBoardSink:
    """Scalars in a TensorBoard event folder (torch's SummaryWriter). The run owns the writer."""

    resource_name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter   # needs the `tensorboard` package

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, row: dict[str, Any]) -> None:
        for tag, value in scalars(step, row).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def dispose(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbSink:
    """One W&B run per miles run (its id is the run id), in online, offline or disabled mode. The run
    owns the W&B run and finishes it; W&B's service process is W&B's own business."""

    resource_name = "wandb"

    def __init__(self, cfg: TrackingConfig, *, run_dir: Path, run_id: str, run_config: dict[str, Any]):
        import wandb

        wandb_dir = Path(cfg.wandb_dir or run_dir / "wandb")
        wandb_dir.mkdir(parents=True, exist_ok=True)
        mode = cfg.wandb_mode or os.environ.get("WANDB_MODE") or "online"
        # console="off": W&B must not wrap stdout/stderr under the CLI's live display;
        # reinit="create_new": two runs embedded in one process each get their own W&B run;
        # --wandb-key: this W&B run's key only (wandb.login would write it to ~/.netrc for every later run)
        key = {"api_key": cfg.wandb_key} if cfg.wandb_key else {}
        settings = wandb.Settings(console="off", silent=True, reinit="create_new", **key)
        self.mode = mode
        self._run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_team, group=cfg.wandb_group,
                               name=run_id, id=run_id, dir=str(wandb_dir), mode=mode, config=run_config,
                               settings=settings)
        self._run.define_metric("rollout")
        self._run.define_metric("*", step_metric="rollout")

    def log(self, step: int, row: dict[str, Any]) -> None:
        self._run.log({"rollout": step, **scalars(step, row)})

    def flush(self) -> None:
        """W&B writes rows as they come; nothing is buffered on our side."""

    def dispose(self) -> None:
        """Finish the W&B run (uploads what is left in online mode; closes the offline files)."""
        self._run.finish()


class MlflowSink:
    """One MLflow run per miles run (its name is the run id), through an `MlflowClient` of its own,
    so two runs embedded in one process never share MLflow's global active run. Tracking URI:
    $MLFLOW_TRACKING_URI, else `<run_dir>/mlruns`; experiment: $MLFLOW_EXPERIMENT_NAME, else miles.
    The run owns the MLflow run and ends it."""

    resource_name = "mlflow"
    PARAM_CHARS = 500                # MLflow's limit on a parameter value

    def __init__(self, *, run_dir: Path, run_id: str, run_config: dict[str, Any]):
        import mlflow
        from mlflow.entities import Metric, Param

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "miles"
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        self._run_id = self._client.create_run(experiment_id, run_name=run_id, tags={"miles.run_id": run_id}).info.run_id
        params = [Param(k, str(v)[:self.PARAM_CHARS]) for k, v in _flatten(run_config).items()]
        for i in range(0, len(params), 100):            # MLflow takes at most 100 params per batch
            self._client.log_batch(self._run_id, params=params[i:i + 100])

    def log(self, step: int, row: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, step) for k, v in scalars(step, row).items()]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)

    def flush(self) -> None:
        """MLflow writes each batch as it is logged; nothing is buffered on our side."""

    def dispose(self) -> None:
        """End the MLflow run (FINISHED)."""
        self._client.set_terminated(self._run_id)


def mlflow_key(tag: str) -> str:
    """MLflow keys allow letters, digits, _ - . / space and colon: `pass@4` becomes `pass_at_4`."""
    return re.sub(r"[^\w.\-/ :]", "_", tag.replace("@", "_at_"))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@check
def _sinks(cfg: RunConfig, problems: list[str]) -> None:
    problems.extend(tracking_problems(cfg.tracking))
