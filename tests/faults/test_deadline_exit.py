"""A phase past its --phase-timeout ends the process within DEADLINE_TO_EXIT_S, as a signal does,
whatever the cut phase left hung: a reward that never returns, an engine call that never returns (the
engine SIGSTOPped, health probes off), a training step that never returns. Each run is a real
`scripts/train.py` starting its own local cluster, as a user's does; nothing of it is left after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from miles.runtime import read_trace
from tests.conftest import base_flags

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_TO_EXIT_S = 10.0
PHASE_TIMEOUT_S = 5

STUCK_RM = ("import threading\n"
            "def stuck(prompt, response, label):\n"
            "    threading.Event().wait()      # never returns\n"
            "    return 1.0\n")


def hang_flags(hang: str, tmp_path: Path) -> list[str]:
    if hang == "reward":
        (tmp_path / "stuck_rm.py").write_text(STUCK_RM)
        # --reward-timeout 0: no bound of its own, so the stuck call blocks the executor actor itself
        return ["--custom-rm-path", f"{tmp_path / 'stuck_rm.py'}:stuck", "--reward-timeout", "0",
                "--phase-timeout", f"rollout={PHASE_TIMEOUT_S}"]
    if hang == "engine":
        return ["--inject-fault", "rollout:hang_engine", "--rollout-health-check-interval", "0",
                "--phase-timeout", f"rollout={PHASE_TIMEOUT_S}"]
    return ["--inject-fault", "train:hang_trainer", "--phase-timeout", f"train={PHASE_TIMEOUT_S}"]


@pytest.mark.parametrize("hang", [
    "reward",
    pytest.param("engine", marks=pytest.mark.extended),     # one in CI; the others: bash scripts/test.sh -m extended
    pytest.param("trainer", marks=pytest.mark.extended),
])
def test_from_a_phase_deadline_to_process_exit_is_bounded_with_a_hung(hang, tiny_task, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(ROOT / "scripts/train.py"),
            *base_flags(tiny_task, run_dir, num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2,
                        rollout_max_response_len=3), *hang_flags(hang, tmp_path)]
    with open(tmp_path / "stderr.txt", "w") as err:
        driver = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        spawned: list[psutil.Process] = []
        while driver.poll() is None:                  # what the run starts, to check nothing is left
            try:
                spawned += [p for p in psutil.Process(driver.pid).children(recursive=True) if p not in spawned]
            except psutil.NoSuchProcess:
                break
            time.sleep(0.5)
        exited = time.time()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert driver.returncode == 1, stderr[-3000:]
    trace = read_trace(run_dir)
    cut = trace.of("phase_timeout")[0]
    assert (cut.get("reason"), cut.state) == ("deadline", "train" if hang == "trainer" else "rollout"), stderr[-3000:]
    deadline_to_exit = exited - datetime.fromisoformat(cut.ts).timestamp()
    assert deadline_to_exit <= DEADLINE_TO_EXIT_S, (deadline_to_exit, stderr[-3000:])
    assert f"ran past its {PHASE_TIMEOUT_S} s deadline" in stderr
    end = trace.events[-1]
    ended_in_loop = end.event == "run_end"            # else the CLI's backstop ended it (said on stderr)
    assert ended_in_loop or "exiting now" in stderr
    time.sleep(1.0)                                   # the reaper's last kills land
    assert [p.name() for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    forced = [e.get("resource") for e in trace.of("disposed") if e.get("outcome") == "forced"]
    print(json.dumps({"case": f"deadline_hung_{hang}", "deadline_to_exit_s": round(deadline_to_exit, 2),
                      "ended_in_loop": ended_in_loop, "forced": forced}))
