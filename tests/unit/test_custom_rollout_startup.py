"""Start-up refusals of custom and multi-turn rollouts and remote rewards: `miles train` exits 2 with
the flag and the path as written, before Ray or any actor starts."""

from __future__ import annotations

import socket

import pytest

from miles.cli.train import main as train_main
from miles.config.flags import parse_flags
from tests.conftest import base_flags


def run(tiny_task, tmp_path, capsys, **extra) -> str:
    code = train_main(base_flags(tiny_task, tmp_path / "run", **extra))
    err = capsys.readouterr().err
    assert code == 2, err
    return err


@pytest.mark.parametrize("source, flag_value, expect", [
    (None, "no_such_module_q:generate", ["--custom-generate-function-path", "no_such_module_q"]),
    ("def generate(ctx, sample, params):\n    return sample\n", "gen.py:generate",
     ["--custom-generate-function-path", "gen.py:generate", "not an async function"]),
    ("async def generate(ctx, sample):\n    return sample\n", "gen.py:generate",
     ["--custom-generate-function-path", "gen.py:generate", "cannot be called as async fn(ctx, sample, sampling_params)"]),
])
def test_bad_generate_function_exits_2_naming_the_path(tiny_task, tmp_path, capsys, monkeypatch, source, flag_value,
                                                        expect):
    if source:
        (tmp_path / "gen.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    err = run(tiny_task, tmp_path, capsys, custom_generate_function_path=flag_value)
    for part in expect:
        assert part in err, (part, err)


def test_bad_tool_executor_and_specs_exit_2(tiny_task, tmp_path, capsys, monkeypatch):
    (tmp_path / "tools.py").write_text("def execute(name, args):\n    return ''\n")
    monkeypatch.chdir(tmp_path)
    err = run(tiny_task, tmp_path, capsys, generate_execute_tool_function_path="tools.py:execute")
    assert "--generate-execute-tool-function-path tools.py:execute" in err and "async" in err
    (tmp_path / "specs.json").write_text('[{"type": "function"}]')
    (tmp_path / "tools.py").write_text("async def execute(name, args):\n    return ''\n")
    err = run(tiny_task, tmp_path, capsys, generate_execute_tool_function_path="tools.py:execute",
              generate_tool_specs_path=str(tmp_path / "specs.json"))
    assert "--generate-tool-specs-path" in err and "entry 0 has no function.name" in err


def test_reward_service_down_exits_2_naming_the_url(tiny_task, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/reward"
    err = run(tiny_task, tmp_path, capsys, rm_type="remote_rm", rm_url=url, rm_max_retries=0)
    assert f"--rm-url {url}: the reward service does not answer" in err


def test_an_opd_teacher_server_down_exits_2_naming_the_teacher_and_its_url(tiny_task, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/generate"
    err = run(tiny_task, tmp_path, capsys, use_opd=True, opd_type="sglang", opd_teacher_urls=f"math={url}",
              rm_max_retries=0)
    assert f"--opd-teacher-urls {url}: the server of teacher 'math' does not answer" in err and "start it" in err


@pytest.mark.parametrize("extra, expect", [
    ({"rm_type": "remote_rm"}, "--rm-type remote_rm needs --rm-url"),
    ({"group_rm": True}, "--group-rm makes the --custom-rm-path function"),
    ({"rollout_sample_timeout": 5}, "only custom generation reads them"),
    ({"rm_url": "localhost:9"}, "expected an http:// or https:// URL"),
    ({"rollout_health_check_timeout": 0}, "--rollout-health-check-interval"),
])
def test_flag_combinations_are_checked(tiny_task, tmp_path, extra, expect):
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match=expect):
        parse_flags(base_flags(tiny_task, tmp_path / "run", **extra))


def test_multi_turn_is_the_default_generate_function_with_a_tool_executor(tiny_task, tmp_path):
    cfg, _ = parse_flags(base_flags(tiny_task, tmp_path / "run", generate_execute_tool_function_path="m:execute",
                                    generate_max_turns=3))
    assert cfg.generate.generate_function_path == "miles.rollout.multi_turn:generate"
    assert cfg.generate.max_turns == 3 and cfg.generate.tool_call_parser == "qwen25"
