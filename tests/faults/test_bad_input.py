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


# extended (CI budget): a reward that raises is named with its prompt in tests/unit/test_rewards.py; a reward's
# failure in a run (exit 2, the error in rollout, nothing left) is test_a_reward_returning_nan_names_the_cause_once_first_exit_2's
@pytest.mark.extended
def test_a_reward_that_raises_on_one_sample_fails_the_run_naming_it(ray_cluster, tiny_task, tmp_path, capsys):
    rm = write(tmp_path / "picky.py", "def picky(prompt, response, label):\n"
                                      "    if prompt.index == 3:\n"
                                      "        raise ValueError('cannot score this one')\n"
                                      "    return 0.0\n")
    code = train_main(base_flags(tiny_task, tmp_path / "run", custom_rm_path=f"{rm}:picky", rollout_batch_size=8,
                                 rollout_shuffle=False))
    err = capsys.readouterr().err
    assert code == 2, err                                   # the user's reward failed: their input
    assert f"{rm}:picky failed on prompt 3" in err and "cannot score this one" in err
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


# -- a new user's first runs -----------------------------------------------------------------------



def test_a_reward_with_the_wrong_signature_exits_2_before_any_actor_named_as_written(
        ray_cluster, tiny_task, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "reward.py", "def reward(prompt, response):\n    return 1.0\n")
    code = train_main(base_flags(tiny_task, tmp_path / "run", custom_rm_path="reward.py:reward"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--custom-rm-path reward.py:reward: reward.py:reward(prompt, response) cannot be called as a reward" in err
    assert "miles_user_" not in err and "miles_custom_rm" not in err and "Traceback" not in err
    trace = read_trace(tmp_path / "run")
    assert trace.of("error")[0].state == "init" and not trace.of("components_ready")   # no actor ever started
    assert miles_actors() == []


@pytest.mark.parametrize("case", ["import_raises", "truncated_model", "other_model_checkpoint", "no_label_key"])
def test_input_an_actor_would_trip_on_is_found_on_the_driver_exit_2(ray_cluster, tiny_task, tmp_path, capsys,
                                                                   monkeypatch, case):
    import shutil

    monkeypatch.chdir(tmp_path)
    task, extra = dict(tiny_task), {}
    if case == "import_raises":
        write(tmp_path / "rm.py", "raise RuntimeError('no API key in the environment')\n")
        extra["custom_rm_path"] = "rm.py:score"
        expect = "--custom-rm-path 'rm.py:score': importing 'rm.py' raised RuntimeError: no API key in the environment"
    elif case == "truncated_model":
        task["model"] = str(tmp_path / "model")
        shutil.copytree(tiny_task["model"], task["model"])
        weights = tmp_path / "model" / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
        expect = "model.safetensors: "
    elif case == "other_model_checkpoint":
        from safetensors.torch import save_file
        import torch
        from miles.checkpoint.store import CheckpointStore

        with CheckpointStore(tmp_path / "ckpt").saving(0) as tmp:
            (tmp / "trainer").mkdir()
            save_file({"model.embed_tokens.weight": torch.zeros(50_000, 8)}, str(tmp / "trainer" / "model.safetensors"))
        extra["load"] = str(tmp_path / "ckpt")
        expect = "the checkpoint iter_0000000 is of another model than --hf-checkpoint"
    else:
        extra["label_key"] = None                       # --rm-type math (the default) reads labels
        expect = "--rm-type math compares each response with a label, but --label-key is not set"
    code = train_main(base_flags(task, tmp_path / "run", **extra))
    err = capsys.readouterr().err
    assert code == 2, err
    assert expect in err, err
    if case == "truncated_model":
        assert "truncated" in err
    if case == "no_label_key":
        assert "set --label-key label" in err
    assert not read_trace(tmp_path / "run").of("components_ready") and miles_actors() == []


def test_a_reward_returning_nan_names_the_cause_once_first_exit_2(ray_cluster, tiny_task, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "nan.py", "def nan_reward(prompt, response, label):\n    return float('nan')\n")
    code = train_main(base_flags(tiny_task, tmp_path / "run", custom_rm_path="nan.py:nan_reward"))
    err = capsys.readouterr().err
    assert code == 2, err
    causes = [line for line in err.splitlines() if "RewardError" in line or "nan_reward" in line]
    assert len(causes) == 1 and causes[0].startswith("miles: error in rollout: RewardError: reward function "
                                                     "nan.py:nan_reward failed on prompt"), err   # once
    before = err.splitlines()[:err.splitlines().index(causes[0])]                # first: after the start-up lines
    assert [line.split(":")[1].split()[0] for line in before] == ["run", "init", "engine"], err
    assert "returned nan (float); expected a finite float" in causes[0]
    assert "\x1b[" not in err and "Traceback" not in err and "RayTaskError" not in err
    assert err.rstrip().splitlines()[-2:] == ["miles train: bad input: the error above",
                                              f"  full traceback: {tmp_path / 'run' / 'logs' / 'driver-0.jsonl'} "
                                              "(event run_failed)"]
    log = (tmp_path / "run" / "logs" / "driver-0.jsonl").read_text()
    assert '"event": "run_failed"' in log and "_as_score" in log           # the whole traceback, in the file
    assert miles_actors() == []


def test_forgetting_label_key_is_said_at_start_up_and_when_rewards_never_vary(ray_cluster, tiny_task, tmp_path,
                                                                              capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "exact.py", "def exact(prompt, response, label):\n    return float(response.strip() == label)\n")
    code = train_main(base_flags(tiny_task, tmp_path / "run", custom_rm_path="exact.py:exact", label_key=None,
                                 num_rollout=3))
    err = capsys.readouterr().err
    assert code == 0, err
    lines = err.splitlines()
    assert ("miles: warning: --custom-rm-path exact.py:exact takes a label ('label') but --label-key is not set: it "
            "gets None for every prompt; set --label-key label") in lines
    assert lines.index(next(l for l in lines if "takes a label" in l)) < lines.index(
        next(l for l in lines if l.startswith("miles: rollout 0")))                # at start-up, before training
    assert "WARNING: equal rewards in every group for 3 rollouts, nothing to learn" in lines[
        lines.index(next(l for l in lines if l.startswith("miles: rollout 2")))]
    warnings = read_trace(tmp_path / "run").of("warning")
    assert [w.get("code") for w in warnings] == ["label_key", "label_key", "zero_reward_variance"]
