"""The fake SGLang server answers as SGLang 0.5.23 does, so tests against it mean something: unknown
sampling fields and missing required fields are refused with SGLang's status and body shape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from miles.runtime.procs import OwnedProcess, free_port
from tests.fakes import FAKES_DIR, fake_calls, with_fake_sglang
from tests.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(60)


def start_fake(model: str) -> tuple[OwnedProcess, str]:
    port = free_port()
    p = OwnedProcess([sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
                      "--skip-tokenizer-init", "--weight-version", "0"], name="fake",
                     env=with_fake_sglang(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health_generate", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return p, url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p, url = start_fake(make_tiny_model(tmp_path_factory.mktemp("fake") / "model"))
    yield url
    p.dispose()


def get(url: str, timeout: float = 10) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def post(url: str, body) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, text.decode()


def test_unknown_sampling_fields_are_refused_with_the_schemas_text(server):
    status, body = post(server + "/generate", {"input_ids": [5], "sampling_params": {"seed": 1}})
    assert status == 400 and body["error"].startswith("unknown field `seed`, expected one of `max_new_tokens`")
    status, body = post(server + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": "4"}})
    assert status == 400 and body == {"error": 'invalid type: "4", expected i64'}


def test_a_text_prompt_or_no_prompt_is_refused_as_sglang_refuses_it(server):
    status, body = post(server + "/generate", {"text": "hi"})
    assert status == 400 and "skip_tokenizer_init=True cannot accept text prompts" in body["error"]["message"]
    status, body = post(server + "/generate", {"sampling_params": {}})
    assert (status, body) == (400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})


def test_missing_required_fields_get_sglangs_validation_error_shape(server):
    status, body = post(server + "/init_weights_update_group", {"master_address": "x", "world_size": 2})
    assert status == 400 and set(body) == {"object", "message", "type", "param", "code"}
    assert body["code"] == 400 and body["type"] == "Bad Request"
    assert "'master_port'" in body["message"] and "'rank_offset'" in body["message"]


def test_unknown_top_level_keys_are_ignored_as_sglang_does_but_recorded(server):
    status, body = post(server + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2},
                                               "seed": 3, "return_logprob": True})
    assert status == 200 and len(body["output_ids"]) == len(body["meta_info"]["output_token_logprobs"])
    assert fake_calls(server, "/generate")[-1]["ignored"] == ["seed"]
    status, body = post(server + "/pause_generation", {"mode": "retract", "bogus": 1})
    assert status == 200 and fake_calls(server, "/pause_generation")[-1]["ignored"] == ["bogus"]
    post(server + "/continue_generation", {})


def test_resuming_memory_that_was_not_released_is_refused_as_sglang_does(server):
    status, body = post(server + "/resume_memory_occupation", {"tags": ["weights"]})
    assert (status, body) == (400, {"error": {"message": "'weights'"}})      # SGLang's KeyError text


def test_an_unknown_launch_flag_exits_like_sglangs_argparse(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--nope"],
                         env=with_fake_sglang(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "sglang serve: error: unrecognized arguments: --nope" in out.stderr
    assert os.path.isdir(FAKES_DIR / "sglang")


def test_a_hung_server_stops_generating_and_answers_health_checks_late_with_503(server):
    state = post(server + "/fake/hang", {"generate": True, "health": True, "health_timeout_s": 0.5})[1]
    assert state["generate_hung"] and state["health_hung"]
    answer = {}
    request = threading.Thread(target=lambda: answer.setdefault("status", post(server + "/generate", {
        "rid": "stuck", "input_ids": [5], "sampling_params": {"max_new_tokens": 2}})[0]), daemon=True)
    request.start()
    try:
        t0 = time.monotonic()
        assert get(server + "/health_generate") == 503 and time.monotonic() - t0 >= 0.5
        assert get(server + "/health") == 503
        assert request.is_alive() and post(server + "/fake/hang", {})[1]["running"] == ["stuck"]
    finally:
        post(server + "/fake/hang", {"generate": False, "health": False})
    request.join(timeout=10)
    assert answer == {"status": 200} and get(server + "/health_generate") == 200
    with urllib.request.urlopen(server + "/fake/state", timeout=10) as resp:
        assert json.loads(resp.read())["health_checks"] >= 3     # every /health and /health_generate is counted


def test_the_servers_child_dies_with_the_server_alone(tmp_path):
    p, _ = start_fake(make_tiny_model(tmp_path / "m"))
    try:
        [child] = psutil.Process(p.pid).children()
        os.kill(p.pid, signal.SIGKILL)             # the leader only, as when the engine that owns it is killed
        assert psutil.wait_procs([child], timeout=10)[1] == []
    finally:
        p.dispose()
