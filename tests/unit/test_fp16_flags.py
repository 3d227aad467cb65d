"""--fp16 and the loss-scale flags on the command line: what they set, what they conflict with, where
they are refused."""

from __future__ import annotations

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.config.miles_flags import fate
from miles.training.megatron.checks import unsupported_features
from tests.unit.test_tracking_flags import base


def problems_of(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_flags(argv)
    return info.value.problems


@pytest.mark.parametrize("flags", [["--fp16"], ["--dtype", "float16"], ["--dtype", "fp16"],
                                   ["--fp16", "--dtype", "float16"]])
def test_fp16_is_dtype_float16(tmp_path, flags):
    cfg, _ = parse_flags(base(tmp_path) + flags)
    assert cfg.model.dtype == "float16" and cfg.model.float16
    assert fate("fp16") is None         # no longer refused


def test_fp16_from_a_config_file(tmp_path):
    (tmp_path / "run.yaml").write_text("fp16: true\nloss-scale-window: 50\n")
    cfg, _ = parse_flags(base(tmp_path) + ["--config", str(tmp_path / "run.yaml")])
    assert (cfg.model.dtype, cfg.train.loss_scale_window) == ("float16", 50)


def test_the_short_dtype_names_are_the_long_ones(tmp_path):
    assert parse_flags(base(tmp_path) + ["--dtype", "bf16"])[0].model.dtype == "bfloat16"
    assert parse_flags(base(tmp_path) + ["--dtype", "fp32"])[0].model.dtype == "float32"
    assert not parse_flags(base(tmp_path))[0].model.float16


@pytest.mark.parametrize("other,named", [(["--dtype", "bfloat16"], "--dtype bfloat16"),
                                         (["--dtype", "float32"], "--dtype float32"),
                                         (["--bf16"], "--bf16")])
def test_fp16_with_another_precision_names_both(tmp_path, other, named):
    problems = problems_of(base(tmp_path) + ["--fp16", *other])
    assert len(problems) == 1 and "--fp16" in problems[0] and named in problems[0], problems


def test_megatrons_loss_scale_flags_and_defaults(tmp_path):
    cfg, _ = parse_flags(base(tmp_path) + ["--fp16"])
    t = cfg.train
    assert (t.loss_scale, t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) == \
        (None, 2.0 ** 16, 1.0, 1000, 2)
    cfg, _ = parse_flags(base(tmp_path) + ["--fp16", "--loss-scale", "1024", "--initial-loss-scale", "65536",
                                           "--min-loss-scale", "2", "--loss-scale-window", "200", "--hysteresis", "4"])
    t = cfg.train
    assert (t.loss_scale, t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) == \
        (1024.0, 65536.0, 2.0, 200, 4)


def test_bad_loss_scale_values_are_named(tmp_path):
    problems = problems_of(base(tmp_path) + ["--fp16", "--loss-scale", "-1", "--min-loss-scale", "8",
                                             "--initial-loss-scale", "4", "--loss-scale-window", "0",
                                             "--hysteresis", "0"])
    assert sorted(p.split(":")[0] for p in problems) == [
        "--hysteresis 0", "--loss-scale -1.0", "--loss-scale-window 0",
        "--min-loss-scale 8.0 / --initial-loss-scale 4.0"]


def test_a_dtype_a_config_in_code_names_is_checked(tmp_path):
    from dataclasses import replace

    from miles.config.validate import validate

    cfg, _ = parse_flags(base(tmp_path))
    with pytest.raises(ConfigError, match="--dtype half: no such dtype; use auto, float32"):
        validate(replace(cfg, model=replace(cfg.model, dtype="half")))


def test_the_megatron_backend_refuses_fp16_naming_the_fix(tmp_path):
    cfg, _ = parse_flags(base(tmp_path) + ["--fp16"])
    (line,) = unsupported_features(cfg)
    assert line.startswith("--fp16: not supported by --train-backend megatron") and "--dtype bfloat16" in line
    assert unsupported_features(parse_flags(base(tmp_path) + ["--dtype", "bfloat16"])[0]) == []


def test_fp16_gives_sglang_float16(tmp_path):
    from miles.rollout.engines.sglang.engine import server_dtype

    cfg, _ = parse_flags(base(tmp_path) + ["--fp16"])
    assert server_dtype(cfg.model.dtype, "cuda") == "float16"
    assert server_dtype("auto", "cuda") == "bfloat16" and server_dtype("fp16", "cuda") == "float16"
