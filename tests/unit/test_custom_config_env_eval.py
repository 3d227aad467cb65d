"""--custom-config-path (extra arguments custom functions read as ctx.KEY; a flag's key sets the flag),
--train-env-vars (what it takes) and --eval-function-path (the executor's custom eval), without Ray."""

from __future__ import annotations

import asyncio
import base64
import inspect
import pickle

import pytest

from miles.config import AlgorithmConfig, ConfigError, EvalConfig, EvalDataset, RolloutConfig
from miles.config.flags import CONTEXT_NAMES, parse_flags
from miles.rollout.evals import EvalContext, EvalFunctionError, load_eval_function
from miles.rollout.generation import GenerateContext, RolloutContext
from miles.rollout.hooks import HookContext
from miles.training.terms import PolicyObjective
from miles.user_code import CustomArgs, custom_args, install_custom_args
from tests.unit.test_executor_algorithms import PROMPTS, Digits
from tests.unit.test_executor_eval_config import Recording
from tests.unit.test_tracking_flags import base


def problems_of(argv):
    with pytest.raises(ConfigError) as info:
        parse_flags(argv)
    return info.value.problems


# ---- --custom-config-path ------------------------------------------------------------------------------

def test_custom_keys_reach_the_config_and_flag_keys_set_their_flags_over_the_command_line(tmp_path):
    yaml_file = tmp_path / "custom.yaml"
    # miles sets every key on args after parsing: n_samples_per_prompt overrides the command line's 8
    yaml_file.write_text("n_samples_per_prompt: 4\nrollout_temperature: 0.5\ntis_level: token\n"
                         "bounds: {low: 0.5, high: 2.0}\n")
    cfg, _ = parse_flags(base(tmp_path) + ["--custom-config-path", str(yaml_file)])
    assert cfg.rollout.n_samples_per_prompt == 4 and cfg.rollout.temperature == 0.5
    assert dict(cfg.rollout.custom_args) == {"tis_level": "token", "bounds": {"low": 0.5, "high": 2.0}}
    assert cfg.rollout.custom_config_path == str(yaml_file)


def test_miles_base64_pseudo_file_is_read_like_a_file(tmp_path):
    # miles' launch scripts pass U.encode_pseudo_file(text): "base64:" + the text base64-encoded
    payload = "base64:" + base64.b64encode(b"use_rs: false\nrs_veto_threshold: 1.0e-4\n").decode()
    cfg, _ = parse_flags(base(tmp_path) + ["--custom-config-path", payload])
    assert dict(cfg.rollout.custom_args) == {"use_rs": False, "rs_veto_threshold": 1e-4}


def test_an_empty_file_is_no_extra_arguments(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    cfg, _ = parse_flags(base(tmp_path) + ["--custom-config-path", str(tmp_path / "empty.yaml")])
    assert dict(cfg.rollout.custom_args) == {}


@pytest.mark.parametrize("text, expected", [
    ("- a\n- b\n", "--custom-config-path {path}: expected a mapping of names to values (name: value lines), got a list"),
    ("a: [1\n", "--custom-config-path {path}: not valid YAML"),
    ("my-key: 1\n", "--custom-config-path {path}: key 'my-key' is not a Python name"),
])
def test_a_file_that_is_not_a_mapping_of_names_is_refused_naming_the_flag(tmp_path, text, expected):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    [problem] = problems_of(base(tmp_path) + ["--custom-config-path", str(f)])
    assert problem.startswith(expected.format(path=f))


def test_a_missing_file_and_bad_base64_are_refused_naming_the_flag(tmp_path):
    assert problems_of(base(tmp_path) + ["--custom-config-path", str(tmp_path / "nope.yaml")]) == [
        f"--custom-config-path {tmp_path / 'nope.yaml'}: no such file; pass a YAML file of name: value lines"]
    [problem] = problems_of(base(tmp_path) + ["--custom-config-path", "base64:not*base64"])
    assert problem.startswith("--custom-config-path base64:not*base...: not base64-encoded UTF-8 text")


def test_keys_a_run_cannot_take_are_refused_naming_the_key(tmp_path):
    f = tmp_path / "bad.yaml"
    # --custom-async-data-buffer-path is a miles flag this build refuses; `rollout_id` would hide behind ctx.rollout_id
    f.write_text("custom_async_data_buffer_path: a.b\nrollout_id: 3\nfine: 1\n")
    problems = problems_of(base(tmp_path) + ["--custom-config-path", str(f)])
    assert problems[0].startswith(f"--custom-config-path {f}: key 'custom_async_data_buffer_path' sets miles' "
                                  "--custom-async-data-buffer-path, which "
                                  "this build does not take:")
    assert problems[1] == (f"--custom-config-path {f}: key 'rollout_id' would be hidden by ctx.rollout_id, which the "
                           "contexts of custom functions have themselves; rename the key")


def test_a_flag_key_is_validated_like_the_flag(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("n_samples_per_prompt: 0\n")
    assert any("--n-samples-per-prompt" in p for p in problems_of(base(tmp_path) + ["--custom-config-path", str(f)]))


def test_a_config_files_custom_config_path_is_relative_to_it(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "custom.yaml").write_text("my_key: 7\n")
    (tmp_path / "recipe" / "run.yaml").write_text("custom-config-path: custom.yaml\n")
    cfg, _ = parse_flags(base(tmp_path) + ["--config", str(tmp_path / "recipe" / "run.yaml")])
    assert cfg.rollout.custom_args == {"my_key": 7}


def _contexts(rollout):
    async def gen(ids, params):
        raise AssertionError

    return [
        HookContext(rollout_id=0, rollout=rollout, algorithm=AlgorithmConfig()),
        GenerateContext(None, tokenizer=None, rollout=rollout, config=None, tools=None, evaluation=False),
        RolloutContext(rollout_id=0, prompts=[], n_samples_per_prompt=1, sampling_params=None, tokenizer=None,
                       rollout=rollout, generate=gen, generate_samples=gen, score=gen),
        EvalContext(rollout_id=0, datasets={}, tokenizer=None, rollout=rollout, eval=EvalConfig(), generate=gen,
                    generate_samples=gen, score=gen, new_sample=gen),
    ]


def test_every_context_answers_the_custom_keys_as_attributes_as_miles_args_does():
    rollout = RolloutConfig(batch_size=1, custom_args={"tis_level": "token", "clip": 2.0})
    for ctx in _contexts(rollout):
        assert (ctx.tis_level, ctx.clip) == ("token", 2.0), type(ctx).__name__
        assert ctx.rollout is rollout          # the context's own attributes come first
        with pytest.raises(AttributeError, match=r"'tis_levl': not a key of --custom-config-path \(its keys: clip, "
                                                 r"tis_level\)"):
            ctx.tis_levl


def test_context_names_list_every_contexts_own_attributes():
    # a custom key of one of these names is refused at start-up: the context's own attribute would hide it
    rollout = RolloutConfig(batch_size=1)
    own = set()
    for ctx in _contexts(rollout):
        own |= {n for n in vars(ctx) if not n.startswith("_")}
        own |= {n for n, _ in inspect.getmembers(type(ctx)) if not n.startswith("_")}
    assert own <= CONTEXT_NAMES, own - CONTEXT_NAMES


def test_custom_args_is_what_the_executor_and_the_trainers_objective_install():
    rollout = RolloutConfig(batch_size=1, max_response_len=4, custom_args={"scale": 3})
    PolicyObjective(AlgorithmConfig(), rollout)
    assert custom_args().scale == 3 and custom_args()["scale"] == 3
    install_custom_args({})
    with pytest.raises(AttributeError, match="not a key of --custom-config-path"):
        custom_args().scale
    args = CustomArgs({"a": 1})
    with pytest.raises(AttributeError, match="read-only"):
        args.a = 2
    assert pickle.loads(pickle.dumps(args)) == {"a": 1}


# ---- --train-env-vars ------------------------------------------------------------------------------------

def test_train_env_vars_is_an_object_of_strings(tmp_path):
    cfg, _ = parse_flags(base(tmp_path) + ["--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}'])
    assert cfg.cluster.train_env_vars == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert parse_flags(base(tmp_path))[0].cluster.train_env_vars is None
    cfg, _ = parse_flags(base(tmp_path) + ["--train-env-vars", '{"MILES_CPU_THREADS": "1"}'])   # the budget's override
    assert cfg.cluster.train_env_vars == {"MILES_CPU_THREADS": "1"}


@pytest.mark.parametrize("value, expected", [
    ('["A"]', "--train-env-vars ['A']: must be a JSON object (a mapping of names to values)"),
    ('{"A": 1', "--train-env-vars '{\"A\": 1': not valid JSON"),
    ('{"NCCL_DEBUG": 1}', '--train-env-vars NCCL_DEBUG: 1 is not a string; values are strings, as in a process environment: '
                          'write "NCCL_DEBUG": "1"'),
    ('{"A=B": "1"}', "--train-env-vars: 'A=B' is not an environment variable name"),
    ('{"MILES_CPU_THREADS": "two"}', '--train-env-vars MILES_CPU_THREADS: "two" is not a thread count'),
    ('{"MILES_CPU_THREADS": "0"}', '--train-env-vars MILES_CPU_THREADS: "0" is not a thread count'),
])
def test_train_env_vars_that_are_not_an_object_of_strings_are_refused(tmp_path, value, expected):
    [problem] = problems_of(base(tmp_path) + ["--train-env-vars", value])
    assert problem.startswith(expected)


# ---- --eval-function-path ------------------------------------------------------------------------------

EVAL_FUNCTIONS = '''
async def by_the_book(ctx, rollout_id):
    out = {}
    for name, d in ctx.datasets.items():
        samples = await ctx.generate_samples(d.prompts, d.n_samples_per_prompt, d.sampling_params)
        await ctx.score(samples, d.n_samples_per_prompt, name)
        n = d.n_samples_per_prompt
        out[name] = [samples[i:i + n] for i in range(0, len(samples), n)]
    return out, {"my_metric": ctx.weight * rollout_id}

async def not_groups(ctx, rollout_id):
    return {"x": [1, 2]}

def not_async(ctx, rollout_id):
    return {}
'''


def _eval_executor(tmp_path, fn, engine, **rollout):
    from miles.rollout.executor import RolloutExecutor
    (tmp_path / "evals.py").write_text(EVAL_FUNCTIONS)
    cfg = RolloutConfig(**{"batch_size": 2, "n_samples_per_prompt": 2, "max_response_len": 4, "rm_type": "exact_match",
                           "custom_args": {"weight": 0.5}, **rollout})
    e = EvalConfig(temperature=0.0, prompt_data=(("ones", "x"),), n_samples_per_prompt=2,
                   datasets=(EvalDataset(name="fours", path="y", n_samples_per_prompt=4),),
                   function_path=f"{tmp_path / 'evals.py'}:{fn}")
    return RolloutExecutor(prompts=PROMPTS, eval_sets={"ones": PROMPTS[:2], "fours": PROMPTS[2:3]}, rollout=cfg,
                           algorithm=AlgorithmConfig(), eval=e, shuffle=False, tokenizer=Digits(), engines=[engine], seed=0)


def test_an_eval_function_replaces_the_eval_and_its_datasets_get_the_built_in_metrics(tmp_path):
    # every sample answers "1" = the labels: reward 1 everywhere; "fours" has 4 samples per prompt
    engine = Recording([[1]])
    metrics = asyncio.run(_eval_executor(tmp_path, "by_the_book", engine).evaluate(6))
    assert metrics["eval/ones/reward_mean"] == 1.0 and metrics["eval/ones/pass@1"] == 1.0
    assert metrics["eval/fours/pass@4"] == 1.0 and "eval/fours/pass@2" not in metrics
    assert metrics["eval/my_metric"] == 3.0            # ctx.weight (a custom key) x rollout_id
    assert all(p.temperature == 0.0 for p in engine.params)   # each dataset's eval sampling


def test_an_eval_function_returning_something_else_stops_the_eval_naming_the_flag(tmp_path):
    with pytest.raises(EvalFunctionError, match=r"--eval-function-path .*evals.py:not_groups returned 'x'"):
        asyncio.run(_eval_executor(tmp_path, "not_groups", Recording([[1]])).evaluate(0))


def test_an_eval_function_must_be_async_and_evals_need_datasets(tmp_path):
    (tmp_path / "evals.py").write_text(EVAL_FUNCTIONS)
    with pytest.raises(ConfigError, match="--eval-function-path .*not an async function"):
        load_eval_function(f"{tmp_path / 'evals.py'}:not_async")
    [problem] = problems_of(base(tmp_path) + ["--eval-function-path", f"{tmp_path / 'evals.py'}:by_the_book"])
    assert problem.startswith("--eval-function-path") and "add --eval-prompt-data NAME PATH or --eval-config" in problem
