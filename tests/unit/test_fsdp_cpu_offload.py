"""--optimizer-cpu-offload on FSDP ranks (gloo, spawned processes): each rank's shards of AdamW's
moments live in its host buffers from the first step on, and the steps, and the resume of the
one-process checkpoint (DCP puts the loaded state on the device; it is moved to the buffers), give
the one-process trainer's metrics and weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.unit.test_fsdp_ranks import (RANKS_TRAIN, ROLLOUT, assert_same, configs, end_rank_process,  # noqa: F401
                                        free_port, model_path, one_rank)
from tests.unit.test_trainer import host_held


def _rank_main(rank: int, world_size: int, port: int, model: str, out: str, ck: str):
    torch.set_num_threads(1)
    from miles.training.torch.fsdp.rank import FSDPRank

    t = FSDPRank(model, rank=rank, world_size=world_size, hidden_forward=True,
                 **configs(**RANKS_TRAIN, optimizer_cpu_offload=True))
    t.setup("127.0.0.1", port)
    results, held = [(t.train(ROLLOUT, 0), t.weights())], [host_held(t)]
    t.load(ck)
    held.append(host_held(t))
    results.append((t.train(ROLLOUT, 1), t.weights()))
    held.append(host_held(t))
    torch.save((results, held), Path(out) / f"rank_{rank}.pt")
    t.dispose()
    end_rank_process()


def test_fsdp_ranks_keep_their_moment_shards_on_the_host_and_take_the_one_rank_steps(model_path, one_rank, tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), model_path, str(tmp_path), str(one_rank[1])), nprocs=2)
    for r in range(2):
        results, held = torch.load(tmp_path / f"rank_{r}.pt", weights_only=False)
        assert held == [True, True, True], (r, held)     # after the first step, the load, the next step
        assert_same(results, one_rank[0][:2])
