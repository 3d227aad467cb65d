"""What programs call: `train` (the driver, `asyncio.run(with_disposer(train, cfg))`, in `launch`) and
`Run` (a host starts, watches and stops runs in-process, in `embed`).

`miles.Run`, `miles.run_sync` and the event records load from here lazily (see `miles/__init__.py`),
so importing miles does not import torch or Ray.
"""

from .embed import Metrics, Result, Run, RunEnded, RunEvent, Teardown, Transition, run_sync

__all__ = ["Metrics", "Result", "Run", "RunEnded", "RunEvent", "Teardown", "Transition", "run_sync"]
