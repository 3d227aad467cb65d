"""A local Ray cluster started by a run: on loopback, authenticated, lean, and leaving nothing behind.

- **Address.** `--ray-node-ip 127.0.0.1` (the default) makes every Ray server of the cluster
  (gcs_server, raylet, the workers' gRPC servers, the runtime-env agent) listen on loopback only:
  Ray binds to loopback when the node's address is 127.0.0.1. `ray.init` swaps 127.0.0.1 for the
  machine's routable address (`resolve_ip_for_localhost`) unless Ray runs in its local-only mode (the
  one it uses on macOS and Windows, `ray_constants.ENABLE_RAY_CLUSTER`), so that mode is on while
  `ray.init` runs. Any other address (or `auto`, Ray's choice) is Ray's multi-node setting: it listens
  on every interface.
- **Authentication.** Ray's token authentication is what stands between anyone who can reach those
  ports and code execution. Ray >= 2.60 turns it on for a new local cluster unless `RAY_AUTH_MODE` says
  otherwise; the run refuses to start a cluster with it off unless `--ray-allow-no-auth` says so.
- **Services.** No dashboard and no metrics collection. `include_dashboard=False` still starts
  Ray's dashboard process (`dashboard.py`, as the head's "API server", serving the job and state
  APIs a run never calls) and `ray.init` waits for it to come up; `no_dashboard_process` skips it.
  Ray 2.60 has no `ray.init` switch for the autoscaler monitor or the raylet's two agents (the raylet
  requires both agent commands), so those start; the reaper (`miles/cluster/reaper.py`) ends them.
- **Signals.** Ray's processes run in process groups of their own (`own_process_groups`), so a
  signal to the driver's group stops the run in order instead of killing the cluster under it.
- **Afterwards.** The reaper, a process in a session of its own, ends the cluster's stragglers when
  the driver closes its pipe or dies (`kill -9` included), moves Ray's logs into the run directory
  and deletes the session folder, always: logs that do not fit on the run directory's disk are
  reported lost, not a failure (`LocalCluster.close`).
- **Permissions.** Ray makes its temp dir, the session folder, `sockets/`, `logs/` and a dozen folders
  more 0777 on purpose (`ray._common.utils.try_make_directory_shared`, so that users share /tmp/ray),
  again each time a worker starts. So the cluster's temp dir is a fresh folder of the run's user alone
  (0700, `private_temp_dir`, inside $RAY_TMPDIR or /tmp: no other user can reach anything in it, whatever
  its mode), Ray's processes start under the run's umask (`miles.runtime.files.RUN_UMASK`), and the
  reaper takes group and world write off everything in the session folder as it appears (each second)
  and off the logs it moves into the run directory. The whole private folder goes with the session.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import ray

from miles.cluster import reaper as reaper_module
from miles.config import ConfigError
from miles.runtime.files import restricted_umask

AUTH_ENV = "RAY_AUTH_MODE"
MIN_RAY = "2.60"                                   # token authentication on by default (pyproject pins it)
SYSTEM_CONFIG = {"enable_metrics_collection": False}  # nothing reads Ray's metrics: no exporter, no traffic
REAPER = Path(__file__).with_name("reaper.py")
REAPER_EXIT_S = 10.0                               # moving the logs and deleting the folder
PRIVATE_PREFIX = "miles-ray-"                      # the cluster's private temp folder (private_temp_dir)


def auth_problem(allow_no_auth: bool) -> str | None:
    """Why a local cluster would start without token authentication (None: it would not)."""
    if allow_no_auth:
        return None
    if not _has_token_auth():
        return (f"Ray {ray.__version__} has no token authentication: anyone who can reach the local "
                f"cluster's ports could run code as you; install ray>={MIN_RAY}, or pass --ray-allow-no-auth")
    mode = os.environ.get(AUTH_ENV)
    if mode is not None and mode.lower() != "token":
        return (f"{AUTH_ENV}={mode} turns Ray's token authentication off: anyone who can reach the local "
                f"cluster's ports could run code as you; unset {AUTH_ENV} (Ray then turns it on), or pass "
                "--ray-allow-no-auth to start it anyway")
    return None


def token_auth_enabled() -> bool:
    """Whether the cluster this process is connected to authenticates with a token."""
    if not _has_token_auth():
        return False
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    return is_token_auth_enabled()


def _has_token_auth() -> bool:
    try:
        import ray._private.authentication.authentication_utils  # noqa: F401
    except ImportError:
        return False
    return True


def node_address(node_ip: str) -> str | None:
    """--ray-node-ip → `ray.init`'s `_node_ip_address` (None: Ray's choice)."""
    return None if node_ip == "auto" else node_ip


def is_loopback(node_ip: str) -> bool:
    return node_ip != "auto" and ipaddress.ip_address(node_ip).is_loopback


@contextmanager
def loopback_node(node_ip: str) -> Iterator[None]:
    """Keep a loopback node address through `ray.init` (see the module docstring)."""
    if not is_loopback(node_ip):
        yield
        return
    import ray._private.ray_constants as ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextmanager
def no_dashboard_process() -> Iterator[None]:
    """While `ray.init` starts a head node: no dashboard process (see the module docstring). A private
    hook of Ray's: a Ray without it starts the dashboard as before rather than failing the run."""
    try:
        from ray._private.node import Node
    except ImportError:
        Node = None
    saved = getattr(Node, "start_api_server", None)
    if saved is None:
        yield
        return
    Node.start_api_server = lambda self, **_: None       # the node records no dashboard URL: none runs
    try:
        yield
    finally:
        Node.start_api_server = saved


@contextmanager
def own_process_groups() -> Iterator[None]:
    """While `ray.init` starts a head node: each Ray process it starts (gcs_server, raylet, and so the
    workers the raylet forks) in a process group of its own, not the driver's. A signal to the driver's
    group (`timeout`, Slurm's `scancel`, `kill -- -PGID`, a supervisor stopping a job) then reaches the
    driver alone, whose stop tears the run down in order; in the driver's group it also killed the
    cluster under it (the actors died unasked, and the placement group's and the cluster's teardowns
    timed out: the run ended `failed` where it should end `stopped`). Ray's own guards stay: its
    processes block SIGINT and die with the driver (`PR_SET_PDEATHSIG`), and the reaper ends stragglers.
    A private hook of Ray's (`services.ConsolePopen`); a Ray without it starts them as before."""
    try:
        from ray._private import services
    except ImportError:
        services = None
    saved = getattr(services, "ConsolePopen", None)
    if saved is None or os.name != "posix":
        yield
        return

    class OwnGroupPopen(saved):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)       # setpgid(0, 0) in the child, before its exec
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = saved


class LocalCluster:
    """What a run that started its cluster owns beyond the connection: the session folder and the
    reaper that cleans it up. `close` is called after `ray.shutdown()`."""

    def __init__(self, session_dir: Path, logs_to: Path | None, reaper: subprocess.Popen):
        self.session_dir, self.logs_to, self._reaper = session_dir, logs_to, reaper

    @property
    def reaper_pid(self) -> int:
        return self._reaper.pid

    def close(self) -> dict[str, Any] | None:
        """Close the reaper's pipe and wait while it ends stragglers, keeps the logs and deletes the
        session folder. Returns what was lost on the way (Ray's logs, when the run dir's disk had no
        room for them: what, where, why, the space left), None when nothing was; raises when the
        session folder is left."""
        try:
            out, _ = self._reaper.communicate(timeout=REAPER_EXIT_S)    # closes its stdin: the driver is done
        except subprocess.TimeoutExpired:
            self._reaper.kill()
            self._reaper.communicate()
            raise RuntimeError(f"the reaper of Ray session {self.session_dir} did not finish in "
                               f"{REAPER_EXIT_S:.0f}s; the folder may be left") from None
        report = _last_json(out)
        if self.session_dir.exists() or (self._reaper.returncode != 0 and not report):
            raise RuntimeError(f"the reaper of Ray session {self.session_dir} exited {self._reaper.returncode} "
                               f"{'and left the folder' if self.session_dir.exists() else 'without a report'}; see "
                               f"{self.logs_to.parent / 'reaper.log' if self.logs_to else 'its stderr'}")
        return report.get("lost")


def _last_json(out: bytes | None) -> dict[str, Any]:
    for line in reversed((out or b"").decode(errors="replace").splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def start_local(*, num_cpus: int | None, node_ip: str, allow_no_auth: bool, log_dir: str | os.PathLike | None,
                common: dict[str, Any]) -> LocalCluster:
    """`ray.init` a local cluster as the module docstring says; raise ConfigError before starting
    anything when it would run without authentication."""
    if problem := auth_problem(allow_no_auth):
        raise ConfigError(problem)
    private = private_temp_dir()
    try:                             # Ray's processes keep the umask they start with: nothing they create is others'
        with restricted_umask(), loopback_node(node_ip), no_dashboard_process(), own_process_groups():
            ray.init(num_cpus=num_cpus, num_gpus=None, _node_ip_address=node_address(node_ip),
                     _system_config=SYSTEM_CONFIG, _temp_dir=str(private / "ray"), **common)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    node = ray._private.worker._global_node
    checks = [(not allow_no_auth and not token_auth_enabled(), "token authentication is off after ray.init"),
              (is_loopback(node_ip) and node.node_ip_address != "127.0.0.1",
               f"Ray put the node at {node.node_ip_address}, not 127.0.0.1")]
    try:
        if bad := [why for failed, why in checks if failed]:
            raise RuntimeError(f"the local Ray cluster is not what --ray-node-ip/--ray-allow-no-auth asked "
                               f"for: {'; '.join(bad)}")
        session_dir = Path(node.get_session_dir_path())
        reaper_module.no_shared_write(session_dir)     # what Ray made 0777 so far; the reaper keeps at it
        logs_to, reaper = _start_reaper(session_dir, log_dir, private)
    except BaseException:
        ray.shutdown()               # nobody else knows this cluster exists yet
        shutil.rmtree(private, ignore_errors=True)
        raise
    return LocalCluster(session_dir, logs_to, reaper)


def private_temp_dir() -> Path:
    """A fresh folder of this user's alone (0700) for the cluster's temp dir, in the one Ray would use
    ($RAY_TMPDIR or /tmp): Ray makes its temp dir, the session folder and some folders in it 0777 (see
    the module docstring), and no other user can reach them through this one."""
    from ray._common.utils import get_default_ray_temp_dir      # $RAY_TMPDIR/ray, or /tmp/ray

    return Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=os.path.dirname(get_default_ray_temp_dir())))


def _start_reaper(session_dir: Path, log_dir: str | os.PathLike | None,
                  private: Path) -> tuple[Path | None, subprocess.Popen]:
    logs_to = Path(log_dir) / "ray" if log_dir is not None else None
    spec = {"root": os.getpid(), "session_dir": str(session_dir), "logs_to": str(logs_to) if logs_to else None,
            "private_dir": str(private)}
    stderr: Any = subprocess.DEVNULL
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        stderr = open(Path(log_dir) / "reaper.log", "ab")      # the child keeps its own descriptor
    try:
        proc = subprocess.Popen([sys.executable, str(REAPER), json.dumps(spec)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    finally:
        if stderr is not subprocess.DEVNULL:
            stderr.close()
    return logs_to, proc
