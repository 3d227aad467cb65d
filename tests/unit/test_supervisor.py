import pytest

from miles.runtime.supervisor import RestartBudget, RestartBudgetExceeded


def test_budget_allows_n_restarts_per_window_then_refuses():
    now = [0.0]
    b = RestartBudget(2, 10.0, clock=lambda: now[0])
    assert b.spend("engine-0") == 1
    now[0] = 5.0
    assert b.spend("engine-0") == 2
    now[0] = 9.0
    with pytest.raises(RestartBudgetExceeded, match="2 restarts in the last 10s"):
        b.spend("engine-0")
    now[0] = 10.5          # the first restart (t=0) has left the window
    assert b.spend("engine-0") == 2


def test_zero_budget_refuses_the_first_restart():
    with pytest.raises(RestartBudgetExceeded):
        RestartBudget(0, 1.0).spend("x")
