"""Errors that say what is wrong and the fix, not a symptom (issue 59, item 6): a broken config.json,
a bad --lr without the rules derived from it, and a --custom-rm-path whose fix is the path."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError
from miles.config.flags import parse_flags
from miles.user_code import DRIVER_CWD_ENV, import_user_function


@pytest.fixture
def model_copy(tiny_task, tmp_path):
    """A copy of the tiny model's small files (the weights linked), to break one of them."""
    import shutil
    from pathlib import Path
    src, dst = Path(tiny_task["model"]), tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def flags(tiny_task, model, tmp_path, *extra):
    return ["--hf-checkpoint", str(model), "--prompt-data", tiny_task["train"], "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", "--run-dir", str(tmp_path / "run"), *extra]


def test_a_broken_config_json_is_named_with_its_line_and_column_before_anything_loads(tiny_task, model_copy,
                                                                                       tmp_path):
    config = model_copy / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"vocab_size"', '"vocab_size" 1,', 1))       # a stray token
    with pytest.raises(ConfigError) as refused:
        parse_flags(flags(tiny_task, model_copy, tmp_path))
    line = next(i + 1 for i, row in enumerate(config.read_text().splitlines()) if '"vocab_size" 1,' in row)
    msg = str(refused.value)
    assert (f"--hf-checkpoint {model_copy}: the config.json at {config} is not valid JSON (line {line}, column "
            in msg) and "Expecting ':' delimiter); restore it from the model's source" in msg
    assert "tokenizer" not in msg
    config.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match=r"the config.json at .* holds a JSON list, not an object"):
        parse_flags(flags(tiny_task, model_copy, tmp_path))
    config.write_text(text)
    (model_copy / "tokenizer_config.json").write_text('{"model_max_length": 64,,}')
    with pytest.raises(ConfigError, match=r"the tokenizer_config.json at .* is not valid JSON \(line 1, column 25"):
        parse_flags(flags(tiny_task, model_copy, tmp_path))


def test_a_bad_lr_is_reported_alone_not_with_the_rules_measured_against_it(tiny_task, tmp_path):
    with pytest.raises(ConfigError) as refused:
        parse_flags(flags(tiny_task, tiny_task["model"], tmp_path, "--lr", "-1"))
    assert refused.value.problems == ["--lr -1.0: must be > 0"]
    with pytest.raises(ConfigError) as both:            # a min-lr wrong by itself is still said
        parse_flags(flags(tiny_task, tiny_task["model"], tmp_path, "--lr", "-1", "--min-lr", "-0.5"))
    assert len(both.value.problems) == 2 and "--min-lr -0.5" in both.value.problems[1]
    with pytest.raises(ConfigError) as above:           # and one above a good --lr
        parse_flags(flags(tiny_task, tiny_task["model"], tmp_path, "--lr", "1e-4", "--min-lr", "1e-3"))
    assert above.value.problems == ["--lr-warmup-iters 0 / --min-lr 0.001: need warmup >= 0 and 0 <= min-lr <= "
                                    "--lr 0.0001"]


@pytest.mark.parametrize("value, says", [
    ("rewards/rm.py:score", "no such file: {cwd}/rewards/rm.py (a relative path is read from the driver's working "
                            "directory, {cwd}); check the path"),
    ("rewards/rm:score", "'rewards/rm' looks like a path but has no .py: give the file, rewards/rm.py:FUNCTION, "
                         "relative to the driver's working directory {cwd}"),
    ("local_rm:score", "cannot import module 'local_rm' (ModuleNotFoundError: No module named 'local_rm'), but "
                       "local_rm.py is in the driver's working directory: give the file, local_rm.py:FUNCTION"),
    ("broken_rm.py:score", "file 'broken_rm.py' was found, but importing it failed: No module named "
                           "'not_installed_x'; install 'not_installed_x' where the run's processes can import it"),
    ("broken_mod:score", "module 'broken_mod' was found, but importing it failed: No module named 'not_installed_x'; "
                         "install 'not_installed_x' where the run's processes can import it"),
])
def test_a_custom_reward_that_does_not_import_says_whether_the_fix_is_the_path(value, says, tmp_path, monkeypatch):
    cwd = tmp_path / "elsewhere"             # the driver's directory; the test's own is not on sys.path
    cwd.mkdir()
    (tmp_path / "local_rm.py").write_text("def score(p, r, l):\n    return 1.0\n")
    (cwd / "local_rm.py").write_text("def score(p, r, l):\n    return 1.0\n")
    (cwd / "broken_rm.py").write_text("import not_installed_x\n")
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "broken_mod.py").write_text("import not_installed_x\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setenv(DRIVER_CWD_ENV, str(cwd))
    with pytest.raises(ConfigError) as refused:
        import_user_function(value, "--custom-rm-path")
    msg = str(refused.value)
    assert msg == f"--custom-rm-path {value!r}: " + says.format(cwd=cwd)
    assert "PYTHONPATH" not in msg
