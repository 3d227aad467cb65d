"""Functions users plug in by path (a reward, a filter, a loss, an importance-sampling weight): import
them, check that they can be called the way miles calls them, and name them as the user wrote them.

A path is `module:function`, `module.function`, `module:Class.method`, or `path/to/file.py:function`
(loaded from the file; nothing needs to be on PYTHONPATH, Ray workers included). Every problem is a
`ConfigError` naming the flag and the path as given, so it is reported at start-up, on the driver,
before any actor exists (exit 2): a module that does not import, raises while importing, lacks the
function, or a function whose signature cannot take miles' arguments.

A relative file path is read from the driver's working directory, in actors too. On a cluster the run
attaches to (`--ray-address`), the files travel with the run instead (miles.cluster.shipping): an actor
reads the copy its node received, found through `USER_FILES_ENV`, and nothing needs to be at the
driver's path there. A function loaded from a file lives in a module with a generated name;
`display_name(fn)` maps it back to what the user wrote (`reward.py:reward`, not
`miles_user_<digits>.reward`), so errors raised later, inside an actor, name it the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from miles.config import ConfigError


_FILE_MODULES: dict[str, str] = {}      # generated module name -> the file as the user wrote it
# the driver's working directory, which a relative file path is read from also inside an actor (whose
# own working directory is the Ray worker's): `RayCluster.actor` sets it in every actor's environment
DRIVER_CWD_ENV = "MILES_DRIVER_CWD"
# shipped files (--ray-address): JSON {path as the user wrote it: the copy, relative to the actor's working
# directory, which is the run's shipped folder (Ray's runtime_env working_dir)}
USER_FILES_ENV = "MILES_USER_FILES"


def split_path(path: str) -> tuple[str, str]:
    """`module:function`, `module.function`, `file.py:function` → (module or file, attribute path)."""
    module_name, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return module_name, attr


def import_user_function(path: str, flag: str) -> Callable[..., Any]:
    """The callable `path` names; a ConfigError naming `flag` and `path` for any problem."""
    module_name, attr = split_path(path)
    if not module_name or not attr:
        raise ConfigError(f"{flag} {path!r} must look like module:function, module.function or "
                          "path/to/file.py:function")
    try:
        obj: Any = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except FileNotFoundError as e:          # a file path: the fix is the path
        raise ConfigError(f"{flag} {path!r}: {e} (a relative path is read from the driver's working directory, "
                          f"{_driver_cwd()}); check the path") from e
    except ImportError as e:
        raise ConfigError(f"{flag} {path!r}: {_import_problem(module_name, e)}") from e
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing: their input, named
        raise ConfigError(f"{flag} {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ConfigError(f"{flag} {path!r}: {module_name!r} has no {attr!r} (AttributeError: {e})") from e
    if not callable(obj):
        raise ConfigError(f"{flag} {path!r} is not callable (a {type(obj).__name__}); point it at a function")
    return obj


def check_signature(fn: Callable[..., Any], flag: str, path: str, num_args: int, expected: str) -> None:
    """ConfigError unless `fn` accepts `num_args` positional arguments (`expected` shows the signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return                       # a builtin or C function without a signature: it will tell at the call
    try:
        sig.bind(*([None] * num_args))
    except TypeError as e:
        why = f"miles passes {num_args} arguments" if "too many" in str(e) else str(e)
        raise ConfigError(f"{flag} {path}: {display_name(fn)}{sig} cannot be called as {expected}: {why}") from None


def takes_parameter(fn: Callable[..., Any], position: int) -> str | None:
    """The name of `fn`'s positional parameter at `position`, or None."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    return params[position].name if len(params) > position else None


def display_name(fn: Callable[..., Any]) -> str:
    """`file.py:function` for a function loaded from a file, else `module:qualname`."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname:
        return repr(fn)
    return f"{_FILE_MODULES.get(module, module)}:{qualname}"


def _load_file(path: str) -> Any:
    file = _find_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {file}")
    name = f"miles_user_{abs(hash(str(file)))}"
    _FILE_MODULES[name] = path
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _import_problem(module_name: str, e: ImportError) -> str:
    """Why `module_name` did not import, and the fix: the path when the value names a file or looks like
    a path, the missing package when the module imported but its own import failed, else PYTHONPATH."""
    missing = getattr(e, "name", None)
    if isinstance(e, ModuleNotFoundError) and missing and not module_name.startswith(missing):
        what = "file" if module_name.endswith(".py") else "module"
        return (f"{what} {module_name!r} was found, but importing it failed: {e}; install {missing!r} "
                "where the run's processes can import it")
    as_file = module_name.replace(".", "/") + ".py"
    if "/" in module_name or os.sep in module_name:
        return (f"{module_name!r} looks like a path but has no .py: give the file, "
                f"{module_name}.py:FUNCTION, relative to the driver's working directory {_driver_cwd()}")
    if (Path(_driver_cwd()) / as_file).is_file():
        return (f"cannot import module {module_name!r} ({type(e).__name__}: {e}), but {as_file} is in the "
                f"driver's working directory: give the file, {as_file}:FUNCTION")
    return (f"cannot import module {module_name!r} ({type(e).__name__}: {e}); if it is a module, check that it "
            "is on PYTHONPATH; if it is your file, give its path: path/to/file.py:FUNCTION")


def _driver_cwd() -> str:
    return os.environ.get(DRIVER_CWD_ENV) or os.getcwd()


def _find_file(path: str) -> Path:
    """The shipped copy of `path` when the run shipped it (an actor on an attached cluster), else `path`
    read from the driver's working directory."""
    shipped = json.loads(os.environ.get(USER_FILES_ENV) or "{}")
    if path in shipped:
        return (Path.cwd() / shipped[path]).resolve()
    return (Path(_driver_cwd()) / path).resolve()


def import_async_function(path: str, flag: str, num_args: int, expected: str) -> Callable[..., Any]:
    """The async function `path` names, checked to be callable as `expected` with `num_args` arguments;
    a ConfigError naming `flag` and `path` for any problem."""
    fn = import_user_function(path, flag)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    if not is_async:
        raise ConfigError(f"{flag} {path}: {getattr(fn, '__qualname__', fn)!s} is not an async function; miles "
                          f"awaits it as {expected} (define it with `async def`)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn                       # no signature to check: it will tell at the call
    try:
        sig.bind(*([None] * num_args))
    except TypeError as exc:
        raise ConfigError(f"{flag} {path}: {getattr(fn, '__qualname__', fn)!s}{sig} cannot be called as {expected}: "
                          f"{exc}") from None
    return fn


# ---- --custom-config-path: miles' `args.my_key` --------------------------------------------------------

class CustomArgs(Mapping[str, Any]):
    """--custom-config-path's keys that name no flag (`RolloutConfig.custom_args`), read-only, by
    attribute (`args.my_key` in miles) or by key. A key the YAML lacks raises AttributeError (KeyError by key)
    naming the flag, so a typo does not read as None."""

    def __init__(self, values: Mapping[str, Any] | None = None):
        object.__setattr__(self, "_values", dict(values or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(_missing(name, values))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("--custom-config-path's values are read-only in a run")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"CustomArgs({self._values!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return CustomArgs, (self._values,)


def _missing(name: str, values: Mapping[str, Any]) -> str:
    keys = ", ".join(sorted(values)) or "none"
    return f"{name!r}: not a key of --custom-config-path (its keys: {keys})"


class CustomArgsAccess:
    """A context (`ctx`) of custom functions: a name that is not the context's own is looked up in the run's
    --custom-config-path keys (`self.rollout.custom_args`), as miles' functions read `args.my_key`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        rollout = self.__dict__.get("rollout")
        values = getattr(rollout, "custom_args", None) or {}
        if name in values:
            return values[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {_missing(name, values)}")


_CUSTOM_ARGS = CustomArgs()      # the process's: set by the executor and the trainers where they are built


def install_custom_args(values: Mapping[str, Any]) -> None:
    """Make `values` (RolloutConfig.custom_args) what `custom_args()` answers in this process."""
    global _CUSTOM_ARGS
    _CUSTOM_ARGS = CustomArgs(values)


def custom_args() -> CustomArgs:
    """The run's --custom-config-path keys, for a custom function that gets no `ctx` (a reward, a loss, a TIS
    function): `custom_args().my_key`. Set in the rollout executor and in every trainer process."""
    return _CUSTOM_ARGS
