"""Context parallelism without Transformer Engine (`miles.training.megatron.context_parallel`), on
two gloo ranks: each rank's causal attention over the gathered keys and values equals full causal
attention at its positions, forward and backward (grouped-query attention included), and each
rank's logits give the whole sequence's logprobs and entropies, with their gradients, as the
shared objective computes them from the whole logits. Needs only torch (no megatron-core)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from miles.training.megatron.context_parallel import cp_positions, sequence_order


def test_sequence_order_sorts_the_ranks_chunks():
    # CP 2, 8 positions: rank 0 holds chunks 0 and 3 ([0, 1] [6, 7]), rank 1 chunks 1 and 2 ([2, 3] [4, 5])
    assert cp_positions(0, 2, 8).tolist() == [0, 1, 6, 7] and cp_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    gathered = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])
    assert gathered[sequence_order(2, 8)].tolist() == list(range(8))
    gathered3 = torch.cat([cp_positions(r, 3, 12) for r in range(3)])
    assert gathered3[sequence_order(3, 12)].tolist() == list(range(12))


def full_causal_attention(q, k, v, heads_per_group, scale):
    """The reference: [S, b, n, h] inputs, every query over the keys at positions <= its own."""
    k, v = (t.repeat_interleave(heads_per_group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def check_attention(rank, cp, group):
    from miles.training.megatron.context_parallel import gathered_kv_attention

    torch.manual_seed(0)                                      # the same full tensors on every rank
    seq, b, heads, groups, dim = 8 * cp, 2, 4, 2, 8           # GQA: 2 query heads per key/value head
    q = torch.randn(seq, b, heads, dim, requires_grad=True)
    k, v = (torch.randn(seq, b, groups, dim, requires_grad=True) for _ in range(2))
    weight = torch.randn(seq, b, heads * dim)
    want = full_causal_attention(q, k, v, heads // groups, 0.3)
    (want * weight).sum().backward()

    pos = cp_positions(rank, cp, seq)
    ql, kl, vl = (t.detach()[pos].requires_grad_() for t in (q, k, v))
    got = gathered_kv_attention(ql, kl, vl, group, heads_per_group=heads // groups, scale=0.3)
    (got * weight[pos]).sum().backward()
    torch.testing.assert_close(got, want.detach()[pos], rtol=1e-5, atol=1e-5)
    # the keys' and values' gradients come from every rank's queries: summed back to their owner
    for local, full in ((ql, q), (kl, k), (vl, v)):
        torch.testing.assert_close(local.grad, full.grad[pos], rtol=1e-5, atol=1e-5)


def check_token_terms(rank, cp, group):
    from miles.algorithms import entropy_from_logits
    from miles.config import AlgorithmConfig, RolloutConfig
    from miles.training.megatron.context_parallel import ContextSplit, token_terms
    from miles.training.terms import PolicyObjective

    objective = PolicyObjective(AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3", entropy_coef=0.01),
                                RolloutConfig(n_samples_per_prompt=8, batch_size=1, temperature=0.7, max_response_len=8))
    torch.manual_seed(1)
    b, seq, vocab = 3, 4 * cp, 11
    logits = torch.randn(b, seq, vocab, requires_grad=True)
    tokens = torch.randint(0, vocab, (b, seq))
    c, d = torch.randn(b, seq), torch.randn(b, seq)
    want_lp, want_ent = objective.logprobs(logits, tokens), entropy_from_logits(logits, 0.7)
    ((want_lp * c).sum() + (want_ent * d).sum()).backward()

    split = ContextSplit(rank=rank, size=cp, group=group)
    pos = cp_positions(rank, cp, seq)
    local = logits.detach()[:, pos].requires_grad_()             # this rank's logits [b, seq / cp, V]
    lp, ent = token_terms(split, objective, local, tokens, with_entropy=True)
    # every CP rank computes the same loss of the whole terms; each backpropagates its own positions
    ((lp * c).sum() + (ent * d).sum()).backward()
    torch.testing.assert_close(lp, want_lp.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, want_ent.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(local.grad, logits.grad[:, pos], rtol=1e-5, atol=1e-6)
    assert torch.equal(split.local(tokens), tokens[:, pos])


def run_rank(rank, cp, port, out_dir):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
        check_attention(rank, cp, dist.group.WORLD)
        check_token_terms(rank, cp, dist.group.WORLD)
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("cp", [2, 3])
def test_ranks_attention_and_terms_equal_the_whole_sequences(tmp_path, cp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(r, cp, port, str(tmp_path))) for r in range(cp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    errors = [f.read_text() for f in sorted(tmp_path.glob("*.err"))]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not errors and all(p.exitcode == 0 for p in procs), "\n".join(errors) or [p.exitcode for p in procs]
