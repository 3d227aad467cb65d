"""A negative number after a flag is the flag's value (argparse alone reads `-1e-4` as a flag and says
"expected one argument"); validation then says what is wrong with it."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags

BASE = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2", "--num-rollout", "1"]


@pytest.mark.parametrize("value", ["-1e-4", "-1E-4", "-0.0001", "-.5", "-3"])
def test_a_negative_lr_is_a_value_that_validation_refuses(value):
    with pytest.raises(ConfigError) as refused:
        parse_flags([*BASE, "--lr", value])
    assert f"--lr {float(value)}: must be > 0" in str(refused.value)


def test_a_flag_after_a_flag_is_still_a_missing_value():
    with pytest.raises(SystemExit):
        parse_flags([*BASE, "--lr", "--seed", "1"])
