"""The fault matrix's engine and trainer deaths on one GPU, colocated: each run still ends
clean (the trace conforms, teardown unwinds in reverse order, no actor or worker process is left),
and the GPU is left as it was: no process of the run in `nvidia-smi`, its memory back to what it
was before the run. The CPU cases are tests/faults/test_fault_matrix.py; these reuse its checks.

Run on the GPU machine, from the checkout, after installing the .whl wheels (ray among them):
    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_faults_gpu.py -q
"""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from tests.faults.test_fault_matrix import STATES, assert_clean_end, run_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.ray,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_FLAGS = ["--device", "cuda", "--colocate", "--offload", "--rollout-engine", "fast"]
LEFT_MIB = 256            # what a torn-down run may leave used on the GPU (driver bookkeeping), far below an engine's cache


def smi(query: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_used_mib() -> int:
    return int(smi("gpu=memory.used")[0])


def run_pids(trace) -> set[int]:
    pids: set[int] = set()
    for e in trace.of("components_ready", "engine_restarted"):
        pids.update(int(p) for p in (e.get("pids") or {}).values())
    return pids


def assert_gpu_left_as_it_was(trace, before_mib: int) -> None:
    deadline = time.monotonic() + 20                 # a killed process's context is freed by the driver, soon
    while True:
        on_gpu = {int(p) for p in smi("compute-apps=pid")} & run_pids(trace)
        used = gpu_used_mib()
        if (not on_gpu and used <= before_mib + LEFT_MIB) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not on_gpu, f"processes of the run still on the GPU: {sorted(on_gpu)}"
    assert used <= before_mib + LEFT_MIB, f"{used - before_mib} MiB more GPU memory used than before the run"


@pytest.mark.parametrize("state,fault", [("train", "kill_trainer"), ("weight_sync", "kill_trainer"),
                                         ("rollout", "raise")])
def test_a_fatal_fault_leaves_nothing_on_the_gpu(ray_cluster, tiny_task, tmp_path, state, fault):
    before = gpu_used_mib()
    raised = run_in_process(tiny_task, tmp_path, [f"{state}:{fault}"], extra=GPU_FLAGS)
    assert raised is not None
    trace = assert_clean_end(tmp_path / "run", outcome="failed",
                             error_type="ActorDiedError" if fault == "kill_trainer" else "InjectedFault",
                             ckpt=tmp_path / "ckpt")
    assert trace.of("weight_transport")[0].get("transport") == "cuda_ipc"     # the GPU path ran
    assert_gpu_left_as_it_was(trace, before)


def test_engine_killed_in_every_state_restarts_on_the_gpu_and_leaves_nothing(ray_cluster, tiny_task, tmp_path):
    before = gpu_used_mib()
    raised = run_in_process(tiny_task, tmp_path, [f"{s}:kill_engine" for s in STATES],
                            extra=[*GPU_FLAGS, "--engine-max-restarts", "10"])
    assert raised is None, raised
    trace = assert_clean_end(tmp_path / "run", outcome="ok", error_type=None, ckpt=tmp_path / "ckpt")
    assert 4 <= len(trace.of("engine_restart")) <= 6
    # every restarted engine took the weights over CUDA IPC again, checked against the trainer's
    assert all(e.get("transport") == "cuda_ipc" for e in trace.of("weights_synced"))
    assert_gpu_left_as_it_was(trace, before)
