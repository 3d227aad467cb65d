"""SGLang's contract as miles builds and reads it (pure functions; field names from sglang 0.5.23)."""

from __future__ import annotations

import pytest

from miles.rollout.engines.sglang import api
from miles.types import SamplingParams


def test_server_argv_is_sglangs_launch_command_with_token_ids_and_version_zero():
    argv = api.server_argv("/py", "/m", host="127.0.0.1", port=123, tp_size=2, dtype="bfloat16", seed=7,
                           memory_saver=True, extra=["--mem-fraction-static", "0.5"])
    assert "--device" not in argv          # auto: SGLang detects it
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    for flag, value in (("--model-path", "/m"), ("--port", "123"), ("--tp-size", "2"), ("--dtype", "bfloat16"),
                        ("--random-seed", "7"), ("--weight-version", "0"), ("--mem-fraction-static", "0.5")):
        assert argv[argv.index(flag) + 1] == value
    assert "--skip-tokenizer-init" in argv and "--enable-memory-saver" in argv


def test_passthrough_flags_become_sglang_flags_and_refuse_what_miles_sets():
    assert api.passthrough_flags({"mem-fraction-static": 0.7, "disable-radix-cache": True, "cuda-graph-bs": [1, 2],
                                  "enable-foo": False}) == \
        ["--mem-fraction-static", "0.7", "--disable-radix-cache", "--cuda-graph-bs", "1", "2"]
    with pytest.raises(ValueError, match="--sglang-tp-size is set by miles"):
        api.passthrough_flags({"tp-size": 2})


def test_generate_body_uses_sglang_field_names_and_seeds():
    body = api.generate_body([5, 6], SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=8,
                                                    stop_token_ids=(9,)), rid="r", seed=11)
    assert body == {"rid": "r", "input_ids": [5, 6], "return_logprob": True, "logprob_start_len": -1,
                    "stream": False, "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9,
                                                         "top_k": 5, "stop_token_ids": [9], "sampling_seed": 11}}
    assert "sampling_seed" not in api.generate_body([1], SamplingParams(), rid="r", seed=None)["sampling_params"]


def test_request_seeds_are_stable_and_do_not_repeat_across_neighbouring_engine_seeds():
    assert api.request_seed(5, 3) == api.request_seed(5, 3)
    # the executor gives engine e the seed s + e: request 1 of engine 0 must differ from request 0 of engine 1
    seeds = {api.request_seed(s, i) for s in range(100, 104) for i in range(64)}
    assert len(seeds) == 4 * 64 and all(0 <= x < 2**31 for x in seeds)


def response(ids, lps, finish, version="3", **meta):
    return {"output_ids": ids, "meta_info": {"id": "r", "finish_reason": finish, "weight_version": version,
                                             "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                                             **meta}}


def test_parse_generation_reads_ids_logprobs_finish_reason_and_version():
    g = api.parse_generation(response([4, 2], [-0.5, -1.5], {"type": "stop", "matched": 2}), rid="r")
    assert (g.response_ids, g.logprobs, g.finish_reason, g.weight_version) == ([4, 2], [-0.5, -1.5], "stop", 3)
    g = api.parse_generation(response([4], [-0.1], {"type": "length", "length": 1}), rid="r")
    assert g.finish_reason == "length"


def test_a_request_updated_mid_flight_counts_from_its_oldest_version():
    body = response([1, 1, 1], [-1.0] * 3, {"type": "length", "length": 3}, version="5",
                    weight_versions=[{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}])
    assert api.parse_generation(body, rid="r").weight_version == 4


def test_an_abort_the_engine_asked_for_is_what_the_request_generated_until_then():
    body = response([7, 8], [-0.2, -0.4], {"type": "abort", "message": "Abort in running batch", "status_code": 200})
    g = api.parse_generation(body, rid="r", abort_asked=True)
    assert (g.response_ids, g.logprobs, g.finish_reason, g.weight_version) == ([7, 8], [-0.2, -0.4], "abort", 3)
    with pytest.raises(api.SGLangResponseError, match="aborted by the server: Abort in running batch"):
        api.parse_generation(body, rid="r")                 # an abort nobody asked for is an error


@pytest.mark.parametrize("body, match", [
    (response([1], [-1.0], {"type": "abort", "message": "Abort in waiting queue", "status_code": 200}),
     "aborted by the server: Abort in waiting queue"),
    (response([1, 2], [-1.0], {"type": "length"}), r"output_token_logprobs \(1\) do not match output_ids \(2\)"),
    (response([1], [-1.0], {"type": "length"}, version="default"), "--weight-version 0"),
    ({"text": "hi", "meta_info": {}}, "skip-tokenizer-init"),
])
def test_malformed_or_aborted_responses_are_errors_naming_the_request(body, match):
    with pytest.raises(api.SGLangResponseError, match=match):
        api.parse_generation(body, rid="r")


def test_control_bodies_carry_only_sglang_fields():
    assert api.disk_update_body("/w", 2) == {"model_path": "/w", "weight_version": "2", "flush_cache": True}
    with pytest.raises(ValueError, match="use one or more of weights, kv_cache, cuda_graph"):
        api.check_tags(["kv"])
