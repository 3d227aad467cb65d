"""Shared fixtures: one local Ray cluster per session (for the tests that ask), a tiny model and task.

Runs in these tests attach to the session's cluster (the test process holds the connection), so
each test pays for its actors, not for a cluster start; a run that attaches removes only its own
actors, which is what the leak checks assert.
"""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def ray_cluster():
    # no subreaper option here: it would make this process a subreaper, and a driver subprocess
    # killed with -9 would leave its cluster's processes reparented to pytest, where they live on
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ray = pytest.importorskip("ray")
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, os.environ.get("PYTHONPATH", "")]
    from tests.fakes import FAKES_DIR, real_sglang_installed
    if not real_sglang_installed():   # servers an SGLang engine starts in a worker find the fake sglang package
        paths.insert(0, str(FAKES_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", namespace="miles-tests")
    from miles.cluster.ray_cluster import restore_sigchld
    restore_sigchld()             # else subprocess exit codes read as 0 in this process
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def miles_actors(namespace: str | None = None) -> list[tuple[str, str]]:
    """Live named actors of one run's namespace, or of any miles run (namespaces miles-*): a leak check."""
    import ray

    def ours(ns: str) -> bool:
        return ns == namespace if namespace else ns.startswith("miles-") and ns != "miles-tests"

    return sorted((a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if ours(a.get("namespace", "")))


def write_addition_task(root: Path, *, n_train: int = 64, n_eval: int = 16, seed: int = 0) -> tuple[Path, Path]:
    r = random.Random(seed)
    paths = []
    for name, n in (("train.jsonl", n_train), ("eval.jsonl", n_eval)):
        path = root / name
        with open(path, "w") as f:
            for _ in range(n):
                a, b = r.randint(0, 9), r.randint(0, 9)
                f.write(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_task")
    model = make_tiny_model(root / "model")
    train, eval_ = write_addition_task(root)
    return {"model": model, "train": str(train), "eval": str(eval_), "root": root}


@contextmanager
def small_tmpfs(folder: Path, size: str, covered_by: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's `size=`, e.g. "200k") mounted at `folder`, unmounted after; the test is
    skipped with the reason where this process may not mount one (`covered_by`: the test that covers the
    logic there)."""
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root; {covered_by} covers the logic")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); {covered_by} covers the logic")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def world_writable(root: Path) -> list[str]:
    """Files and folders under `root` (itself included) that any user may write, without the sticky bit:
    what another user on a shared host could replace or plant files in."""
    out = []
    for folder, _dirs, files in os.walk(root):
        for path in [folder, *(os.path.join(folder, f) for f in files)]:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:        # gone while we looked
                continue
            if not stat.S_ISLNK(mode) and mode & 0o002 and not mode & stat.S_ISVTX:
                out.append(f"{oct(stat.S_IMODE(mode))} {path}")
    return out


def assert_cpu_threads(run_dir: Path, trace, *, overlapped: bool) -> None:
    """A CPU run on this machine: the placement's thread budget (miles.cluster.placement.cpu_thread_budget)
    is traced, and the trainer and each engine computed with the threads it gives them (their logs)."""
    from miles.runtime.procs import usable_cores

    [placement] = trace.of("placement")
    cores, engines = usable_cores(), len(placement.get("engines"))
    trainer = max(1, cores - engines) if overlapped else cores
    assert placement.get("cpu_threads") == {"cores": cores, "overlapped": overlapped, "trainer": trainer, "engine": 1}
    ready = {}
    for log in (run_dir / "logs").glob("*.jsonl"):
        for line in log.read_text().splitlines():
            row = json.loads(line)
            if row.get("event") in ("trainer_ready", "engine_ready"):
                ready[log.stem] = row.get("cpu_threads")
    assert ready == {"trainer-0": trainer, **{f"engine-{i}": 1 for i in range(engines)}}, ready


def base_flags(task: dict, run_dir: Path, **extra: object) -> list[str]:
    flags = {"hf-checkpoint": task["model"], "prompt-data": task["train"], "label-key": "label",
             "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 4,
             "num-rollout": 3, "lr": 1e-3, "seed": 1, "run-dir": str(run_dir), "trace-console": "off",
             # the values these tests were written with, before the defaults became miles'
             "rollout-shuffle": True, "loss-agg-mode": "token_mean", "kl-loss-type": "k3", "eval-temperature": 0.0,
             "rollout-num-engines": 1}
    flags.update({k.replace("_", "-"): v for k, v in extra.items()})
    argv: list[str] = []
    for k, v in flags.items():
        if v is True:
            argv.append(f"--{k}")
        elif isinstance(v, (list, tuple)):
            argv += [f"--{k}", *map(str, v)]
        elif v is not None and v is not False:
            argv += [f"--{k}", str(v)]
    return argv


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2`, scripts/test.sh's default run), one worker runs the end-to-end tests
    (everything outside tests/unit) in order while the other takes the unit files one by one.

    An end-to-end run keeps the two cores ~81% busy by itself and two of them side by side only share
    the cores; the unit files fill the rest (docs/performance.md, "The test suite on 2 cores"). A
    scheduler, not `--dist loadgroup` with markers: xdist 3.8 tags a group onto `item._nodeid`, which
    pytest 9 no longer reads, so the groups are silently ignored.
    """
    if config.getvalue("dist") != "load":     # an explicit --dist (loadfile, loadscope, ...) is the user's
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndBesideUnitFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.startswith("tests/unit/") else "end-to-end"

    return EndToEndBesideUnitFiles(config, log)
