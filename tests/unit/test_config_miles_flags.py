"""The miles flags in the config: how they parse, what they need, --eval-config's YAML."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, EvalDataset
from miles.config.eval_config import load_eval_config
from miles.config.flags import parse_flags
from tests.unit.test_tracking_flags import base


def problems_of(argv):
    with pytest.raises(ConfigError) as info:
        parse_flags(argv)
    return info.value.problems


def test_the_flags_land_in_their_sections(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    cfg, _ = parse_flags(base(tmp_path) + [
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
        "--rollout-stop", "</s>", "##", "--rollout-stop-token-ids", "7", "9", "--rollout-max-context-len", "64",
        "--apply-chat-template", "--chat-template-path", str(tmp_path / "t.jinja"),
        "--apply-chat-template-kwargs", '{"prefix": "a "}', "--save", str(tmp_path / "ck"), "--save-hf",
        str(tmp_path / "hf/{rollout_id}"), "--no-save-optim", "--keep-last-checkpoints", "2", "--start-rollout-id", "0",
        "--use-kl-loss", "--kl-loss-type", "low_var_kl", "--use-unbiased-kl", "--log-passrate", "--ci-test"])
    assert (cfg.rollout.stop, cfg.rollout.stop_token_ids, cfg.rollout.max_context_len) == (("</s>", "##"), (7, 9), 64)
    assert cfg.data.apply_chat_template_kwargs == {"prefix": "a "} and cfg.data.chat_template_path.endswith("t.jinja")
    assert cfg.train.global_batch(8) == 4 and cfg.train.num_steps_per_rollout == 2
    c = cfg.checkpoint
    assert (c.save_hf_path.endswith("{rollout_id}"), c.save_optimizer, c.keep_last) == (True, False, 2)
    assert cfg.algorithm.use_unbiased_kl and cfg.algorithm.kl_loss_type == "low_var_kl"
    assert cfg.eval.log_passrate and cfg.start_rollout_id == 0 and cfg.ci_test and cfg.check_weights


@pytest.mark.parametrize("extra, expected", [
    (["--num-steps-per-rollout", "3", "--n-samples-per-prompt", "4"], "--num-steps-per-rollout 3 must be a positive divisor of the 4"),
    (["--num-steps-per-rollout", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "4"], "both set the global batch"),
    (["--chat-template-path", "t.jinja"], "--chat-template-path has no effect without --apply-chat-template"),
    (["--apply-chat-template-kwargs", "{bad"], "not valid JSON"),
    (["--apply-chat-template-kwargs", "[1]", "--apply-chat-template"], "must be a JSON object"),
    (["--use-unbiased-kl"], "--use-unbiased-kl has no effect without --use-kl-loss"),
    (["--loss-type", "custom_loss"], "--loss-type custom_loss and --custom-loss-function-path go together"),
    (["--custom-loss-function-path", "m:f"], "--loss-type custom_loss and --custom-loss-function-path go together"),
    (["--custom-tis-function-path", "m:f"], "--custom-tis-function-path has no effect without --use-tis"),
    (["--keep-last-checkpoints", "2"], "--keep-last-checkpoints has no effect without --save DIR"),
    (["--debug-train-only"], "--debug-train-only has no effect without --load-debug-rollout-data"),
    (["--start-rollout-id", "5"], "--start-rollout-id 5: must be in [0, --num-rollout 1)"),
    (["--rollout-stop", ""], "stop strings must be non-empty"),
    (["--rollout-max-context-len", "0"], "--rollout-max-context-len 0: must be a positive integer"),
    (["--load", "nowhere"], "--load nowhere: no such directory (to start fresh and resume later"),
    (["--log-probs-max-tokens-per-gpu", "4096"], "--log-probs-max-tokens-per-gpu 4096: a positive token budget of "
                                                 "micro-batches by tokens; it needs --use-dynamic-batch-size"),
    (["--eval-max-context-len", "0"], "--eval-max-context-len 0: must be a positive integer"),
])
def test_what_each_flag_needs_is_a_problem_naming_the_fix(tmp_path, extra, expected):
    assert any(expected in p for p in problems_of(base(tmp_path) + extra)), expected


def test_load_and_save_of_one_folder_not_there_yet_is_the_auto_resume_script(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cfg, _ = parse_flags(base(tmp_path) + ["--load", ckpt, "--save", ckpt])
    assert cfg.checkpoint.load == ckpt


def test_save_hf_alone_is_a_save_target(tmp_path):
    cfg, _ = parse_flags(base(tmp_path) + ["--save-hf", str(tmp_path / "hf"), "--save-interval", "1"])
    assert cfg.checkpoint.save is None and cfg.checkpoint.save_hf_path == str(tmp_path / "hf")


def write(path, text):
    path.write_text(text)
    return str(path)


def test_eval_config_reads_miles_yaml_with_defaults_and_per_dataset_values(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "data" / name).write_text('{"input": "1+1="}\n')
    path = write(tmp_path / "eval.yaml", """
eval:
  defaults: {n_samples_per_eval_prompt: 4, temperature: 0.6, stop: ["##"]}
  datasets:
    - {name: a, path: data/a.jsonl, rm_type: exact_match, label_key: answer}
    - {name: b, path: data/b.jsonl, n_samples_per_eval_prompt: 2, temperature: 0, stop_token_ids: [5, 6]}
""")
    problems = []
    a, b = load_eval_config(path, problems)
    assert problems == []
    assert a == EvalDataset(name="a", path=str(tmp_path / "data" / "a.jsonl"), n_samples_per_prompt=4,
                            temperature=0.6, stop=("##",), rm_type="exact_match", label_key="answer")
    assert (b.n_samples_per_prompt, b.temperature, b.stop, b.stop_token_ids) == (2, 0.0, ("##",), (5, 6))
    cfg, _ = parse_flags(base(tmp_path) + ["--eval-config", path, "--eval-interval", "2"])
    assert [d.name for d in cfg.eval.sets()] == ["a", "b"]


def test_eval_config_accepts_a_mapping_of_datasets_at_the_top_level(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"input": "x"}\n')
    problems = []
    (d,) = load_eval_config(write(tmp_path / "e.yaml", "datasets:\n  aime: {path: a.jsonl}\n"), problems)
    assert problems == [] and d.name == "aime" and d.n_samples_per_prompt is None


@pytest.mark.parametrize("text, expected", [
    ("eval: {datasets: [{name: a, path: a.jsonl, tool_key: tools}]}", "tool_key (tools) is not supported yet"),
    ("eval: {datasets: [{name: a, path: a.jsonl, temprature: 1}]}", "unknown key 'temprature'"),
    ("eval: {datasets: [{name: a}]}", "dataset 'a': no path"),
    ("eval: {datasets: [{name: a, path: a.jsonl, n_samples_per_eval_prompt: two}]}", "must be a int"),
    ("eval: {datasets: [{path: a.jsonl}]}", "a list of entries with a `name`"),
    ("eval: {defaults: {temperature: 1}}", "no datasets under eval.datasets"),
    ("[1, 2]", "expected a mapping with an `eval` section"),
])
def test_eval_config_problems_name_the_file_and_the_dataset(tmp_path, text, expected):
    problems = []
    load_eval_config(write(tmp_path / "e.yaml", text), problems)
    assert any(expected in p and "e.yaml" in p for p in problems), problems


def test_eval_config_checks_against_the_run(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"input": "x"}\n')
    path = write(tmp_path / "e.yaml", "eval: {datasets: [{name: a, path: a.jsonl, rm_type: ifbench}, "
                                      "{name: b, path: nowhere.jsonl}]}")
    problems = problems_of(base(tmp_path) + ["--eval-config", path, "--eval-prompt-data", "c", str(tmp_path / "a.jsonl")])
    assert any("--eval-prompt-data and --eval-config both name eval datasets" in p for p in problems)
    assert any("rm_type 'ifbench' is not a reward type here" in p for p in problems)
    assert any("dataset 'b': path nowhere.jsonl: no such file" in p for p in problems)
