"""Lifecycle definitions: load and validate `machines/<name>.yaml`, build the `transitions` machine.

A definition is data. It names its states (a subset of the fixed eight), the phase handler of each
(`module:function`), and its transitions with guards by name. One definition feeds the runner, the
diagram and the trace checker. `source: "*"` means every non-final state that has no explicit
transition for that trigger, other than the destination itself (a wildcard never makes a self-loop).
`draining` needs `fail` (to shutdown) and no `stop` route: a stop request while draining is moot. Every problem is reported with the line of the YAML key it concerns.

Every non-final state has a deadline: `timeout: SECONDS` in its entry (`rollout: {phase: ..., timeout:
3600}`), else DEFAULT_PHASE_TIMEOUT_S; `deadlines(overrides)` applies --phase-timeout. Past it the
runner cancels the phase and the run drains.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import inspect
import sys
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from transitions import Machine

STATES = ("init", "weight_sync", "rollout", "train", "save", "eval", "draining", "shutdown")
REQUIRED_STATES = ("init", "draining", "shutdown")
# routes every non-final state needs: `fail` (any error) and `stop` (a graceful stop request)
REQUIRED_ROUTES = ("fail", "stop")
FAIL, STOP, FINISH = "fail", "stop", "finish"
DEFAULT_PHASE_TIMEOUT_S = 3600.0   # a state whose YAML entry names no timeout gets an hour


class MachineDefinitionError(ValueError):
    """A machine YAML that cannot run; `problems` lists each one with its file and line."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"invalid machine definition {source}:\n" + "\n".join(f"  - {p}" for p in problems))


class MissingPackageError(ImportError):
    """A phase's module loads, but imports a package this Python does not have: the installation is
    short, the machine file is fine. The run's input (its environment), so it exits 2 (`input_fault`)."""

    input_fault = True

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"a package is missing (machine {source} itself is fine):\n"
                         + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class TransitionDef:
    trigger: str
    source: str
    dest: str
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    line: int = 0


@dataclass(frozen=True)
class StateDef:
    name: str
    phase: str | None            # "module:function"; None for the final state
    final: bool = False
    line: int = 0
    timeout_s: float | None = None   # `timeout:` seconds; None: DEFAULT_PHASE_TIMEOUT_S


@dataclass(frozen=True)
class MachineDef:
    name: str
    initial: str
    states: dict[str, StateDef]
    transitions: tuple[TransitionDef, ...]
    source: str                  # file path or "<string>"
    hash: str                    # sha256 of the YAML text (first 16 hex digits)
    text: str = field(repr=False, default="")

    @property
    def final_states(self) -> set[str]:
        return {s.name for s in self.states.values() if s.final}

    @property
    def drain_state(self) -> str:
        """Where a failure goes: the state that settles in-flight work before the teardown."""
        return self.transitions_from(self.initial, FAIL)[0].dest

    @property
    def terminal_state(self) -> str:
        """Where the run ends: the final state a failure while draining goes to."""
        return self.transitions_from(self.drain_state, FAIL)[0].dest

    def deadlines(self, overrides: dict[str, float] | None = None) -> dict[str, float]:
        """Seconds each non-final state's phase may run: `overrides` (--phase-timeout), else its YAML
        `timeout`, else DEFAULT_PHASE_TIMEOUT_S."""
        overrides = overrides or {}
        return {s.name: overrides.get(s.name, s.timeout_s or DEFAULT_PHASE_TIMEOUT_S)
                for s in self.states.values() if not s.final}

    @property
    def guards(self) -> set[str]:
        return {g for t in self.transitions for g in (*t.conditions, *t.unless)}

    def transitions_from(self, state: str, trigger: str | None = None) -> list[TransitionDef]:
        return [t for t in self.transitions if t.source == state and (trigger is None or t.trigger == trigger)]

    def resolve_phases(self) -> dict[str, Callable[..., Any]]:
        """Import every phase handler; errors name the state, the YAML line and the import path."""
        handlers, problems, missing = {}, [], []
        for s in self.states.values():
            if s.final:
                continue
            try:
                handlers[s.name] = import_handler(s.phase or "")
            except ModuleNotFoundError as exc:
                if _names_the_phase(exc.name, s.phase or ""):
                    problems.append(f"line {s.line}: state {s.name!r}: phase {s.phase!r} cannot be used: {exc}")
                else:
                    missing.append(f"state {s.name!r} (line {s.line}): its phase {s.phase} imports {exc.name!r}"
                                   f"{_importer(exc)}, which is not installed in this Python ({sys.prefix}); install "
                                   f"the package that provides it (miles' extras: pyproject.toml's "
                                   f"[project.optional-dependencies])")
            except (ImportError, AttributeError, ValueError, TypeError) as exc:
                problems.append(f"line {s.line}: state {s.name!r}: phase {s.phase!r} cannot be used: {exc}")
        if problems:
            raise MachineDefinitionError(self.source, problems)
        if missing:
            raise MissingPackageError(self.source, missing)
        return handlers

    def check_guards(self, context: Any) -> None:
        """Every guard the definition names must be a callable attribute of the run context."""
        problems = []
        for t in self.transitions:
            for g in (*t.conditions, *t.unless):
                if not callable(getattr(context, g, None)):
                    problems.append(f"line {t.line}: guard {g!r} of {t.source} -{t.trigger}-> {t.dest} "
                                    f"is not defined by {type(context).__name__}")
        if problems:
            raise MachineDefinitionError(self.source, sorted(set(problems)))

    def build(self, model: Any, guard: Callable[[str], Callable[[], bool]]) -> Machine:
        """A `transitions.Machine` on `model`; each guard name becomes the callable `guard(name)`. It
        only decides moves (the runner hands it guard values it evaluated once per decision)."""
        spec = [{"trigger": t.trigger, "source": t.source, "dest": t.dest,
                 "conditions": [guard(g) for g in t.conditions],
                 "unless": [guard(g) for g in t.unless]} for t in self.transitions]
        return Machine(model=model, states=list(self.states), transitions=spec, initial=self.initial,
                       auto_transitions=False, send_event=False, queued=False)


def _names_the_phase(module: str | None, phase: str) -> bool:
    """Whether the missing `module` is the phase's own module or a package above it (a wrong path in
    the machine file), rather than something that module imports."""
    own = phase.partition(":")[0]
    return module is None or own == module or own.startswith(module + ".")


def _importer(exc: BaseException) -> str:
    """' (at file:line)', the last frame of the traceback outside importlib: the import that failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    if not frames:
        return ""
    path = Path(frames[-1].filename)
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    return f" (at {shown}:{frames[-1].lineno})"


def import_object(path: str) -> Any:
    """The object a `package.module:name` path names (phase handlers, backend classes)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r}: expected 'package.module:name'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def import_handler(path: str) -> Callable[..., Any]:
    obj = import_object(path)
    if not inspect.iscoroutinefunction(obj):
        raise TypeError(f"{path} must be an async function taking the run context")
    return obj


# -- loading ---------------------------------------------------------------------------------------


# a source checkout run with only PYTHONPATH set has no `miles.machines` (setup.py maps the top-level
# machines/ folder to it at install time): the checkout's own folder is the same files
_CHECKOUT_MACHINES = Path(__file__).resolve().parents[2] / "machines"


def builtin_dir() -> Any:
    """The folder of the built-in machines: the installed `miles.machines`, else the checkout's machines/."""
    try:
        return importlib.resources.files("miles.machines")
    except ModuleNotFoundError:
        return _CHECKOUT_MACHINES


def builtin_machines() -> list[str]:
    return sorted(p.name[:-5] for p in builtin_dir().iterdir() if p.name.endswith(".yaml"))


def machine_path(name_or_path: str | Path) -> Path | None:
    """A built-in machine name (`sync`) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    res = builtin_dir() / f"{name_or_path}.yaml"
    return Path(str(res)) if res.is_file() else None


def load_machine(name_or_path: str | Path) -> MachineDef:
    path = machine_path(name_or_path)
    if path is None or not path.exists():
        raise MachineDefinitionError(str(name_or_path), [
            f"no machine named {str(name_or_path)!r}: built-in machines are {', '.join(builtin_machines())}; "
            "or pass a path to a .yaml file"])
    return parse_machine(path.read_text(encoding="utf-8"), source=str(path))


def parse_machine(text: str, *, source: str = "<string>") -> MachineDef:
    try:
        raw = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise MachineDefinitionError(source, [f"not valid YAML: {exc}"]) from exc
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise MachineDefinitionError(source, ["the top level must be a mapping with name, initial, states, transitions"])
    for key in ("name", "initial", "states", "transitions"):
        if key not in raw:
            problems.append(f"line {_line(raw)}: missing top-level key {key!r}")
    if problems:
        raise MachineDefinitionError(source, problems)
    states = _parse_states(raw["states"], problems)
    transitions = _parse_transitions(raw["transitions"], states, problems)
    if raw["initial"] not in states:
        problems.append(f"line {_line(raw, 'initial')}: initial state {raw['initial']!r} is not declared")
    _check_routes(states, transitions, problems)
    if problems:
        raise MachineDefinitionError(source, problems)
    return MachineDef(name=str(raw["name"]), initial=raw["initial"], states=states,
                      transitions=tuple(transitions), source=source,
                      hash=hashlib.sha256(text.encode()).hexdigest()[:16], text=text)


def _parse_states(raw: Any, problems: list[str]) -> dict[str, StateDef]:
    if not isinstance(raw, dict):
        problems.append("'states' must be a mapping of state name to {phase: ...} or {final: true}")
        return {}
    states = {}
    for name, spec in raw.items():
        line = _line(raw, name)
        if name not in STATES:
            problems.append(f"line {line}: unknown state {name!r}; the states are {', '.join(STATES)}")
            continue
        spec = spec or {}
        final = bool(spec.get("final", False))
        phase = spec.get("phase")
        if final and phase:
            problems.append(f"line {line}: state {name!r} is final and cannot have a phase")
        if not final and not isinstance(phase, str):
            problems.append(f"line {line}: state {name!r} needs 'phase: package.module:function'")
        states[name] = StateDef(name=name, phase=phase, final=final, line=line,
                                timeout_s=_timeout(name, spec, final, line, problems))
    for name in REQUIRED_STATES:
        if name not in states:
            problems.append(f"state {name!r} is required")
    if "shutdown" in states and not states["shutdown"].final:
        problems.append(f"line {states['shutdown'].line}: state 'shutdown' must be final (final: true)")
    return states


def _timeout(name: str, spec: dict, final: bool, line: int, problems: list[str]) -> float | None:
    value = spec.get("timeout")
    if value is None:
        return None
    if final:
        problems.append(f"line {line}: state {name!r} is final: it runs no phase and has no timeout")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        problems.append(f"line {line}: state {name!r}: timeout {value!r} must be a number of seconds > 0")
    else:
        return float(value)
    return None


def _parse_transitions(raw: Any, states: dict[str, StateDef], problems: list[str]) -> list[TransitionDef]:
    if not isinstance(raw, list):
        problems.append("'transitions' must be a list of {trigger, source, dest}")
        return []
    parsed: list[tuple[TransitionDef, list[str]]] = []
    for item in raw:
        line = _line(item)
        if not isinstance(item, dict) or not {"trigger", "source", "dest"} <= item.keys():
            problems.append(f"line {line}: a transition needs trigger, source and dest")
            continue
        sources = item["source"] if isinstance(item["source"], list) else [item["source"]]
        for name in [*([] if sources == ["*"] else sources), item["dest"]]:
            if name not in states:
                problems.append(f"line {line}: transition {item['trigger']!r} names undeclared state {name!r}")
        t = TransitionDef(trigger=item["trigger"], source="*", dest=item["dest"], line=line,
                          conditions=_names(item.get("conditions")), unless=_names(item.get("unless")))
        parsed.append((t, sources))
    explicit = {(s, t.trigger) for t, sources in parsed if sources != ["*"] for s in sources}
    non_final = [s for s, d in states.items() if not d.final]
    out = []
    for t, sources in parsed:
        expanded = ([s for s in non_final if (s, t.trigger) not in explicit and s != t.dest]
                    if sources == ["*"] else sources)
        out.extend(TransitionDef(t.trigger, s, t.dest, t.conditions, t.unless, t.line) for s in expanded)
    return out


def _check_routes(states: dict[str, StateDef], transitions: list[TransitionDef], problems: list[str]) -> None:
    for s in states.values():
        if s.final:
            if any(t.source == s.name for t in transitions):
                problems.append(f"line {s.line}: final state {s.name!r} cannot have outgoing transitions")
            continue
        for trigger in REQUIRED_ROUTES:
            if s.name == "draining" and trigger == STOP:
                continue
            if not any(t.source == s.name and t.trigger == trigger for t in transitions):
                problems.append(f"line {s.line}: state {s.name!r} has no {trigger!r} route; add "
                                + ("{trigger: fail, source: draining, dest: shutdown}" if s.name == "draining"
                                   else f"{{trigger: {trigger}, source: '*', dest: draining}}"))
    finals = {s.name for s in states.values() if s.final}
    reach = _can_reach(finals, transitions)
    for s in states.values():
        if s.name not in reach:
            problems.append(f"line {s.line}: state {s.name!r} cannot reach shutdown")


def _can_reach(targets: set[str], transitions: list[TransitionDef]) -> set[str]:
    back: dict[str, set[str]] = {}
    for t in transitions:
        back.setdefault(t.dest, set()).add(t.source)
    seen, todo = set(targets), deque(targets)
    while todo:
        for src in back.get(todo.popleft(), ()):
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (str(value),)


# -- YAML with line numbers ------------------------------------------------------------------------


class _LineDict(dict):
    line: int = 0
    key_lines: dict[Any, int]


class _LineLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> _LineDict:  # type: ignore[override]
        mapping = _LineDict(super().construct_mapping(node, deep=True))
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {self.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
        return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _LineLoader.construct_mapping)


def _line(mapping: Any, key: Any = None) -> int:
    if key is not None and isinstance(mapping, _LineDict):
        return mapping.key_lines.get(key, mapping.line)
    return getattr(mapping, "line", 0)
