"""The user functions a run loads by path, as one table: the flag, where the config keeps it, the loader
that imports and checks it, and the call shape it must have.

Everything that iterates the run's user functions reads this table: the config's path handling
(`RunConfig.user_function_paths`, a config file's relative paths, what an attached cluster ships), the
driver's start-up check (`miles.data.input_checks.check_user_functions`, one loop, before any actor)
and the messages that show a signature. A loader is "module:function", called with the path; it imports
the function and raises `ConfigError` naming the flag when it cannot be called as `signature`, and is
what the code that runs the function uses too, so the check and the use cannot drift. A new user
function is one row here and its loader beside the code that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UserFunction:
    flag: str
    section: str                    # the RunConfig section ...
    field: str                      # ... and field holding the path
    loader: str | None              # "module:function" (path) -> the checked function; None: see `note`
    signature: str                  # the call shape, as the messages show it
    note: str = ""


USER_FUNCTIONS: tuple[UserFunction, ...] = (
    UserFunction("--custom-rm-path", "rollout", "custom_rm_path", "miles.rollout.rewards:import_reward_fn",
                 "a reward fn(prompt, response_text, label) -> float (sync or async), or a group reward "
                 "fn(prompt, responses, label) -> list[float]"),
    UserFunction("--dynamic-sampling-filter-path", "rollout", "dynamic_sampling_filter_path",
                 "miles.rollout.filters:load_filter", "filter(group: list[Sample]) -> bool"),
    UserFunction("--rollout-sample-filter-path", "rollout", "sample_filter_path",
                 "miles.rollout.hooks:load_sample_filter", "fn(ctx, groups: list[list[Sample]]) -> None"),
    UserFunction("--rollout-all-samples-process-path", "rollout", "all_samples_process_path",
                 "miles.rollout.hooks:load_all_samples_process", "fn(ctx, all_groups: list[list[Sample]]) -> None"),
    UserFunction("--buffer-filter-path", "rollout", "buffer_filter_path", "miles.rollout.partial:load_buffer_filter",
                 "fn(ctx, rollout_id, buffer, num_groups) -> list[list[Sample]]"),
    UserFunction("--custom-reward-post-process-path", "rollout", "reward_post_process_path",
                 "miles.rollout.hooks:load_reward_post_process", "fn(ctx, samples: list[Sample]) -> (raw_rewards, rewards)"),
    UserFunction("--custom-rollout-log-function-path", "rollout", "log_function_path",
                 "miles.rollout.hooks:load_rollout_log", "fn(ctx, samples, metrics: dict, rollout_time_s) -> bool | None"),
    UserFunction("--custom-eval-rollout-log-function-path", "eval", "log_function_path",
                 "miles.rollout.hooks:load_eval_log",
                 "fn(ctx, data: dict[str, list[Sample]], metrics: dict) -> bool | None"),
    UserFunction("--eval-function-path", "eval", "function_path", "miles.rollout.evals:load_eval_function",
                 "async fn(ctx, rollout_id) -> {dataset: groups} or ({dataset: groups}, metrics)"),
    UserFunction("--custom-generate-function-path", "generate", "custom_generate_function_path",
                 "miles.rollout.generation:load_generate_function", "async fn(ctx, sample, sampling_params) -> Sample"),
    UserFunction("--rollout-function-path", "generate", "rollout_function_path",
                 "miles.rollout.generation:load_rollout_function", "async fn(ctx, rollout_id) -> list[list[Sample]]"),
    UserFunction("--generate-execute-tool-function-path", "generate", "execute_tool_function_path", None,
                 "async fn(name, arguments) -> str",
                 note="loaded with the tool specs and the parser (miles.rollout.tools.load_tool_kit), by init"),
    UserFunction("--custom-loss-function-path", "algorithm", "custom_loss_function_path",
                 "miles.training.terms:load_custom_loss", "fn(logprobs, batch, reduce) -> loss or (loss, metrics)"),
    UserFunction("--custom-tis-function-path", "algorithm", "custom_tis_function_path",
                 "miles.training.terms:load_custom_tis",
                 "fn(train_logprobs, rollout_logprobs, mask) -> weights or (weights, metrics)"),
    UserFunction("--custom-pg-loss-reducer-function-path", "algorithm", "pg_loss_reducer_path",
                 "miles.training.pg_reducer:load_reducer",
                 "get_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(x) -> "
                 "Tensor"),
)

BY_FLAG: dict[str, UserFunction] = {f.flag: f for f in USER_FUNCTIONS}


def signature(flag: str) -> str:
    """The call shape the user function of `flag` must have (its loader's check says it)."""
    return BY_FLAG[flag].signature
