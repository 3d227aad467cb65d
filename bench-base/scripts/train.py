"""Sync GRPO/PPO driver, miles' train.py shape: `python scripts/train.py <miles flags>`.

The lifecycle is machines/sync.yaml; the phases live in miles/phases. What the seed wrote inline,
    asyncio.run(with_disposer(train, args))
is `miles.cli.train.run_with_signals`, which adds the CLI's signal handling and exit codes.
"""

import sys

from miles.cli.train import main

if __name__ == "__main__":
    sys.exit(main(default_machine="sync", prog="scripts/train.py"))
