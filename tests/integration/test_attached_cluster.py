"""A run attached to a Ray cluster of two nodes started beside it (`ray start --head`, then `ray start
--address` with a resource of its own), every actor on the second node (--ray-actor-resources).

Nothing of the driver's reaches the actors by the filesystem: the nodes start with no PYTHONPATH and
in a folder of their own, and the reward is a relative file path in the driver's working directory
(outside the checkout). The run must ship miles and the reward through Ray's runtime_env; the reward
reports where it was loaded from. The first run's custom loss is shipped the same way and reports, from the
trainer's process, the variable --train-env-vars gave it (the actor's runtime_env merged over the job's). With --no-shared-fs the checkpoint comes back to the driver's --save
through Ray, complete (manifest, sha256) and with no scratch folder left on the node; a second run
resumes from it the same way. The cluster uses Ray's token authentication, as a cluster should: the
nodes and the driver get the token from RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (Ray's documented
way; --ray-allow-no-auth is about a cluster the run starts, not one it attaches to).

Nodes are stopped by their process groups and every process left that names this test's Ray folder is
ended by its pid; never `ray stop`, which ends every Ray process of the machine, other people's too.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from miles.checkpoint.store import CheckpointStore, verify
from miles.checkpoint.transfer import SCRATCH_PREFIX
from miles.runtime import read_trace
from miles.runtime.procs import pid_running
from tests.conftest import base_flags

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
NODE_START_TIMEOUT_S = 90
RUN_TIMEOUT_S = 240
WORKER_RESOURCE = "miles_worker"
OBJECT_STORE = 300 * 10**6           # bytes: checkpoint chunks of the tiny model are far smaller

REWARD = """\
import json, os

import miles


def reward(prompt, response, label):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"file": __file__, "cwd": os.getcwd(), "miles": miles.__file__}}) + "\\n")
    return 1.0 if response.strip() == label else 0.25
"""

# --custom-loss-function-path, in the trainer's process: where it was loaded from and what --train-env-vars set
LOSS = """\
import json, os

import torch


def loss(logprobs, batch, reduce):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"file": __file__, "var": os.environ.get("MILES_TEST_VAR")}}) + "\\n")
    ratio = torch.exp(logprobs - batch.old_logprobs)
    return reduce(-batch.advantages * ratio, batch.loss_mask)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ports(head: bool) -> list[str]:
    """Every port of a node chosen free: two nodes on one machine (and other people's clusters) collide
    on Ray's fixed defaults otherwise."""
    names = ["dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port"]
    names += ["ray-client-server-port"] if head else []
    return [f"--{name}={free_port()}" for name in names]


def start_node(args: list[str], env: dict, log: Path, cwd: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        # no autoscaler monitor, no log monitor, a small object store: a lean node on a shared machine
        return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                                 "--no-monitor", "--include-log-monitor=false", f"--object-store-memory={OBJECT_STORE}",
                                 *args],
                                env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_started(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def processes_under(root: Path) -> list[psutil.Process]:
    """Processes whose command line names this test's Ray folder: the nodes' processes and workers."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(root) in arg for arg in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def stop(procs: list[subprocess.Popen], root: Path) -> None:
    """Kill the nodes' process groups, then whatever still names `root`, each by its pid (a throwaway
    cluster: nothing in it needs a graceful end, and Ray's takes 15 s)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    for proc in processes_under(root):
        try:
            proc.kill()
        except psutil.Error:
            pass


@contextmanager
def two_nodes() -> Iterator[dict]:
    """A head with 1 CPU and a second node with 2 CPUs and the worker resource, token-authenticated."""
    root = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))       # Ray's socket paths must stay short
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    (root / "cwd").mkdir()
    (root / "node-tmp").mkdir()
    port, procs = free_port(), []
    try:
        procs.append(start_node(["--head", f"--port={port}", "--num-cpus=1", f"--temp-dir={root}/head",
                                 "--include-dashboard=false", *node_ports(True)], env, root / "head.log", root / "cwd"))
        wait_started(procs[0], root / "head.log")
        procs.append(start_node([f"--address=127.0.0.1:{port}", "--num-cpus=2", f"--temp-dir={root}/worker",
                                 f"--resources={json.dumps({WORKER_RESOURCE: 10})}", *node_ports(False)],
                                {**env, "TMPDIR": str(root / "node-tmp")}, root / "worker.log", root / "cwd"))
        wait_started(procs[1], root / "worker.log")
        yield {"address": f"127.0.0.1:{port}", "root": root, "env": env}
    finally:
        stop(procs, root)
        shutil.rmtree(root, ignore_errors=True)


def train(cluster: dict, driver_cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**cluster["env"], "PYTHONPATH": str(ROOT)}          # the driver's miles: this checkout
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *argv], cwd=driver_cwd, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def named_actors(cluster: dict) -> list:
    code = ("import ray, json; ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps(ray.util.list_named_actors(all_namespaces=True)))" % cluster["address"])
    out = subprocess.run([sys.executable, "-c", code], cwd=cluster["root"], env=cluster["env"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_run(run: subprocess.CompletedProcess, run_dir: Path, worker_tmp: Path,
              files: frozenset = frozenset({"reward.py"})) -> tuple:
    assert run.returncode == 0, run.stderr[-4000:]
    trace = read_trace(run_dir)
    ready, = trace.of("cluster_ready")
    worker, = [n["node_id"] for n in ready.get("nodes") if WORKER_RESOURCE in n["resources"]]
    assert len(ready.get("nodes")) == 2 and ready.get("token_auth") is True and ready.get("started") is False
    placed = trace.of("components_ready")[0].get("nodes")
    assert set(placed) == {"engine-0", "trainer", "rollout-executor"} and set(placed.values()) == {worker}, placed
    folders, = trace.of("checkpoint_folders")
    assert (folders.get("shared"), folders.get("why")) == (False, "--no-shared-fs")
    shipped, = trace.of("code_shipped")
    assert set(shipped.get("files")) == files and shipped.get("code") == [str(ROOT / "miles")]
    assert all(e.get("outcome") == "ok" for e in trace.of("disposed"))
    assert [p.name for p in worker_tmp.iterdir() if p.name.startswith(SCRATCH_PREFIX)] == []
    pids = trace.of("components_ready")[0].get("pids")
    deadline = time.monotonic() + 10                   # ray.kill is asynchronous
    while any(pid_running(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_running(p) for p in pids.values()), pids
    return trace


@pytest.mark.extended   # out of the default test run (CI budget); bash scripts/test.sh -m extended
def test_a_run_on_another_node_gets_its_code_and_reward_shipped_and_its_checkpoints_back(tiny_task, tmp_path):
    driver = tmp_path / "driver"                      # outside the checkout; the nodes never see it as a cwd
    driver.mkdir()
    rewards_log, losses_log = tmp_path / "rewards.jsonl", tmp_path / "losses.jsonl"
    (driver / "reward.py").write_text(REWARD.format(log=str(rewards_log)))
    (driver / "loss.py").write_text(LOSS.format(log=str(losses_log)))
    with two_nodes() as cluster:
        node_tmp, worker_dir = cluster["root"] / "node-tmp", str(cluster["root"] / "worker")
        # --run-dir and --save relative to the driver's working directory, as people write them
        attach = dict(ray_address=cluster["address"], ray_actor_resources=json.dumps({WORKER_RESOURCE: 1}),
                      no_shared_fs=True, custom_rm_path="reward.py:reward", save="ck")
        # the first run also trains with a custom loss shipped the same way, in a trainer started with
        # --train-env-vars: the actor's own runtime_env (the variable) is merged over the job's (the code)
        first = train(cluster, driver, base_flags(tiny_task, Path("run1"), num_rollout=1, loss_type="custom_loss",
                                                  custom_loss_function_path="loss.py:loss",
                                                  train_env_vars='{"MILES_TEST_VAR": "x"}', **attach))
        check_run(first, driver / "run1", node_tmp, files=frozenset({"reward.py", "loss.py"}))
        losses = [json.loads(line) for line in losses_log.read_text().splitlines()]
        assert losses and all(c["var"] == "x" and c["file"].startswith(worker_dir) for c in losses), losses
        # the actors' logs went to the driver's run dir (one machine here), not into their working dirs
        assert (driver / "run1" / "logs" / "trainer-0.jsonl").is_file()
        # the reward ran on the worker node from the shipped copy, with the shipped miles
        calls = [json.loads(line) for line in rewards_log.read_text().splitlines()]
        assert len(calls) == 16                                  # 4 prompts x 4 samples
        for call in calls:
            assert call["file"].startswith(worker_dir) and call["file"] != str(driver / "reward.py"), call
            assert call["cwd"].startswith(worker_dir) and call["miles"].startswith(worker_dir), call
        reward_mean = next(r for r in map(json.loads, (driver / "run1" / "metrics.jsonl").read_text().splitlines())
                           if r.get("kind") == "train")["reward_mean"]
        assert 0.25 <= reward_mean <= 1.0                        # this reward's values, not the built-in's
        # the checkpoint came back whole through Ray: manifest, every sha256, the HF export
        store = CheckpointStore(driver / "ck")
        (rid, path), = store.list()
        assert rid == 0 and verify(path, 0, deep=True) == []
        assert (path / "trainer" / "model.safetensors").is_file() and (path / "hf" / "config.json").is_file()

        second = train(cluster, driver, base_flags(tiny_task, Path("run2"), num_rollout=2, load="ck", **attach))
        trace = check_run(second, driver / "run2", node_tmp)
        resumed, = trace.of("resumed")
        assert (resumed.get("rollout_id"), resumed.get("verified")) == (0, True)
        assert [r for r, _ in store.list()] == [0, 1] and verify(store.latest()[1], 1, deep=True) == []
        assert len(rewards_log.read_text().splitlines()) == 32
        assert [a for a in named_actors(cluster) if a.get("namespace", "").startswith("miles-")] == []
