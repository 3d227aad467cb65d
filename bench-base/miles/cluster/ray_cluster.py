"""Ray for one run: start a local cluster or attach to one; create the run's actors; remove them.

A run that started its cluster shuts it down last; that cluster listens on loopback, authenticates,
and leaves no session folder behind (`miles/cluster/local.py`). A run attached to a cluster (`--ray-address`, or
a host that already called `ray.init`) removes only its own actors, which live in the run's own
namespace, and leaves everything else alone. Attaching through `--ray-address`, the run ships miles and
the user's files as the job's runtime_env (`miles/cluster/shipping.py`); `--ray-actor-resources` puts
every actor on the nodes that have those resources.

Actors are owner-bound (not detached): if the driver dies, Ray reaps them; with
`RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper` set before the cluster starts, the
raylet also kills what their workers spawned.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import ray

from miles.cluster.local import LocalCluster, start_local, token_auth_enabled
from miles.config import ClusterConfig
from miles.user_code import DRIVER_CWD_ENV

if TYPE_CHECKING:
    from miles.cluster.shipping import Shipment

SUBREAPER_ENV = "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper"


class RayCluster:
    resource_name = "ray_cluster"

    def __init__(self, cfg: ClusterConfig, run_id: str, *, log_dir: str | os.PathLike | None = None,
                 log_level: str = "info", node_ip: str = "127.0.0.1", allow_no_auth: bool = False,
                 shipment: Shipment | None = None, on_lost: Callable[[dict[str, Any]], Any] | None = None):
        self.run_id = run_id
        self.on_lost = on_lost        # told what stopping a local cluster lost (Ray's logs on a full disk)
        # with a log_dir, actors log into it: absolute, an actor's working directory is not the driver's
        self.log_dir, self.log_level = (Path(log_dir).absolute() if log_dir is not None else None), log_level
        self.namespace = cfg.namespace or f"miles-{run_id}"
        self.actor_resources = dict(cfg.actor_resources or {})
        self.started = False          # we started a local cluster: we stop it
        self.connected = False        # we opened the connection: we close it
        self.shipment: Shipment | None = None    # what the job's runtime_env sends to the nodes
        self.local: LocalCluster | None = None   # a started cluster's session folder and reaper (local.py)
        if ray.is_initialized():
            return                    # a host's connection: attach, own nothing but our actors
        os.environ.setdefault(SUBREAPER_ENV, "true")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        for quiet in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
            os.environ.setdefault(quiet, "1")      # workers inherit these: no progress bars in the log
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # workers import what the driver can import (e.g. a --custom-rm-path module in the cwd)
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([os.getcwd(), *sys.path[1:]]))
        common = dict(namespace=self.namespace, logging_level="WARNING", log_to_driver=True,
                      configure_logging=True, include_dashboard=False)
        quiet_token_auth_notice()
        with keep_signal_handlers():      # ray.init installs its own SIGTERM handler (sys.exit)
            if cfg.ray_address:       # with a shipment, every actor of the job gets miles and the user's files
                env = {"runtime_env": shipment.runtime_env()} if shipment is not None else {}
                ray.init(address=cfg.ray_address, **env, **common)
                self.shipment = shipment
            else:   # on loopback, authenticated, with a reaper (miles/cluster/local.py)
                self.local = start_local(num_cpus=cfg.num_cpus or os.cpu_count(), node_ip=node_ip,
                                         allow_no_auth=allow_no_auth, log_dir=log_dir, common=common)
                self.started = True
        self.connected = True
        restore_sigchld()

    def actor(self, cls: type, *args: Any, name: str, num_cpus: float = 0, num_gpus: float = 0,
              concurrency: int | None = None, concurrency_groups: Mapping[str, int] | None = None,
              placement: dict[str, Any] | None = None, needs: Mapping[str, str] | None = None,
              env_vars: Mapping[str, str] | None = None, **kwargs: Any) -> "ActorResource":
        """Start `cls` as a named, owner-bound actor in the run's namespace; with a log_dir, its
        structlog lines go to `<log_dir>/<name>.jsonl` with the run's context (miles.tracking.logs).
        `placement`: the GPUs it asks for and where (PlacementGroupResource.options; its `resources`, if
        any, already hold --ray-actor-resources). `needs`: flag → a path on the driver's disk the actor
        reads (a model folder), which must exist at that path on the actor's node too. `concurrency_groups`:
        name -> threads, groups of its own a call can be sent to (`handle.m.options(concurrency_group=name)`)
        to run beside the actor's other calls. `env_vars`: the environment its worker process starts with
        (Ray's runtime_env, merged over the job's; the actors it creates inherit it): --train-env-vars."""
        options: dict[str, Any] = dict(name=name, namespace=self.namespace, num_cpus=num_cpus, num_gpus=num_gpus,
                                       max_restarts=0, lifetime="non_detached")
        if self.actor_resources:
            options["resources"] = dict(self.actor_resources)
        options.update(placement or {})
        if concurrency is not None:
            options["max_concurrency"] = concurrency
        if env_vars:    # a fresh worker started with them (not one Ray already started): slower, so only when set
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        local = {flag: path for flag, path in (needs or {}).items() if os.path.exists(path)}   # not a hub name
        if local:
            cls = checking_paths(cls, local, name)
        if self.shipment is None:     # user files given by a relative path (reward.py:fn) are the driver's
            cls = in_driver_cwd(cls, os.getcwd())
        if self.log_dir is not None:
            from miles.tracking.logs import context_for_actor, logged_actor_class
            cls = logged_actor_class(cls, context_for_actor(name, run_id=self.run_id, log_dir=self.log_dir,
                                                            level=self.log_level))
        remote = ray.remote(concurrency_groups=dict(concurrency_groups)) if concurrency_groups else ray.remote
        handle = remote(cls).options(**options).remote(*args, **kwargs)
        return ActorResource(handle, name)

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes: id, address, resources (the trace's `cluster_ready` lists them)."""
        return [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": n.get("Resources", {})}
                for n in ray.nodes() if n.get("Alive")]

    def token_auth(self) -> bool:
        """Whether the cluster authenticates its clients with a token (Ray >= 2.60)."""
        return token_auth_enabled()

    def alive_actors(self) -> list[str]:
        """Names of this run's live named actors (what a leak check looks at)."""
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a.get("namespace") == self.namespace)

    def dispose(self) -> None:
        """Close what this run opened: stop the local cluster it started, or drop its connection.
        A cluster this run started but other runs in this process still use is left to them (Ray
        stops it when the process exits)."""
        if not self.connected:
            return
        if self.started and self.other_runs():
            return                    # the reaper goes when this process does
        ray.shutdown()
        if self.local is not None:    # stragglers ended, logs kept in the run dir, session folder deleted
            lost = self.local.close()
            if lost is not None and self.on_lost is not None:
                self.on_lost(lost)

    def other_runs(self) -> list[str]:
        return sorted({a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a.get("namespace", "").startswith("miles-") and a["namespace"] != self.namespace})


class ActorResource:
    """One actor of the run: `dispose` asks it to free what it holds, then removes it."""

    def __init__(self, handle: Any, name: str):
        self.handle, self.resource_name = handle, name
        self.pid: int | None = None          # the worker process, once ready (for traces and leak checks)
        self.node_id: str | None = None      # the Ray node it runs on, once ready

    async def dispose(self) -> None:
        """The actor releases its own resources (processes, files); then the run removes the actor."""
        try:
            await self.handle.dispose.remote()
        except ray.exceptions.RayActorError:
            pass                      # already dead: nothing left to release
        finally:
            self.force()

    def force(self) -> None:
        ray.kill(self.handle, no_restart=True)

    async def wait_ready(self) -> int:
        """Wait for the constructor (its exception, a bad model path say, surfaces here); return the
        actor's worker pid (and keep the node it runs on)."""
        self.pid, self.node_id = await self.handle.__ray_call__.remote(_where)
        return self.pid


def _where(_actor: Any) -> tuple[int, str]:
    return os.getpid(), ray.get_runtime_context().get_node_id()


def driver_path(path: str) -> str:
    """A path the driver hands to an actor: absolute when it exists here (relative, it means the driver's
    working directory, which no actor shares), else as given (a hub model name, say)."""
    return os.path.abspath(path) if os.path.exists(path) else path


def checking_paths(cls: type, paths: Mapping[str, str], name: str) -> type:
    """`cls` whose constructor first checks that every path of `paths` (flag → path) exists on the
    node the actor runs on: a model folder missing from one node of a cluster is named, with the node,
    instead of surfacing as a hub lookup of a local path."""

    class NodeChecked(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            missing = [f"{flag} {path}" for flag, path in paths.items() if not os.path.exists(path)]
            if missing:
                node = ray.util.get_node_ip_address() if ray.is_initialized() else "this node"
                raise FileNotFoundError(
                    f"{'; '.join(missing)}: not found on node {node}, where {name} runs. Models and other files "
                    "actors read must be at the same path on every node (docs/running.md, Attaching to a "
                    "cluster); copy them there, or keep the actors on nodes that have them (--ray-actor-resources)")
            super().__init__(*args, **kwargs)

    return _named_as(NodeChecked, cls)


def in_driver_cwd(cls: type, cwd: str) -> type:
    """`cls` whose constructor first sets DRIVER_CWD_ENV to `cwd` in its process (an actor has its
    worker process to itself), so that a user file given by a relative path is read from the driver's
    working directory (miles.user_code).

    Not through the actor's own runtime_env: an actor with one cannot take a worker Ray has already
    started, and each of its workers starts behind Ray's runtime-env setup process (measured on 2 cores:
    a bare actor ready in ~5 s instead of ~1 s, ~1 s more CPU)."""

    class InDriverCwd(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            os.environ[DRIVER_CWD_ENV] = cwd
            super().__init__(*args, **kwargs)

    return _named_as(InDriverCwd, cls)


def _named_as(sub: type, cls: type) -> type:
    """`sub` (a wrapper subclass) under `cls`'s names and docstring: Ray and the logs show the actor's own."""
    sub.__name__, sub.__qualname__ = cls.__name__, cls.__qualname__
    sub.__module__, sub.__doc__ = cls.__module__, cls.__doc__
    return sub


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_AUTH_NOTICE)


def quiet_token_auth_notice() -> None:
    """Ray >= 2.5x turns token authentication on for a local cluster and says so in a warning at every
    start. Authentication stays on; only that notice goes (the warning that it is *off* still shows).
    Not RAY_AUTH_MODE=token: Ray reads it into a config cached at import, so setting it here, after
    `import ray`, starts a cluster whose driver has no token."""
    log = logging.getLogger(TOKEN_AUTH_LOGGER)
    if not any(isinstance(f, _DropTokenAuthNotice) for f in log.filters):
        log.addFilter(_DropTokenAuthNotice())


def restore_sigchld() -> None:
    """With the subreaper option on, Ray's core worker sets SIGCHLD to SIG_IGN in the driver too (at
    the C level: Python's signal.getsignal still says SIG_DFL). Children of the driver are then
    reaped by the kernel and `subprocess` reports every exit status as 0. The raylet does the
    reaping the option is for; the driver gets the default back."""
    import signal

    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:            # not the main thread (an embedding host's worker thread): leave it
        pass


@contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Give the host (the CLI, an embedding program) back the SIGINT/SIGTERM/SIGHUP handlers it had."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
