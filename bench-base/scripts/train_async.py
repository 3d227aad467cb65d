"""Async GRPO/PPO driver, miles' train_async.py shape: `python scripts/train_async.py <miles flags>`.

Rollout r+1 generates while rollout r trains (one step off-policy; with --update-weights-interval N
up to N steps). The lifecycle is machines/async.yaml; what the seed wrote inline,
    asyncio.run(with_disposer(train, args))
is `miles.cli.train.run_with_signals`, which adds the CLI's signal handling and exit codes.
The policy loss needs an off-policy correction here: --use-tis or --use-rollout-logprobs.
"""

import sys

from miles.cli.train import main

if __name__ == "__main__":
    sys.exit(main(default_machine="async", prog="scripts/train_async.py"))
