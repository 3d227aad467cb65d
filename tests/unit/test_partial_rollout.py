"""--partial-rollout in the executor with two scripted engines: the groups still generating when the
batch fills up are aborted, buffered, and continued by the next rollout (prompt + partial response in,
the rest of the token budget); the buffer filter picks them; the buffer survives a checkpoint; bad
filters and flag combinations name their flag."""

import asyncio
import json

import pytest

from miles.config import AlgorithmConfig, ConfigError, EvalConfig, RolloutConfig
from miles.config.flags import parse_flags
from miles.rollout.executor import RolloutExecutor
from miles.rollout.hooks import HookContext
from miles.rollout.partial import BufferFilterError, PartialBuffer, load_buffer_filter
from miles.types import Generation, Prompt, Sample
from tests.unit.test_executor_algorithms import Digits
from tests.unit.test_tracking_flags import base

HERE = "tests.unit.test_partial_rollout"
PROMPTS = [Prompt(index=i, text=str(i), prompt_ids=(i,), label="1") for i in range(8)]
PARTIAL, PARTIAL_LP = [7, 8], [-0.1, -0.2]     # what a hung request generated before the abort


def keep_all(group):
    return True


class Engine:
    """Answers [1] (finish "stop", logprob -0.5) to a fresh prompt and [9] (-0.3) to a continued one; a
    request whose prompt id is in `hang` generates PARTIAL, then waits for abort() and ends with "abort"."""

    def __init__(self):
        self.version, self.hang, self.calls = 0, set(), []
        self._aborted: asyncio.Event | None = None     # made in the running loop (each asyncio.run has its own)

    async def generate(self, prompts, params, caps=None):
        self.calls.append(([list(p) for p in prompts], caps))
        if any(p[0] in self.hang for p in prompts):
            self._aborted = asyncio.Event()
            await self._aborted.wait()
        out = []
        for p in prompts:
            if p[0] in self.hang:
                out.append(Generation(list(PARTIAL), list(PARTIAL_LP), "abort", self.version))
            elif len(p) > 1:
                out.append(Generation([9], [-0.3], "stop", self.version))
            else:
                out.append(Generation([1], [-0.5], "stop", self.version))
        return out

    def abort(self):
        if self._aborted is not None:
            self._aborted.set()


def executor(engines, **rollout):
    cfg = RolloutConfig(**{"batch_size": 1, "n_samples_per_prompt": 2, "max_response_len": 4, "rm_type": "exact_match",
                           "dynamic_sampling_filter_path": f"{HERE}:keep_all", "over_sampling_batch_size": 2,
                           "partial_rollout": True, **rollout})
    return RolloutExecutor(prompts=PROMPTS, eval_sets={}, rollout=cfg,
                           algorithm=AlgorithmConfig(loss_agg_mode="token_mean", kl_loss_type="k3"),
                           eval=EvalConfig(temperature=0.0), shuffle=False, tokenizer=Digits(), engines=engines, seed=0)


def first_rollout(**rollout):
    """Rollout 0: engine 0 answers prompt 0, engine 1 hangs on prompt 1 until the full batch aborts it."""
    engines = [Engine(), Engine()]
    engines[1].hang = {1}
    ex = executor(engines, **rollout)
    return ex, engines, asyncio.run(ex.generate(0))


def second_rollout(ex, engines):
    """Rollout 1 on weights version 1: the buffered group of prompt 1 (engine 0) and fresh prompt 2
    (engine 1, which hangs on it: it goes to the buffer in its turn)."""
    for e in engines:
        e.version, e.hang, e.calls = 1, {2}, []
    return asyncio.run(ex.generate(1))


def test_an_aborted_group_is_buffered_and_continued_where_it_stopped():
    ex, engines, first = first_rollout()
    assert [s.prompt.index for s in first.samples] == [0, 0]
    assert first.metrics["partial_rollout_aborted_groups"] == 1 and first.metrics["partial_rollout_buffer_groups"] == 1
    second = second_rollout(ex, engines)
    # the continued samples went to engine 0 as prompt + partial response, with 4 - 2 tokens left
    assert engines[0].calls == [([[1, 7, 8], [1, 7, 8]], [2, 2])]
    assert engines[1].calls == [([[2], [2]], None)]                   # one cap for all: params.max_new_tokens
    assert second.metrics["partial_rollout_resumed_groups"] == 1
    assert second.metrics["partial_rollout_buffer_groups"] == 1          # prompt 2's group, aborted in its turn
    for s in second.samples:
        assert s.prompt.index == 1 and s.response_ids == [7, 8, 9] and s.rollout_logprobs == [-0.1, -0.2, -0.3]
        assert s.finish_reason == "stop" and s.status == "completed" and s.response_text == "789"
        assert s.metadata["weight_versions"] == [0, 1] and s.weight_version == 0   # the oldest part's
        assert s.metadata["start_rollout_id"] == 0 and s.mask() == [1, 1, 1]       # trained whole by default
    assert second.metrics["staleness_max"] == 1.0


def test_mask_offpolicy_trains_only_the_last_calls_tokens():
    ex, engines, _ = first_rollout(mask_offpolicy_in_partial_rollout=True)
    second = second_rollout(ex, engines)
    assert [s.mask() for s in second.samples] == [[0, 0, 1], [0, 0, 1]]
    assert [s.rollout_logprobs for s in second.samples] == [[-0.1, -0.2, -0.3]] * 2   # recorded all the same


def test_the_buffer_survives_a_checkpoint_and_is_not_served_twice():
    ex, engines, _ = first_rollout()
    state = json.loads(json.dumps(ex.state_dict()))           # rollout.json is JSON
    resumed_engines = [Engine(), Engine()]
    resumed = executor(resumed_engines)
    resumed.load_state_dict(state)
    second = second_rollout(resumed, resumed_engines)
    assert resumed_engines[0].calls[0][0] == [[1, 7, 8], [1, 7, 8]]
    assert [s.response_ids for s in second.samples] == [[7, 8, 9]] * 2
    # the buffered group went out once: the third rollout continues prompt 2's group, then draws prompt 3
    for e in resumed_engines:
        e.hang, e.calls = set(), []
    third = asyncio.run(resumed.generate(2))
    assert [s.prompt.index for s in third.samples] == [2, 2] and third.metrics["partial_rollout_resumed_groups"] == 1
    assert resumed_engines[0].calls[0][0] == [[2, 7, 8], [2, 7, 8]] and resumed_engines[1].calls[0][0] == [[3], [3]]


def test_a_rollout_retried_after_an_engine_failure_continues_the_same_groups():
    ex, engines, _ = first_rollout()

    class Dead(Engine):
        async def generate(self, prompts, params, caps=None):
            raise RuntimeError("engine died")

    ex.set_engines([Dead(), Dead()])
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(ex.generate(1))
    ex.set_engines(engines)
    second = second_rollout(ex, engines)
    assert engines[0].calls[0][0] == [[1, 7, 8], [1, 7, 8]] and second.samples[0].response_ids == [7, 8, 9]


# -- the buffer filter ------------------------------------------------------------------------------------

def newest_first(ctx, rollout_id, buffer, num_groups):
    picked = buffer[::-1][:num_groups]
    for g in picked:
        buffer.remove(g)
    buffer.pop(0)                                   # and drop the oldest: counted, not served
    return picked


def copies(ctx, rollout_id, buffer, num_groups):
    return [list(g) for g in buffer[:num_groups]]


def too_many(ctx, rollout_id, buffer, num_groups):
    return list(buffer)


def three_arguments(ctx, buffer, num_groups):
    return buffer


def groups_of(*indices):
    return [[Sample(prompt=PROMPTS[i], group=0, response_ids=[7], rollout_logprobs=[-0.1], finish_reason="abort",
                    weight_version=0, status="aborted")] * 2 for i in indices]


def buffer_with(path, *indices):
    cfg = RolloutConfig(batch_size=1, n_samples_per_prompt=2, partial_rollout=True, buffer_filter_path=path)
    buffer = PartialBuffer(cfg)
    buffer.add(groups_of(*indices))
    return buffer, HookContext(rollout_id=3, rollout=cfg, algorithm=AlgorithmConfig())


def test_the_buffer_filter_picks_the_groups_and_may_drop_others():
    buffer, ctx = buffer_with(f"{HERE}:newest_first", 0, 1, 2, 3)
    picked, dropped = buffer.take(ctx, 2)
    assert [g[0].prompt.index for g in picked] == [3, 2] and dropped == 1 and len(buffer) == 1
    assert [[s["prompt"] for s in g] for g in buffer.state_dict()] == [[1, 1]]
    default, ctx = buffer_with(None, 0, 1, 2)
    assert [g[0].prompt.index for g in default.take(ctx, 2)[0]] == [0, 1] and len(default) == 1


@pytest.mark.parametrize("name, message", [("copies", "is not one of the buffer's groups"),
                                           ("too_many", "returned 2 groups for 1 asked")])
def test_a_bad_buffer_filter_answer_names_the_flag(name, message):
    buffer, ctx = buffer_with(f"{HERE}:{name}", 0, 1)
    with pytest.raises(BufferFilterError, match=f"--buffer-filter-path {HERE}:{name}.*{message}"):
        buffer.take(ctx, 1)


def test_a_buffer_filter_of_the_wrong_signature_fails_at_start_up():
    with pytest.raises(ConfigError, match="--buffer-filter-path .*cannot be called as fn\\(ctx, rollout_id, buffer"):
        load_buffer_filter(f"{HERE}:three_arguments")
    with pytest.raises(ConfigError, match="--buffer-filter-path"):
        load_buffer_filter(f"{HERE}:no_such_function")


# -- flags ------------------------------------------------------------------------------------------------

def test_the_flags_parse_and_the_filter_ships_with_the_run(tmp_path):
    dynamic = ["--dynamic-sampling-filter-path", f"{HERE}:keep_all", "--over-sampling-batch-size", "4"]
    cfg = parse_flags(base(tmp_path) + dynamic + ["--partial-rollout", "--mask-offpolicy-in-partial-rollout",
                                                  "--buffer-filter-path", f"{HERE}:newest_first"])[0]
    assert cfg.rollout.partial_rollout and cfg.rollout.mask_offpolicy_in_partial_rollout
    assert cfg.user_function_paths["--buffer-filter-path"] == f"{HERE}:newest_first"


@pytest.mark.parametrize("extra, message", [
    (["--partial-rollout"], "--partial-rollout continues the groups dynamic sampling aborts"),
    (["--buffer-filter-path", f"{HERE}:newest_first"], "--buffer-filter-path only act with --partial-rollout"),
    (["--mask-offpolicy-in-partial-rollout"], "--mask-offpolicy-in-partial-rollout only act with --partial-rollout"),
])
def test_flags_that_would_do_nothing_are_refused(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_flags(base(tmp_path) + extra)


@pytest.mark.parametrize("fix", ["--use-tis", "--use-rollout-logprobs", "--mask-offpolicy-in-partial-rollout"])
def test_training_the_old_parts_needs_an_off_policy_correction(tmp_path, fix):
    argv = base(tmp_path) + ["--dynamic-sampling-filter-path", f"{HERE}:keep_all", "--partial-rollout"]
    with pytest.raises(ConfigError, match="--partial-rollout trains a continued sample's earlier tokens"):
        parse_flags(argv)
    assert parse_flags(argv + [fix])[0].rollout.partial_rollout


def test_ci_test_needs_the_old_parts_masked(tmp_path):
    argv = base(tmp_path) + ["--dynamic-sampling-filter-path", f"{HERE}:keep_all", "--partial-rollout", "--ci-test",
                             "--use-tis"]
    with pytest.raises(ConfigError, match="--ci-test checks that engine and trainer logprobs agree"):
        parse_flags(argv)
    assert parse_flags(argv + ["--mask-offpolicy-in-partial-rollout"])[0].ci_test


def test_partial_rollout_with_a_generate_function_is_refused(tmp_path):
    argv = base(tmp_path) + ["--dynamic-sampling-filter-path", f"{HERE}:keep_all", "--partial-rollout", "--use-tis",
                             "--custom-generate-function-path", "miles.rollout.multi_turn:generate"]
    with pytest.raises(ConfigError, match="--partial-rollout continues single-turn samples"):
        parse_flags(argv)


def test_a_run_of_one_engine_is_refused_at_start_up():
    # one engine answers a round in one call: nothing would ever be cut short and buffered
    from miles.config import DataConfig, ModelConfig, RunConfig
    from miles.config.validate import validate

    def run(rollout):
        return RunConfig(model=ModelConfig(hf_checkpoint="m"), data=DataConfig(prompt_data="p"), rollout=rollout)
    cfg = run(RolloutConfig(batch_size=1, partial_rollout=True))
    with pytest.raises(ConfigError) as err:          # the registry's checks that take the engine count
        validate(cfg, num_engines=1)
    (problem,) = err.value.problems
    assert problem.startswith("--partial-rollout cuts short") and "this run has 1 engine" in problem
    validate(cfg, num_engines=2)
    validate(run(RolloutConfig(batch_size=1)), num_engines=1)
