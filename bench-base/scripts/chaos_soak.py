"""Chaos soak: the arithmetic demo on the CPU under a schedule of faults, resumed after every stop.

    python scripts/chaos_soak.py --minutes 15 [--out runs/chaos] [--seed 0] [--min-each 2]

Each round is one demo run (examples/arithmetic/grpo.yaml, a checkpoint after every rollout) driven
by a loop: `scripts/train.py` runs as a user runs it (its own local Ray cluster), and whenever it
stops (a fault failed it, a SIGTERM stopped it) the loop starts it again with `--load` on the same
folder and the same `--run-dir` (a new trace segment). While the fault window (--minutes) lasts,
faults come from a schedule (`Schedule`): every kind once in a shuffled cycle, then the next cycle;
one fault --fault-every 15-30 s after the one before, on one clock for the whole soak (not redrawn
per round or segment), as soon as the run can be hit (its actors up). The kinds:

    kill_engine      SIGKILL the engine's worker (the run restarts it, within its budget)
    kill_trainer     SIGKILL the trainer's worker (the run fails; the loop resumes it)
    stop_engine      SIGSTOP the engine for longer than the health timeout (the probe restarts it)
    sigterm_driver   SIGTERM the driver (it drains, saves and exits 143; the loop resumes it)
    corrupt_newest   SIGTERM the driver, then (once it has exited) flip a byte of the newest
                     checkpoint's weights: the resume skips it (one console line) and loads the one before
    enospc_save      fill the --save disk (a tmpfs the soak mounts) until one save fails; the run goes
                     on (--save-retries), then the space comes back (root only: else left out, said
                     why, and the soak is not ok)

A fault counts only when it took effect (a signal reached a live process, a byte was flipped in a
checkpoint that was still there, a save met the full disk); one that did not is reported under
`faults_missed` and its kind stays due. Any soak of MIN_MINUTES (6) minutes or more meets every kind
at least once with the defaults on the 2-core VM: a cycle is six faults at most 30 s apart, three of
which end a segment (a restart takes ~40-60 s there). Whatever the length, a kind that has not run
--min-each times when the window ends keeps the window open (--max-extra-minutes, default 10); a kind
still short after that makes the report `ok: false` (`kinds_missing`).

A round that ends before the window does is followed by another. After the window the last round
runs to its end without faults. Each round must then: have trained its last rollout, raise greedy
eval accuracy by at least --min-gain (the demo's bar: 15 points), pass `miles trace check` on every
segment, pass over (sha256) each checkpoint the soak corrupted, and leave no process of any segment
behind. The report (JSON, on stdout and in
<out>/report.json) counts the rollouts lost to faults: rollouts generated more than once (their
samples, and their training if it was done, thrown away by a fault). Exit 0 when every round holds,
1 otherwise (also when a kind is missing).
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
from typing import Callable

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
MIN_MINUTES = 6                                # a soak this long meets every kind (defaults, 2-core VM)
RETRY_S = 2.0                                  # a due fault that cannot be injected yet is tried again after this


@dataclass
class Fault:
    t: float                # seconds since the soak started
    kind: str
    round: int
    segment: int
    detail: str = ""
    hit: bool = True        # it took effect (a live process signalled, a file corrupted, a save failed)


class Schedule:
    """Which fault comes next, and when. Every kind once in a shuffled cycle, then another cycle; the
    next fault is due `every` (a random gap in [min, max] s) after the previous one, on one clock for the
    whole soak. A kind whose fault did not take effect stays in its cycle and is tried again."""

    def __init__(self, kinds: tuple[str, ...], rng: random.Random, every: tuple[float, float], min_each: int,
                 now: float):
        self.kinds, self.rng, self.every, self.min_each = kinds, rng, every, min_each
        self.bag: list[str] = []
        self.hits = {k: 0 for k in kinds}
        self.due_at = now + rng.uniform(*every)

    def due(self, now: float) -> bool:
        return now >= self.due_at

    def pick(self, usable: Callable[[str], bool]) -> str | None:
        """The next kind of the cycle that can be injected now (None: none yet, try again soon)."""
        if not self.bag:
            self.bag = list(self.kinds)
            self.rng.shuffle(self.bag)
        return next((k for k in self.bag if usable(k)), None)

    def injected(self, kind: str, hit: bool, now: float) -> None:
        """A fault of `kind` was tried: one that took effect leaves the cycle and arms the next gap."""
        if not hit:
            return self.retry(now)
        if kind in self.bag:
            self.bag.remove(kind)
        self.hits[kind] += 1
        self.due_at = now + self.rng.uniform(*self.every)

    def retry(self, now: float) -> None:
        """Nothing could be hit (the run starting, no older checkpoint, a fault without effect): soon again."""
        self.due_at = now + RETRY_S

    def missing(self) -> dict[str, int]:
        """Kinds that have not run --min-each times yet: how many more each needs."""
        return {k: self.min_each - n for k, n in self.hits.items() if n < self.min_each}


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
        self.extra_end = self.window_end + 60 * args.max_extra_minutes
        self.faults: list[Fault] = []
        self.rounds: list[Round] = []
        self.seen: dict[int, float] = {}           # pid -> create_time of every process a segment started
        self.disk: Path | None = None
        self.disk_why = ""
        self.run_dir = self.out               # the round being hit
        self.schedule: Schedule | None = None   # made once the save disk is known (enospc needs it)

    def in_window(self) -> bool:
        """Faults still come: within --minutes, or past it while a kind is short of --min-each."""
        now = time.monotonic()
        return now < self.window_end or (now < self.extra_end and bool(self.schedule and self.schedule.missing()))

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.disk, self.disk_why = mount_save_disk(self.out / "save-disk")
        kinds = tuple(k for k in FAULTS if k != "enospc_save" or self.disk is not None)
        self.schedule = Schedule(kinds, self.rng, tuple(self.args.fault_every), self.args.min_each, time.monotonic())
        try:
            while not self.rounds or self.in_window():
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
        while len(rnd.segments) < MAX_SEGMENTS:
            seg = self.one_segment(rnd, ckpt)
            rnd.segments.append(seg)
            if seg.exit_code == 0:
                break
            if seg.exit_code == 2:
                rnd.problems.append(f"segment {seg.index} exited 2 (bad input): see {seg.log}")
                break
        self.check_round(rnd, ckpt)
        return rnd

    def one_segment(self, rnd: Round, ckpt: Path) -> Segment:
        index = len(rnd.segments)
        log = Path(rnd.run_dir).parent / f"segment-{index}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(log, "w") as out:
            driver = subprocess.Popen(self.argv(rnd, ckpt), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
            while driver.poll() is None:
                self.note_processes(driver.pid)
                if self.schedule.due(time.monotonic()) and self.in_window():
                    self.inject(rnd, index, driver, ckpt)
                time.sleep(0.5)
        return Segment(index, driver.returncode, round(time.monotonic() - t0, 1), str(log))

    def argv(self, rnd: Round, ckpt: Path) -> list[str]:
        a = self.args
        return [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "examples/arithmetic/grpo.yaml"),
                "--run-dir", rnd.run_dir, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
                "--keep-last-checkpoints", "3", "--save-retries", "1000", "--num-rollout", str(a.num_rollout),
                "--rollout-health-check-interval", str(HEALTH["interval"]),
                "--rollout-health-check-timeout", str(HEALTH["timeout"]), "--progress", "plain"]

    # -- faults ----------------------------------------------------------------------------------
    def inject(self, rnd: Round, segment: int, driver: subprocess.Popen, ckpt: Path) -> None:
        """The schedule's next fault now, if the run can be hit (its actors are up); else soon."""
        pids = actor_pids(Path(rnd.run_dir))
        kind = self.schedule.pick(lambda k: usable(k, pids, ckpt)) if pids else None
        if kind is None:                                 # nothing to hit yet (still starting, no checkpoint)
            self.schedule.retry(time.monotonic())
            return
        self.run_dir = Path(rnd.run_dir)
        detail, hit = getattr(self, f"_{kind}")(driver, pids, ckpt)
        self.schedule.injected(kind, hit, time.monotonic())
        self.faults.append(Fault(round(time.monotonic() - self.t0, 1), kind, rnd.index, segment, detail, hit))
        print(f"chaos: t={self.faults[-1].t:.0f}s round {rnd.index} segment {segment}: {kind} {detail}"
              f"{'' if hit else ' (no effect: tried again)'}", file=sys.stderr, flush=True)

    def _kill_engine(self, driver, pids, ckpt) -> tuple[str, bool]:
        return signal_pid(pids.get("engine"), signal.SIGKILL)

    def _kill_trainer(self, driver, pids, ckpt) -> tuple[str, bool]:
        return signal_pid(pids.get("trainer"), signal.SIGKILL)

    def _stop_engine(self, driver, pids, ckpt) -> tuple[str, bool]:
        pid = pids.get("engine")
        said, hit = signal_pid(pid, signal.SIGSTOP)
        until = time.monotonic() + HEALTH["timeout"] + STOP_EXTRA_S
        while hit and time.monotonic() < until and driver.poll() is None:
            self.note_processes(driver.pid)                 # the engine the run starts in its place
            time.sleep(0.5)
        signal_pid(pid, signal.SIGCONT)                     # if the run has not killed it by now
        return f"{said} for {HEALTH['timeout'] + STOP_EXTRA_S} s", hit

    def _sigterm_driver(self, driver, pids, ckpt) -> tuple[str, bool]:
        if driver.poll() is not None:
            return f"driver pid {driver.pid} (exited already)", False
        driver.send_signal(signal.SIGTERM)
        return f"driver pid {driver.pid}", True

    def _corrupt_newest(self, driver, pids, ckpt) -> tuple[str, bool]:
        """SIGTERM the driver, and once it has exited (its stop's save written) flip a byte of the newest
        checkpoint: the resume that follows meets it first, skips it and loads the one before."""
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return f"driver pid {driver.pid} still running 60 s after SIGTERM; nothing corrupted", False
        found = CheckpointStore(ckpt).list()
        if len(found) < 2:
            return "SIGTERM to the driver; fewer than 2 checkpoints after it, nothing corrupted", False
        rid, path = found[-1]
        weights = path / "trainer" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x01                                    # same size: only the sha256 check finds it
        weights.write_bytes(bytes(data))
        return f"SIGTERM to the driver, then {path.name} corrupted once it had exited", True

    def _enospc_save(self, driver, pids, ckpt) -> tuple[str, bool]:
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
                                                      if failed is not None else "no save failed within 60 s"), \
            failed is not None

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
        # each checkpoint corrupted in this round was met by the resume after it and passed over
        corrupted = sum(f.kind == "corrupt_newest" and f.hit and f.round == rnd.index for f in self.faults)
        checks["checkpoints_skipped"] = sum(e.get("check") == "sha256" for t in traces for e in t.of("checkpoint_skipped"))
        if checks["checkpoints_skipped"] < corrupted:
            rnd.problems.append(f"{corrupted} checkpoints corrupted, {checks['checkpoints_skipped']} passed over by "
                                "their sha256 on resume")
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
        missing = self.schedule.missing() if self.schedule else {}
        if self.disk is None and self.args.min_each > 0:
            missing["enospc_save"] = self.args.min_each       # left out is not run: said, and not ok
        ok = not left and not missing and all(not r.problems for r in self.rounds)
        hits = [f for f in self.faults if f.hit]
        return {"ok": ok, "minutes": self.args.minutes, "seed": self.args.seed, "min_each": self.args.min_each,
                "wall_s": round(time.monotonic() - self.t0, 1), "faults_injected": len(hits),
                "faults_by_kind": {k: sum(f.kind == k for f in hits) for k in FAULTS},
                "faults_missed": len(self.faults) - len(hits), "kinds_missing": missing,
                "faults_past_window": sum(f.t > 60 * self.args.minutes for f in hits),
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


def usable(kind: str, pids: dict[str, int], ckpt: Path) -> bool:
    """Whether `kind` can hit the run now: its target is up; a corrupt newest needs an older one to load."""
    if kind in ("kill_engine", "stop_engine"):
        return "engine" in pids
    if kind == "kill_trainer":
        return "trainer" in pids
    if kind == "corrupt_newest":
        return len(CheckpointStore(ckpt).list()) >= 2
    return True


def signal_pid(pid: int | None, sig: int) -> tuple[str, bool]:
    if pid is None:
        return "(no such actor)", False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"pid {pid} (gone already)", False
    return f"pid {pid}", True


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
    p.add_argument("--minutes", type=float, default=15.0,
                   help=f"how long faults come (default 15); {MIN_MINUTES} or more meets every fault kind at least "
                        "once with the default --fault-every on the 2-core VM")
    p.add_argument("--out", default=f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}", help="where rounds and report go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-every", type=float, nargs=2, default=(15.0, 30.0), metavar=("MIN_S", "MAX_S"),
                   help="seconds from one fault to the next, drawn in this range (default 15 30)")
    p.add_argument("--min-each", type=int, default=1,
                   help="times each fault kind must run: the window stays open until it has (default 1); "
                        "a kind short of it makes the report ok: false")
    p.add_argument("--max-extra-minutes", type=float, default=10.0,
                   help="how long past --minutes the window may stay open for a kind still short (default 10)")
    p.add_argument("--num-rollout", type=int, default=40, help="rollouts per round (the demo's 40)")
    p.add_argument("--min-gain", type=float, default=0.15, help="greedy accuracy a round must gain (default 0.15)")
    args = p.parse_args(argv)
    report = Soak(args).run()
    text = json.dumps(report, indent=2)
    (Path(args.out) / "report.json").write_text(text)
    summary = {k: report[k] for k in ("ok", "wall_s", "faults_injected", "faults_by_kind", "kinds_missing",
                                      "faults_missed", "faults_past_window", "rollouts_lost", "segments",
                                      "processes_left", "enospc")}
    print(json.dumps(summary))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
