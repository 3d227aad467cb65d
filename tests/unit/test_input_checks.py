"""What init checks on the driver before any actor: weight files from their safetensors headers, a
--load checkpoint against the model, user functions by signature, and a reward without labels."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.data.input_checks import (check_checkpoint_fits, check_user_functions, first_row_keys, label_warnings,
                                       model_shapes, safetensors_shapes)
from miles.rollout.rewards import import_reward_fn, math_reward
from miles.user_code import display_name
from tests.tiny_model import make_tiny_model
from tests.unit.test_tracking_flags import base


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_shapes_come_from_the_header(tmp_path):
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(5)}, str(tmp_path / "x.safetensors"))
    assert safetensors_shapes(tmp_path / "x.safetensors") == {"a": (2, 3), "b": (5,)}


def test_a_truncated_model_file_is_bad_input_naming_it(model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model, copy)
    weights = copy / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ConfigError, match=rf"--hf-checkpoint {copy}: .*model.safetensors: {size - 100} bytes, but its "
                                          rf"header describes {size}; the file is truncated"):
        model_shapes(copy, "--hf-checkpoint")
    with open(weights, "r+b") as f:
        f.truncate(4)
    with pytest.raises(ConfigError, match="too short for a safetensors file"):
        model_shapes(copy, "--hf-checkpoint")


def test_a_missing_shard_or_no_weights_at_all_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ConfigError, match="lists 1 missing shard"):
        model_shapes(tmp_path, "--hf-checkpoint")
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ConfigError, match="no model weights"):
        model_shapes(tmp_path, "--hf-checkpoint")


def test_a_checkpoint_of_another_model_is_found_before_any_actor(model, tmp_path):
    from miles.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    with store.saving(4) as tmp:
        (tmp / "trainer").mkdir()
        save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(tmp / "trainer" / "model.safetensors"))
    cfg, _ = parse_flags(base(tmp_path) + ["--hf-checkpoint", model, "--load", str(tmp_path / "ckpt")])
    with pytest.raises(ConfigError, match=r"the checkpoint iter_0000004 is of another model than --hf-checkpoint .*"
                                          r"model.embed_tokens.weight \[64, 16\] vs \[32, 32\]"):
        check_checkpoint_fits(cfg, model_shapes(model, "--hf-checkpoint"))


def test_a_corrupt_checkpoint_is_not_taken_for_another_model_when_loads_verify(model, tmp_path):
    # iter 5's header has a flipped byte (its sha256 fails): --load would skip it and resume from iter 4,
    # so iter 4 is what is checked (and fits); with --no-verify-load the load would read iter 5: refused
    from miles.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    shapes = model_shapes(model, "--hf-checkpoint")
    for rollout_id in (4, 5):
        with store.saving(rollout_id) as tmp:
            (tmp / "trainer").mkdir()
            shutil.copy(f"{model}/model.safetensors", tmp / "trainer" / "model.safetensors")
    weights = tmp_path / "ckpt" / "iter_0000005" / "trainer" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[20] ^= 0x01          # inside the JSON header (it starts at byte 8)
    weights.write_bytes(bytes(data))
    cfg, _ = parse_flags(base(tmp_path) + ["--hf-checkpoint", model, "--load", str(tmp_path / "ckpt")])
    check_checkpoint_fits(cfg, shapes)
    cfg, _ = parse_flags(base(tmp_path) + ["--hf-checkpoint", model, "--load", str(tmp_path / "ckpt"),
                                           "--no-verify-load"])
    with pytest.raises(ConfigError, match="iter_0000005/trainer/model.safetensors: corrupt safetensors header"):
        check_checkpoint_fits(cfg, shapes)


def write(path, text):
    path.write_text(text)
    return str(path)


def test_a_reward_with_the_wrong_signature_is_named_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "reward.py", "def reward(prompt, response):\n    return 1.0\n")
    with pytest.raises(ConfigError) as info:
        import_reward_fn("reward.py:reward")
    text = str(info.value)
    assert text.startswith("--custom-rm-path reward.py:reward: reward.py:reward(prompt, response) cannot be called as "
                           "a reward fn(prompt, response_text, label)")
    assert "miles_user_" not in text


def test_a_reward_module_that_raises_at_import_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "broken.py", "raise RuntimeError('no API key')\n")
    with pytest.raises(ConfigError, match=r"--custom-rm-path 'broken.py:f': importing 'broken.py' raised "
                                          r"RuntimeError: no API key"):
        import_reward_fn("broken.py:f")


def test_functions_from_files_keep_the_name_the_user_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "r.py", "def score(prompt, response, label):\n    return 0.0\n")
    assert display_name(import_reward_fn("r.py:score")) == "r.py:score"
    assert display_name(math_reward) == "miles.rollout.rewards:math_reward"


def test_custom_loss_and_tis_functions_are_checked_on_the_driver(tmp_path):
    loss = write(tmp_path / "l.py", "def loss(logprobs, batch):\n    return logprobs.sum()\n")
    cfg, _ = parse_flags(base(tmp_path) + ["--loss-type", "custom_loss", "--custom-loss-function-path", f"{loss}:loss"])
    with pytest.raises(ConfigError, match=r"--custom-loss-function-path .*cannot be called as fn\(logprobs, batch, reduce\)"):
        check_user_functions(cfg)


def test_a_builtin_reward_without_a_label_key_stops_the_run_naming_the_key(tmp_path):
    cfg, _ = parse_flags(base(tmp_path))
    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"--rm-type math compares each response with a label, but --label-key is "
                                          r"not set; the rows also have \['answer'\]: set --label-key answer"):
        label_warnings(cfg, math_reward, first_row_keys(cfg.data.prompt_data))


def test_rewards_that_read_no_label_need_no_label_key_and_boxed_ones_do(tmp_path):
    from miles.rollout.rewards import builtin_reward

    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "answer": "2"}\n')
    cfg, _ = parse_flags(base(tmp_path) + ["--rm-type", "deterministic_random"])
    assert label_warnings(cfg, builtin_reward("deterministic_random"), first_row_keys(cfg.data.prompt_data)) == []
    cfg, _ = parse_flags(base(tmp_path) + ["--rm-type", "boxed_math"])
    with pytest.raises(ConfigError, match="--rm-type boxed_math compares each response with a label"):
        label_warnings(cfg, builtin_reward("boxed_math"), first_row_keys(cfg.data.prompt_data))


def test_a_custom_reward_that_takes_a_label_without_a_label_key_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = parse_flags(base(tmp_path))
    (tmp_path / "p.jsonl").write_text('{"input": "1+1=", "label": "2", "id": 7}\n')
    write(tmp_path / "r.py", "def score(prompt, response, label):\n    return float(response == label)\n"
                             "def blind(prompt, response, _label):\n    return 1.0\n")
    warnings = label_warnings(cfg, import_reward_fn("r.py:score"), first_row_keys(cfg.data.prompt_data))
    assert warnings[0] == ("--custom-rm-path r.py:score takes a label ('label') but --label-key is not set: it gets "
                           "None for every prompt; set --label-key label")
    assert "the rows have keys ['id', 'label'] that no flag reads" in warnings[1]
    # a reward that says it ignores the label (a leading underscore) only hears about the unread keys
    assert len(label_warnings(cfg, import_reward_fn("r.py:blind"), ["input", "label"])) == 1
    with_key, _ = parse_flags(base(tmp_path) + ["--label-key", "label"])
    assert label_warnings(with_key, import_reward_fn("r.py:score"), ["input", "label"]) == []


def test_eval_prompts_have_their_own_length_limit_and_context_cap(model, tmp_path):
    from miles.config import EvalDataset
    from miles.data.input_checks import _eval_prompts
    from miles.weights.hf import load_tokenizer

    tok = load_tokenizer(model)
    (tmp_path / "e.jsonl").write_text("".join(f'{{"input": "{"1" * n}+1="}}\n' for n in (2, 8, 14)))   # 5, 11, 17 tokens
    d = EvalDataset(name="e", path=str(tmp_path / "e.jsonl"))
    argv = base(tmp_path) + ["--hf-checkpoint", model, "--max-prompt-len", "6"]
    assert [len(p.prompt_ids) for p in _eval_prompts(parse_flags(argv)[0], d, tok, None)] == [5]
    cfg, _ = parse_flags(argv + ["--eval-max-prompt-len", "12"])                   # the evals' own limit
    assert [len(p.prompt_ids) for p in _eval_prompts(cfg, d, tok, None)] == [5, 11]
    with pytest.raises(ConfigError, match=r"eval dataset e .*: 1 of 2 prompts \(rows 2\) have --eval-max-context-len 11 "
                                          r"tokens or more.*drop them with --eval-max-prompt-len 10"):
        _eval_prompts(parse_flags(argv + ["--eval-max-prompt-len", "12", "--eval-max-context-len", "11"])[0], d, tok,
                      None)


def test_ckpt_step_picks_one_checkpoint_and_exit_on_missing_checkpoint_refuses_an_empty_load(tmp_path):
    from miles.checkpoint.resume import UnusableLoadFolder, check_load_folder
    from miles.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ck")
    for rid in (1, 3):
        part = store.begin(rid)
        (part / "trainer").mkdir()
        (part / "trainer" / "x").write_text("x")
        store.commit(part, rid)
    newest = check_load_folder(str(tmp_path / "ck"), allow_fresh_start=False)
    assert [c.rollout_id for c in newest.candidates] == [3, 1]
    picked = check_load_folder(str(tmp_path / "ck"), allow_fresh_start=False, step=1)
    assert [c.rollout_id for c in picked.candidates] == [1]
    with pytest.raises(UnusableLoadFolder, match=r"--ckpt-step 2: --load .* has no checkpoint of rollout 2 \(its "
                                                 r"checkpoints' rollouts: 1, 3\)"):
        check_load_folder(str(tmp_path / "ck"), allow_fresh_start=True, step=2)    # no fresh start for a step asked
    (tmp_path / "empty").mkdir()
    assert check_load_folder(str(tmp_path / "empty"), allow_fresh_start=False).starts_fresh
    with pytest.raises(UnusableLoadFolder, match="--exit-on-missing-checkpoint stops the run"):
        check_load_folder(str(tmp_path / "empty"), allow_fresh_start=False, exit_on_missing=True)
    with pytest.raises(ConfigError, match="--ckpt-step has no effect without --load DIR"):
        parse_flags(base(tmp_path) + ["--ckpt-step", "1"])


def test_every_user_function_of_the_table_is_checked_by_the_one_driver_loop_naming_its_flag(tmp_path):
    """miles.config.user_functions is the one table: each row's field is its flag's, and the driver's one loop
    (check_user_functions) loads each set function with the row's loader, which refuses a function of the
    wrong shape once, naming the flag and the table's signature."""
    from dataclasses import replace

    from miles.config.flags import BY_DEST
    from miles.config.schema import USER_FUNCTION_FLAGS
    from miles.config.user_functions import USER_FUNCTIONS

    assert list(USER_FUNCTION_FLAGS) == [f.flag for f in USER_FUNCTIONS]
    bad = write(tmp_path / "bad.py", "def f():\n    return None\n\nasync def g():\n    return None\n")
    cfg, _ = parse_flags(base(tmp_path))
    for fn in USER_FUNCTIONS:
        assert fn.flag[2:].replace("-", "_") in BY_DEST and hasattr(getattr(cfg, fn.section), fn.field)
        if fn.loader is None:
            continue
        path = f"{bad}:{'g' if fn.signature.startswith('async') else 'f'}"
        given = replace(cfg, **{fn.section: replace(getattr(cfg, fn.section), **{fn.field: path})})
        with pytest.raises(ConfigError) as err:
            check_user_functions(given)
        (problem,) = err.value.problems
        assert problem.startswith(f"{fn.flag} {path}"), problem
        if fn.flag != "--custom-rm-path":         # a reward's shape depends on @group_reward (miles.rollout.rewards)
            assert fn.signature in problem, problem
