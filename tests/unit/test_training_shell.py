"""The shell the trainer and the critic share, on a one-layer model: the step, the schedule, the
optimizer state on disk, disposal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.config import TrainConfig
from miles.training.critic import Critic
from miles.training.shell import OptimizedModel
from miles.training.trainer import Trainer


class Linear(OptimizedModel):
    role, state_file, lr_hint = "linear", "linear_state.json", "--linear-lr"

    def __init__(self, **train):
        super().__init__(train=TrainConfig(**{"lr": 0.1, **train}), device="cpu", dtype="auto")
        self._start_optimizer(nn.Linear(2, 1))

    def step(self, x: torch.Tensor) -> float:
        model = self._live()
        self._optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return self._optimizer_step()


def test_a_non_finite_gradient_stops_before_any_weight_changes():
    m = Linear()
    before = [p.detach().clone() for p in m._live().parameters()]
    with pytest.raises(FloatingPointError, match="linear gradient norm is nan at optimizer step 0; lower --linear-lr"):
        m.step(torch.tensor([[float("nan"), 1.0]]))
    assert all(torch.equal(a, b) for a, b in zip(before, m._live().parameters())) and m.num_steps == 0


def test_the_schedule_sets_each_steps_rate_and_the_state_round_trips(tmp_path):
    # warmup over 2 steps: lr * (step + 1) / 2 = 0.05, 0.1; then linear decay from 0.1 at step 2 (p = 0)
    m = Linear(lr_warmup_iters=2, lr_decay_style="linear", lr_decay_iters=10)
    rates = []
    for _ in range(3):
        m.step(torch.ones(1, 2))
        rates.append(m._optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.05, 0.1, 0.1])
    m._save_optimizer(tmp_path)
    fresh = Linear(lr_warmup_iters=2, lr_decay_style="linear", lr_decay_iters=10)
    fresh._load_optimizer(tmp_path)
    assert fresh.num_steps == 3 and (tmp_path / "linear_state.json").is_file()
    assert fresh._optimizer.state_dict()["state"][0]["step"] == m._optimizer.state_dict()["state"][0]["step"]


def test_dispose_is_idempotent_and_later_use_names_the_role():
    m = Linear()
    m.dispose()
    m.dispose()
    with pytest.raises(RuntimeError, match="the linear was disposed"):
        m.step(torch.ones(1, 2))


def test_trainer_and_critic_are_the_shell():
    assert issubclass(Trainer, OptimizedModel) and issubclass(Critic, OptimizedModel)
    assert (Trainer.state_file, Critic.state_file) == ("trainer_state.json", "critic_state.json")   # on-disk names kept
