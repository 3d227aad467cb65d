"""The shell the trainer and the critic share, on a one-layer model: the step, the schedule, the
optimizer state on disk, disposal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles.config import TrainConfig
from miles.training.torch.critic import Critic
from miles.training.torch.shell import OptimizedModel
from miles.training.torch.trainer import Trainer


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


def test_a_linear_weight_decay_schedule_sets_each_steps_decay():
    # Megatron-LM's get_wd at num_steps = step, over --lr-decay-iters 4 steps from .0 to .1:
    # step s: .1 * s / 4 -> 0, .025, .05, .075, .1, then .1 (past the end)
    m = Linear(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1, lr_decay_iters=4)
    decays = []
    for _ in range(6):
        m.step(torch.ones(1, 2))
        decays.append(m._optimizer.param_groups[0]["weight_decay"])
    assert decays == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.1])
    assert m._schedule_metrics() == pytest.approx({"lr": 0.1, "weight_decay": 0.1})
    assert "weight_decay" not in Linear(weight_decay=0.3)._schedule_metrics()


def test_the_scheduled_weight_decay_is_what_adamw_applies():
    # AdamW decays p by lr * wd before its update: with a zero gradient (x = 0 reaches the weight only)
    # the weight moves by exactly -lr * wd * p; step 0 of cosine from .2 is .2: p * (1 - .1 * .2)
    m = Linear(weight_decay_incr_style="cosine", start_weight_decay=0.2, end_weight_decay=0.4, lr_decay_iters=10)
    w = m._live().weight.detach().clone()
    m.step(torch.zeros(1, 2))
    assert torch.allclose(m._live().weight.detach(), w * (1 - 0.1 * 0.2), atol=1e-7)


def test_a_model_without_decoupled_groups_refuses_a_decoupled_rate():
    # the critic and the FSDP ranks are such models (decouples_lr False); the one-process policy is not
    from miles.training.torch.fsdp.rank import FSDPRank
    assert (Trainer.decouples_lr, Critic.decouples_lr, FSDPRank.decouples_lr) == (True, False, False)

    class LinearLM(Linear):
        def __init__(self, **train):
            OptimizedModel.__init__(self, train=TrainConfig(**{"lr": 0.1, **train}), device="cpu", dtype="auto")
    with pytest.raises(ValueError, match="--decoupled-lr is not supported for the linear yet"):
        LinearLM(decoupled_lr=0.5)._start_optimizer(nn.Linear(2, 1))


def test_the_decoupled_rate_has_the_main_schedules_shape_between_its_own_bounds():
    from miles.training.schedule import lr_schedule

    # warmup 2, cosine to step 6: main 1 -> .1, decoupled 2 -> .2; step 4 (p = .5): .55 and .2 + 1.8 / 2 = 1.1
    cfg = TrainConfig(lr=1.0, min_lr=0.1, decoupled_lr=2.0, decoupled_min_lr=0.2, lr_warmup_iters=2,
                      lr_decay_iters=6, lr_decay_style="cosine")
    main, own = lr_schedule(cfg), lr_schedule(cfg, decoupled=True)
    assert [own(s) for s in (0, 1, 4, 6, 9)] == pytest.approx([1.0, 2.0, 1.1, 0.2, 0.2])
    assert [main(s) for s in (0, 1, 4, 6)] == pytest.approx([0.5, 1.0, 0.55, 0.1])
    # no --decoupled-min-lr: --min-lr, as Megatron-LM's group keeps the default min_lr
    from dataclasses import replace
    assert lr_schedule(replace(cfg, decoupled_min_lr=None), decoupled=True)(6) == pytest.approx(0.1)
