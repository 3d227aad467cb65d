"""Bad input: each a clear error naming the input, exit 2 where it is input, and no actor left."""

from __future__ import annotations

import pytest

from miles.runtime import read_trace
from miles.cli.train import main as train_main
from tests.conftest import base_flags, miles_actors

pytestmark = pytest.mark.ray


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["missing_key", "empty", "missing_model", "reward_import", "missing_file"])
def test_bad_input_exits_2_naming_it(ray_cluster, tiny_task, tmp_path, capsys, case):
    task, extra = dict(tiny_task), {}
    if case == "missing_key":
        task["train"] = write(tmp_path / "rows.jsonl", '{"input": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n')
        expect = ["rows.jsonl", "line 2", "'input'"]
    elif case == "empty":
        task["train"] = write(tmp_path / "empty.jsonl", "")
        expect = ["empty.jsonl", "empty"]
    elif case == "missing_model":
        task["model"] = str(tmp_path / "no_model")
        expect = ["--hf-checkpoint", "no_model", "config.json"]
    elif case == "reward_import":
        extra["custom_rm_path"] = "no_such_module_xyz:reward"
        expect = ["--custom-rm-path", "no_such_module_xyz"]
    else:
        task["train"] = str(tmp_path / "nowhere.jsonl")
        expect = ["--prompt-data", "nowhere.jsonl", "no such file"]
    code = train_main(base_flags(task, tmp_path / "run", **extra))
    err = capsys.readouterr().err
    assert code == 2, err
    for part in expect:
        assert part in err, (part, err)
    assert miles_actors() == []


def test_unknown_flag_exits_2(tiny_task, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_main([*base_flags(tiny_task, tmp_path / "run"), "--rollout-batch-sise", "4"])
    assert info.value.code == 2 and "--rollout-batch-sise" in capsys.readouterr().err


def test_a_reward_that_raises_on_one_sample_fails_the_run_naming_it(ray_cluster, tiny_task, tmp_path, capsys):
    rm = write(tmp_path / "picky.py", "def picky(prompt, response, label):\n"
                                      "    if prompt.index == 3:\n"
                                      "        raise ValueError('cannot score this one')\n"
                                      "    return 0.0\n")
    code = train_main(base_flags(tiny_task, tmp_path / "run", custom_rm_path=f"{rm}:picky", rollout_batch_size=8,
                                 no_rollout_shuffle=True))
    err = capsys.readouterr().err
    assert code == 1, err
    assert "picky" in err and "cannot score this one" in err
    trace = read_trace(tmp_path / "run")
    assert trace.of("error")[0].state == "rollout" and trace.events[-1].state == "shutdown"
    assert miles_actors() == []


def test_past_the_restart_budget_the_run_drains_with_the_cause(ray_cluster, tiny_task, tmp_path, capsys):
    code = train_main([*base_flags(tiny_task, tmp_path / "run"), "--inject-fault", "rollout:kill_engine",
                       "--engine-max-restarts", "0"])
    assert code == 1
    trace = read_trace(tmp_path / "run")
    err = trace.of("error")[0]
    assert err.state == "rollout" and err.error["type"] == "RestartBudgetExceeded"
    assert "ActorDiedError" in err.error["traceback"]          # the engine's death is the chained cause
    assert trace.events[-1].state == "shutdown" and miles_actors() == []
