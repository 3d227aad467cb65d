"""A host program embedding miles: two runs at once, watched through their events; one is stopped
mid-rollout, the other runs to its end. The host keeps its own event loop and signal handlers.

    python examples/embed/host.py [--model DIR] [--data FILE] [--out DIR]

(defaults: the arithmetic demo's model and data; run dirs under runs/embed/).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import ray

import miles

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "arithmetic"


def config(model: str, data: str, run_dir: Path, *, seed: int, num_rollout: int) -> miles.RunConfig:
    return miles.config_from_flags([
        "--hf-checkpoint", model, "--prompt-data", data, "--label-key", "label",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
        "--num-rollout", str(num_rollout), "--lr", "1e-3", "--seed", str(seed),
        "--run-dir", str(run_dir), "--trace-console", "off"])


async def watch(name: str, run: miles.Run, log: list[str]) -> None:
    async for ev in run.events():
        if isinstance(ev, miles.Transition):
            log.append(f"{name}: {ev.src} -{ev.trigger}-> {ev.dst}")
        elif isinstance(ev, miles.Metrics):
            log.append(f"{name}: rollout {ev.step} reward {ev.values.get('reward_mean')}")


async def main(model: str, data: str, out: Path) -> dict[str, miles.Result]:
    ray.init(include_dashboard=False, logging_level="WARNING")   # one cluster, shared by both runs
    # what the host has once it hands over to miles (ray.init above installs Ray's own SIGTERM handler)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopped = miles.Run(config(model, data, out / "stopped", seed=1, num_rollout=50))
        finished = miles.Run(config(model, data, out / "finished", seed=2, num_rollout=3))
        log: list[str] = []
        async with stopped, finished:
            watchers = [asyncio.create_task(watch("stopped", stopped, log)),
                        asyncio.create_task(watch("finished", finished, log))]
            entered = asyncio.Event()
            stopped.on_state("rollout", lambda state: entered.set())
            await entered.wait()                 # the first run is rolling out: stop it
            stop_result = await stopped.stop()
            finish_result = await finished.wait()
            await asyncio.gather(*watchers)
        print("\n".join(log[-8:]))
        print(f"stopped:  {stop_result.outcome} in {stop_result.run_dir}")
        print(f"finished: {finish_result.outcome} in {finish_result.run_dir}")
        after = {s: signal.getsignal(s) for s in handlers}
        print("host signal handlers untouched:", after == handlers)
        return {"stopped": stop_result, "finished": finish_result}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO / "base_model"))
    p.add_argument("--data", default=str(DEMO / "data" / "train.jsonl"))
    p.add_argument("--out", default="runs/embed")
    a = p.parse_args()
    asyncio.run(main(a.model, a.data, Path(a.out)))
