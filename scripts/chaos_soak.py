"""Chaos soak: the arithmetic demo on the CPU under a fault every 20-60 s, resumed after every stop.

    python scripts/chaos_soak.py --minutes 15 [--out runs/chaos] [--seed 0]

Each round is one demo run (examples/arithmetic/grpo.yaml, a checkpoint after every rollout) driven
by a loop: `scripts/train.py` runs as a user runs it (its own local Ray cluster), and whenever it
stops (a fault failed it, a SIGTERM stopped it) the loop starts it again with `--load` on the same
folder and the same `--run-dir` (a new trace segment). While the fault window (--minutes) lasts, a
fault comes every 20-60 s, chosen at random among:

    kill_engine      SIGKILL the engine's worker (the run restarts it, within its budget)
    kill_trainer     SIGKILL the trainer's worker (the run fails; the loop resumes it)
    stop_engine      SIGSTOP the engine for longer than the health timeout (the probe restarts it)
    sigterm_driver   SIGTERM the driver (it drains, saves and exits 143; the loop resumes it)
    corrupt_newest   flip a byte of the newest checkpoint's weights, then SIGTERM the driver: the
                     resume skips it (one console line) and loads the one before
    enospc_save      fill the --save disk (a tmpfs the soak mounts) until one save fails; the run goes
                     on (--save-retries), then the space comes back (root only: else left out, said why)

A round that ends before the window does is followed by another. After the window the last round
runs to its end without faults. Each round must then: have trained its last rollout, raise greedy
eval accuracy by at least --min-gain (the demo's bar: 15 points), pass `miles trace check` on every
segment, and leave no process of any segment behind. The report (JSON, on stdout and in
<out>/report.json) counts the rollouts lost to faults: rollouts generated more than once (their
samples, and their training if it was done, thrown away by a fault). Exit 0 when every round holds,
1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.checkpoint.store import CheckpointStore  # noqa: E402
from miles.runtime.trace import read_trace, segment_paths  # noqa: E402

FAULTS = ("kill_engine", "kill_trainer", "stop_engine", "sigterm_driver", "corrupt_newest", "enospc_save")
HEALTH = {"interval": 5, "timeout": 10}       # engine probes: a stopped engine is found within ~15 s
STOP_EXTRA_S = 5                               # SIGSTOP lasts the health timeout and this much more
SAVE_DISK_MB = 512                             # the tmpfs under --save (the demo's checkpoints are ~20 MB)
MAX_SEGMENTS = 60                              # per round: a loop that never finishes is a failure
LINGER_S = 20.0                                # what a segment started may take to be gone after it


@dataclass
class Fault:
    t: float                # seconds since the soak started
    kind: str
    round: int
    segment: int
    detail: str = ""


@dataclass
class Segment:
    index: int
    exit_code: int
    seconds: float
    log: str


@dataclass
class Round:
    index: int
    run_dir: str
    segments: list[Segment] = field(default_factory=list)
    checks: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args, self.rng = args, random.Random(args.seed)
        self.out = Path(args.out).absolute()
        self.t0 = time.monotonic()
        self.window_end = self.t0 + 60 * args.minutes
        self.faults: list[Fault] = []
        self.rounds: list[Round] = []
        self.seen: dict[int, float] = {}           # pid -> create_time of every process a segment started
        self.disk: Path | None = None
        self.disk_why = ""
        self.run_dir = self.out               # the round being hit
        self.bag: list[str] = []                # the faults still to come in this cycle

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.disk, self.disk_why = mount_save_disk(self.out / "save-disk")
        try:
            while not self.rounds or time.monotonic() < self.window_end:
                self.rounds.append(self.one_round(len(self.rounds)))
                if self.rounds[-1].problems and not self.rounds[-1].checks.get("last_rollout"):
                    break                          # a round that could not finish: no point in another
        finally:
            if self.disk is not None:
                subprocess.run(["umount", "-l", str(self.disk)], check=False)
        return self.report()

    def one_round(self, index: int) -> Round:
        rnd = Round(index, str(self.out / f"round-{index}" / "run"))
        ckpt = self.disk / f"round-{index}" if self.disk else self.out / f"round-{index}" / "ckpt"
        next_fault = time.monotonic() + self.rng.uniform(*self.args.fault_every)
        while len(rnd.segments) < MAX_SEGMENTS:
            seg, next_fault = self.one_segment(rnd, ckpt, next_fault)
            rnd.segments.append(seg)
            if seg.exit_code == 0:
                break
            if seg.exit_code == 2:
                rnd.problems.append(f"segment {seg.index} exited 2 (bad input): see {seg.log}")
                break
        self.check_round(rnd, ckpt)
        return rnd

    def one_segment(self, rnd: Round, ckpt: Path, next_fault: float) -> tuple[Segment, float]:
        index = len(rnd.segments)
        log = Path(rnd.run_dir).parent / f"segment-{index}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(log, "w") as out:
            driver = subprocess.Popen(self.argv(rnd, ckpt), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
            while driver.poll() is None:
                self.note_processes(driver.pid)
                if time.monotonic() >= next_fault and time.monotonic() < self.window_end:
                    if self.inject(rnd, index, driver, ckpt):
                        next_fault = time.monotonic() + self.rng.uniform(*self.args.fault_every)
                    else:
                        next_fault = time.monotonic() + 2.0      # nothing to hit yet (still starting)
                time.sleep(0.5)
        return Segment(index, driver.returncode, round(time.monotonic() - t0, 1), str(log)), next_fault

    def argv(self, rnd: Round, ckpt: Path) -> list[str]:
        a = self.args
        return [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "examples/arithmetic/grpo.yaml"),
                "--run-dir", rnd.run_dir, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
                "--keep-last-checkpoints", "3", "--save-retries", "1000", "--num-rollout", str(a.num_rollout),
                "--rollout-health-check-interval", str(HEALTH["interval"]),
                "--rollout-health-check-timeout", str(HEALTH["timeout"]), "--progress", "plain"]

    # -- faults ----------------------------------------------------------------------------------
    def inject(self, rnd: Round, segment: int, driver: subprocess.Popen, ckpt: Path) -> bool:
        """One fault now; False when the run has nothing to hit yet (its actors are not up)."""
        pids = actor_pids(Path(rnd.run_dir))
        if not pids:
            return False
        kind = self.next_kind(ckpt)
        self.run_dir = Path(rnd.run_dir)
        detail = getattr(self, f"_{kind}")(driver, pids, ckpt)
        self.faults.append(Fault(round(time.monotonic() - self.t0, 1), kind, rnd.index, segment, detail))
        print(f"chaos: t={self.faults[-1].t:.0f}s round {rnd.index} segment {segment}: {kind} {detail}",
              file=sys.stderr, flush=True)
        return True

    def next_kind(self, ckpt: Path) -> str:
        """The next fault: every kind once in a random order, then again (a short soak meets each)."""
        if not self.bag:
            self.bag = [k for k in FAULTS if k != "enospc_save" or self.disk is not None]
            self.rng.shuffle(self.bag)
        usable = [k for k in self.bag if k != "corrupt_newest" or len(CheckpointStore(ckpt).list()) >= 2]
        kind = usable[0] if usable else "sigterm_driver"     # a corrupt newest needs an older one to load
        if kind in self.bag:
            self.bag.remove(kind)
        return kind

    def _kill_engine(self, driver, pids, ckpt) -> str:
        return signal_pid(pids.get("engine"), signal.SIGKILL)

    def _kill_trainer(self, driver, pids, ckpt) -> str:
        return signal_pid(pids.get("trainer"), signal.SIGKILL)

    def _stop_engine(self, driver, pids, ckpt) -> str:
        pid = pids.get("engine")
        said = signal_pid(pid, signal.SIGSTOP)
        until = time.monotonic() + HEALTH["timeout"] + STOP_EXTRA_S
        while time.monotonic() < until and driver.poll() is None:
            self.note_processes(driver.pid)                 # the engine the run starts in its place
            time.sleep(0.5)
        signal_pid(pid, signal.SIGCONT)                     # if the run has not killed it by now
        return f"{said} for {HEALTH['timeout'] + STOP_EXTRA_S} s"

    def _sigterm_driver(self, driver, pids, ckpt) -> str:
        driver.send_signal(signal.SIGTERM)
        return f"driver pid {driver.pid}"

    def _corrupt_newest(self, driver, pids, ckpt) -> str:
        rid, path = CheckpointStore(ckpt).list()[-1]
        weights = path / "trainer" / "model.safetensors"
        try:
            data = bytearray(weights.read_bytes())
            data[-5] ^= 0x01                                # same size: only the sha256 check finds it
            weights.write_bytes(bytes(data))
        except OSError as exc:                              # pruned meanwhile (--keep-last-checkpoints)
            return f"{path.name} went while it was corrupted ({exc}); nothing done"
        driver.send_signal(signal.SIGTERM)
        return f"{path.name}, then SIGTERM to the driver"

    def _enospc_save(self, driver, pids, ckpt) -> str:
        filler = self.disk / "filler"
        free = shutil.disk_usage(self.disk).free
        subprocess.run(["fallocate", "-l", str(max(free - (1 << 20), 0)), str(filler)], check=False)
        failed, t0 = None, time.monotonic()
        while driver.poll() is None and time.monotonic() - t0 < 60:
            if (failed := last_event(self.run_dir, "checkpoint_failed")) is not None:
                break
            time.sleep(0.5)
        filler.unlink(missing_ok=True)
        return f"disk filled ({free >> 20} MiB); " + (f"save of rollout {failed.rollout_id} failed, the run went on"
                                                      if failed is not None else "no save failed within 60 s")

    # -- bookkeeping -----------------------------------------------------------------------------
    def note_processes(self, pid: int) -> None:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                self.seen.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass

    def check_round(self, rnd: Round, ckpt: Path) -> None:
        run_dir = Path(rnd.run_dir)
        segments = segment_paths(run_dir)
        checks = {"segments": len(segments), "trace_check": [trace_check(p) for p in segments]}
        traces = [read_trace(p) for p in segments]
        trained = [e.rollout_id for t in traces for e in t.of("metrics")]
        generated = [e.rollout_id for t in traces for e in t.of("rollout_done")]
        checks["last_rollout"] = (self.args.num_rollout - 1) in trained
        checks["rollouts_trained"] = len(trained)
        # lost to faults: rollouts generated again (their first samples, or their training, thrown away)
        checks["rollouts_lost"] = len(generated) - len(set(generated))
        checks["rollouts_retrained"] = len(trained) - len(set(trained))
        checks["eval"] = eval_gain(run_dir, self.args.num_rollout)
        rnd.checks = checks
        if not checks["last_rollout"]:
            rnd.problems.append(f"the run never trained rollout {self.args.num_rollout - 1}")
        if not all(ok for _, ok in checks["trace_check"]):
            rnd.problems.append("miles trace check fails on a segment: "
                                + ", ".join(p for p, ok in checks["trace_check"] if not ok))
        gain = checks["eval"].get("gain")
        if gain is None or gain < self.args.min_gain:
            rnd.problems.append(f"greedy accuracy gain {gain} is below {self.args.min_gain}: {checks['eval']}")

    def left_behind(self) -> list[str]:
        deadline = time.monotonic() + LINGER_S
        while True:
            alive = []
            for pid, created in self.seen.items():
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{p.name()} pid {pid}")
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(1.0)

    def report(self) -> dict:
        left = self.left_behind()
        ok = not left and all(not r.problems for r in self.rounds)
        return {"ok": ok, "minutes": self.args.minutes, "seed": self.args.seed,
                "wall_s": round(time.monotonic() - self.t0, 1), "faults_injected": len(self.faults),
                "faults_by_kind": {k: sum(f.kind == k for f in self.faults) for k in FAULTS},
                "enospc": "on" if self.disk is not None else f"left out: {self.disk_why}",
                "rollouts_lost": sum(r.checks.get("rollouts_lost", 0) for r in self.rounds),
                "segments": sum(len(r.segments) for r in self.rounds), "processes_left": left,
                "rounds": [asdict(r) for r in self.rounds], "faults": [asdict(f) for f in self.faults]}


def mount_save_disk(path: Path) -> tuple[Path | None, str]:
    """A tmpfs for --save, so that a save can meet a full disk; (None, why) when it cannot be had."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None, "mounting a tmpfs needs root"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SAVE_DISK_MB}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"mount failed: {proc.stderr.strip()}"
    return path, ""


def actor_pids(run_dir: Path) -> dict[str, int]:
    """The current segment's engine and trainer pids ({} before its actors are up)."""
    segments = segment_paths(run_dir)
    if not segments:
        return {}
    trace = read_trace(segments[-1])
    ready = trace.of("components_ready")
    if not ready or trace.of("run_end") or trace.of("unwind_start"):
        return {}
    pids = ready[0].get("pids") or {}
    out = {"engine": pids.get("engine-0"), "trainer": pids.get("trainer")}
    for e in trace.of("engine_restarted"):
        out["engine"] = next(iter((e.get("pids") or {}).values()), out["engine"])
    return {k: v for k, v in out.items() if v}


def last_event(run_dir: Path, kind: str):
    segments = segment_paths(run_dir)
    found = read_trace(segments[-1]).of(kind) if segments else []
    return found[-1] if found else None


def signal_pid(pid: int | None, sig: int) -> str:
    if pid is None:
        return "(no such actor)"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"pid {pid} (gone already)"
    return f"pid {pid}"


def trace_check(path: Path) -> tuple[str, bool]:
    proc = subprocess.run([sys.executable, "-m", "miles.cli", "trace", "check", str(path), "--format", "plain"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(path), proc.returncode == 0


def eval_gain(run_dir: Path, num_rollout: int) -> dict:
    """Greedy accuracy before training (the first eval at step 0) and after the last rollout."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    evals = [r for r in rows if r.get("kind") == "eval"]
    before = next((r["eval/arith/pass@1"] for r in evals if r["step"] == 0), None)
    after = next((r["eval/arith/pass@1"] for r in reversed(evals) if r["step"] == num_rollout), None)
    gain = round(after - before, 4) if before is not None and after is not None else None
    return {"before": before, "after": after, "gain": gain}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0, help="how long faults come (default 15)")
    p.add_argument("--out", default=f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}", help="where rounds and report go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-every", type=float, nargs=2, default=(20.0, 60.0), metavar=("MIN_S", "MAX_S"))
    p.add_argument("--num-rollout", type=int, default=40, help="rollouts per round (the demo's 40)")
    p.add_argument("--min-gain", type=float, default=0.15, help="greedy accuracy a round must gain (default 0.15)")
    args = p.parse_args(argv)
    report = Soak(args).run()
    text = json.dumps(report, indent=2)
    (Path(args.out) / "report.json").write_text(text)
    summary = {k: report[k] for k in ("ok", "wall_s", "faults_injected", "faults_by_kind", "rollouts_lost",
                                      "segments", "processes_left", "enospc")}
    print(json.dumps(summary))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
