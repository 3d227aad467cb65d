"""On-policy distillation (OPD): a teacher's per-token logprobs of the student's own samples pull the
student towards the teacher, through the advantages (Agarwal et al. 2024, GKD; Thinking Machines'
"On-Policy Distillation", 2025; miles' `apply_opd_kl_to_advantages`).

Per response token t of a sample the student drew, the sampled-token reverse KL estimate is
`student_logprob[t] - teacher_logprob[t]` (log pi_S(y_t) - log pi_T(y_t): its expectation over the
student's own samples is KL(pi_S || pi_T)), and the advantage becomes

    A'[t] = A[t] - opd_kl_coef * (student_logprob[t] - teacher_logprob[t])

on top of any estimator's advantages (pure OPD: rewards that contribute nothing, e.g. a constant one,
so A = 0). Tensors are [B, T] aligned to tokens (see `miles.algorithms.entropy`); off the mask the
result keeps the advantage as given and the KL is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def opd_advantages(advantages: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor,
                   kl_coef: float) -> tuple[Tensor, Tensor]:
    """(advantages - kl_coef * reverse KL, the per-token reverse KL), both [B, T]; the KL is
    `student_logprobs - teacher_logprobs` on the mask, 0 off it."""
    if not (advantages.shape == student_logprobs.shape == teacher_logprobs.shape == mask.shape):
        raise ValueError(f"OPD needs per-token tensors of one shape: advantages {tuple(advantages.shape)}, "
                         f"student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)}, "
                         f"mask {tuple(mask.shape)}")
    reverse_kl = torch.where(mask, student_logprobs - teacher_logprobs, torch.zeros((), device=mask.device))
    return advantages - kl_coef * reverse_kl, reverse_kl
