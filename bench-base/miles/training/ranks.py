"""The Ray side of a trainer on many ranks: one actor per rank, joined in one torch.distributed group,
driven by the trainer actor the phases talk to (the megatron backend's `MegatronTrainer`, the torch
backend's `FSDPTrainer`).

`RankGroup` starts the rank actors (one per placement: `options`, a dict of Ray actor options each),
gives rank 0's address and a free port to every rank's `setup`, fans every call out to all ranks
(`all`: the first rank to fail raises at once; the others may be stuck in a collective waiting for
it), and tears them down (`dispose`: each rank gets `DISPOSE_TIMEOUT_S` to free its state and
process group, then every rank is killed). The ranks are owned by the actor that made the group: if
it dies, Ray reaps them.

A rank class takes `rank=` and `world_size=` keywords besides its own, and has `setup(address,
port)` (join the group) and `dispose()`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

log = structlog.get_logger().bind(role="trainer")

DISPOSE_TIMEOUT_S = 60.0
# rank r's actor is named prefix + str(r) in the run's namespace: the policy's ranks by default, PPO's
# critic's ranks (which run beside them) under their own prefix
RANK_ACTOR_PREFIX, CRITIC_RANK_ACTOR_PREFIX = "trainer-rank-", "critic-rank-"


def rendezvous_address(_actor: Any) -> tuple[str, int]:
    """Rank 0's node address and a free port on it (run inside rank 0's actor)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def ranks_use_gpus(device: str) -> bool:
    """Whether the ranks run on GPUs: --device, with "auto" decided by the connected cluster's GPUs."""
    import ray

    from miles.config.schema import uses_gpus

    return uses_gpus(device, int(ray.cluster_resources().get("GPU", 0)))


def rank_actor_options(device: str, rank_options: Sequence[Mapping[str, Any]] | None,
                       world_size: int | None) -> list[dict[str, Any]]:
    """Each rank's Ray actor options: the placements the composition root gave (`rank_options`, on
    GPUs), else `world_size` ranks (default 1) of a whole GPU each, or none on the CPU."""
    if rank_options:
        return [dict(o) for o in rank_options]
    return [{"num_gpus": 1 if ranks_use_gpus(device) else 0}] * (world_size or 1)


class RankGroup:
    def __init__(self, rank_cls: type, options: Sequence[Mapping[str, Any]], *args: Any, namespace: str | None = None,
                 prefix: str = RANK_ACTOR_PREFIX, **kwargs: Any):
        """One `rank_cls(*args, rank=r, world_size=len(options), **kwargs)` actor per entry of `options`,
        named `prefix` + r in `namespace` (the run's: an actor's own default is its driver's, not the one
        it was made in), then `setup` on all of them. Whatever fails here disposes the ranks made so far."""
        import ray

        from miles.cluster.ray_cluster import in_driver_cwd
        from miles.user_code import DRIVER_CWD_ENV

        # a rank reads user files (--custom-loss-function-path) from the driver's directory, as its owner does
        cwd = os.environ.get(DRIVER_CWD_ENV)
        remote = ray.remote(in_driver_cwd(rank_cls, cwd) if cwd else rank_cls)
        self.world_size = len(options)
        self._ranks: list[Any] | None = []
        self._broken = False     # a call failed on one rank while others were still in it
        try:
            for r, o in enumerate(options):
                self._ranks.append(remote.options(**{"num_cpus": 0, "name": f"{prefix}{r}", **o,
                                                       **({"namespace": namespace} if namespace else {})}).remote(
                    *args, rank=r, world_size=self.world_size, **kwargs))
            address, port = ray.get(self._ranks[0].__ray_call__.remote(rendezvous_address))
            self.all("setup", address, port)
        except BaseException:
            self.dispose()
            raise

    def all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(*args, **kwargs)` on every rank, results in rank order; the first rank to fail raises
        here without waiting for the rest."""
        import ray

        refs = [getattr(rank, method).remote(*args, **kwargs) for rank in self.live()]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except BaseException:
                # the ranks still in the call may wait forever in a collective with the failed one
                self._broken = self._broken or bool(pending)
                raise
        return ray.get(refs)

    def live(self) -> list[Any]:
        if self._ranks is None:
            raise RuntimeError("the trainer's ranks were disposed; create a new trainer")
        return self._ranks

    def dispose(self) -> None:
        """Each rank frees its state and process group (within DISPOSE_TIMEOUT_S: a rank stuck in a
        collective does not answer), then every rank is killed; after a call that failed on one rank
        while others were in it (a rank died mid-step), the ranks are killed at once. Idempotent. The
        owner actor is the run's."""
        import ray

        ranks, self._ranks = self._ranks, None
        if not ranks:
            return
        refs = [] if self._broken else [rank.dispose.remote() for rank in ranks]
        done, stuck = ray.wait(refs, num_returns=len(refs), timeout=DISPOSE_TIMEOUT_S) if refs else ([], [])
        if stuck:
            log.warning("rank_dispose_timeout", ranks=[refs.index(r) for r in stuck], timeout_s=DISPOSE_TIMEOUT_S)
        for rank in ranks:
            ray.kill(rank, no_restart=True)
        for ref in done:
            ray.get(ref)          # a rank whose teardown raised: said after every rank is gone
