"""Serve rollout batches of prompts, epoch after epoch, resumably.

Order: epoch `e` visits every prompt once, in a permutation drawn from `random.Random` seeded with
the string "{seed}/{epoch}" (string seeds hash through SHA-512, so the order is the same in every
process and Python version, and seeds and epochs never alias as `seed + epoch` would); without
shuffle the order is the file's.

End of an epoch: like miles, a batch that does not fit in what is left of the epoch takes that rest
and continues into the next epoch's order, so no prompt is ever skipped. One batch can then hold
the same prompt twice (the end of one epoch and the start of the next). `num_batches_per_epoch` is
floor(len(prompts) / batch_size), the number of whole batches an epoch provides.

Resume: `state_dict()` is plain JSON-able data (epoch, offset, seed, shuffle, num_prompts); an
iterator built over the same prompts that loads it yields exactly the batches the uninterrupted
one would have.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import structlog

from miles.config import ConfigError
from miles.types import Prompt

log = structlog.get_logger("miles.data")


class PromptIterator:
    def __init__(self, prompts: Sequence[Prompt], batch_size: int, *, shuffle: bool, seed: int):
        if not prompts:
            raise ConfigError("the prompt dataset is empty; nothing to iterate over")
        if batch_size < 1:
            raise ConfigError(f"--rollout-batch-size {batch_size} must be at least 1")
        if batch_size > len(prompts):
            raise ConfigError(f"--rollout-batch-size {batch_size} is larger than the dataset ({len(prompts)} "
                              "prompts after filtering); lower --rollout-batch-size or add prompts")
        self._prompts = list(prompts)
        self._batch_size = batch_size
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._offset = 0
        self._order: list[int] = []
        self._order_epoch: int | None = None  # which epoch `_order` belongs to

    @property
    def epoch(self) -> int:
        """Epoch of the next prompt to be served (0-based)."""
        return self._epoch

    @property
    def offset(self) -> int:
        """Position of the next prompt within its epoch's order."""
        return self._offset

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_batches_per_epoch(self) -> int:
        return len(self._prompts) // self._batch_size

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """The next `size` prompts (default: the batch size; at most it)."""
        n, size = len(self._prompts), self._batch_size if size is None else min(size, self._batch_size)
        batch: list[Prompt] = []
        while len(batch) < size:  # at most twice, since size <= batch_size <= n
            take = min(size - len(batch), n - self._offset)
            order = self._order_for(self._epoch)
            batch.extend(self._prompts[i] for i in order[self._offset : self._offset + take])
            self._offset += take
            if self._offset == n:
                self._epoch, self._offset = self._epoch + 1, 0
        return batch

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self._prompts)))
            if self._shuffle:
                random.Random(f"{self._seed}/{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "offset": self._offset, "seed": self._seed,
                "shuffle": self._shuffle, "num_prompts": len(self._prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; its seed and shuffle win over the constructor's."""
        n = len(self._prompts)
        if state["num_prompts"] != n:
            raise ConfigError(f"the data iterator was saved over {state['num_prompts']} prompts but the "
                              f"dataset now has {n}; resume with the same --prompt-data and --max-prompt-len")
        if not 0 <= state["offset"] < n or state["epoch"] < 0:
            raise ConfigError(f"corrupt data iterator state: epoch {state['epoch']}, offset {state['offset']} "
                              f"for {n} prompts")
        if (state["seed"], state["shuffle"]) != (self._seed, self._shuffle):
            log.warning("data_iterator_state_overrides", saved_seed=state["seed"], seed=self._seed,
                        saved_shuffle=state["shuffle"], shuffle=self._shuffle)
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])
        self._seed, self._shuffle = state["seed"], bool(state["shuffle"])
        self._order_epoch = None
