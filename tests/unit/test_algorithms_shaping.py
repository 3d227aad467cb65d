"""DAPO's overlong penalty and the group reward std that dynamic sampling filters on."""

import pytest
import torch

from miles.algorithms import group_reward_std, overlong_penalty


def test_overlong_penalty_is_linear_over_the_buffer_then_flat():
    # max 8, buffer 4: free up to 4 tokens; 5 -> (4 - 5) / 4 = -.25; 6 -> -.5; 8 -> -1; 9 (over) -> -1
    got = overlong_penalty(torch.tensor([1, 4, 5, 6, 8, 9]), max_len=8, buffer_len=4, factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    # the factor scales it: 6 tokens with factor .5 -> -.25
    assert overlong_penalty(torch.tensor([6]), max_len=8, buffer_len=4, factor=0.5).tolist() == [-0.25]


def test_overlong_penalty_rejects_a_buffer_outside_the_budget():
    with pytest.raises(ValueError, match="buffer length"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=2, factor=-1.0)


def test_group_reward_std_is_zero_only_for_all_equal_groups():
    # groups [1, 1] -> 0; [1, 0] -> population std .5; [2, 2] -> 0
    assert group_reward_std(torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0]), 2).tolist() == [0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="groups of 4"):
        group_reward_std(torch.tensor([1.0, 0.0]), 4)
