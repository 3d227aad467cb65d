"""Simple paths through a machine's graph, for model-based tests of the runner and the checker.

Like xstate's `getSimplePaths`: every walk from the initial state to a final state that visits no
state twice, one edge per distinct (source, trigger, destination). `guard_values` says which guard
answers make the runner take a given edge, so a scripted context can drive the runner along a path
(`tests/unit/test_tracetools_paths.py` does, then checks each trace).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from miles.runtime.machine import MachineDef, TransitionDef

from .check import first_allowed


@dataclass(frozen=True)
class Step:
    src: str
    trigger: str
    dst: str
    guards: dict[str, bool]     # guard answers that make the runner choose `dst`

    def __str__(self) -> str:
        return f"{self.src} -{self.trigger}-> {self.dst}"


def guard_values(definition: MachineDef, src: str, trigger: str, dst: str) -> dict[str, bool] | None:
    """Answers for the guards of `trigger` at `src` under which the first allowed move goes to `dst`.

    None when no answers do (an edge shadowed by an unguarded earlier transition). Of several
    answers, the one with the fewest guards true, so paths read as "everything else was false".
    """
    options = definition.transitions_from(src, trigger)
    names = sorted({g for t in options for g in (*t.conditions, *t.unless)})
    candidates = sorted(product((False, True), repeat=len(names)), key=sum)
    for values in candidates:
        answers = dict(zip(names, values))
        chosen = first_allowed(options, answers)
        if chosen is not None and chosen.dest == dst:
            return answers
    return None


def edges(definition: MachineDef) -> list[Step]:
    """Every distinct (source, trigger, destination) the runner can take, in definition order."""
    seen: dict[tuple[str, str, str], Step] = {}
    for t in definition.transitions:
        key = (t.source, t.trigger, t.dest)
        if key in seen:
            continue
        answers = guard_values(definition, *key)
        if answers is not None:
            seen[key] = Step(t.source, t.trigger, t.dest, answers)
    return list(seen.values())


def simple_paths(definition: MachineDef) -> list[list[Step]]:
    """All paths from the initial state to a final state that repeat no state."""
    out_edges: dict[str, list[Step]] = {}
    for e in edges(definition):
        out_edges.setdefault(e.src, []).append(e)
    paths: list[list[Step]] = []

    def walk(state: str, visited: set[str], path: list[Step]) -> None:
        if state in definition.final_states:
            paths.append(list(path))
            return
        for e in out_edges.get(state, []):
            if e.dst not in visited:
                path.append(e)
                walk(e.dst, visited | {e.dst}, path)
                path.pop()

    walk(definition.initial, {definition.initial}, [])
    return paths


def unreachable_edges(definition: MachineDef) -> list[TransitionDef]:
    """Transitions no guard answers can select (shadowed by an earlier, unguarded sibling)."""
    return [t for t in definition.transitions
            if guard_values(definition, t.source, t.trigger, t.dest) is None]


def covering_paths(definition: MachineDef) -> list[list[Step]]:
    """The simple paths, plus one path through each edge they miss (the loops' back edges).

    A simple path never takes an edge back to a state it visited (train -> weight_sync), so each
    such edge gets the shortest path to its source, the edge, and the shortest way on to a final state.
    """
    paths = simple_paths(definition)
    covered = {(s.src, s.trigger, s.dst) for p in paths for s in p}
    for e in edges(definition):
        if (e.src, e.trigger, e.dst) in covered:
            continue
        head, tail = _shortest(definition, definition.initial, {e.src}), _shortest(
            definition, e.dst, definition.final_states)
        if head is not None and tail is not None:
            paths.append([*head, e, *tail])
            covered |= {(s.src, s.trigger, s.dst) for s in paths[-1]}
    return paths


def _shortest(definition: MachineDef, start: str, goals: set[str]) -> list[Step] | None:
    """Breadth-first: the fewest steps from `start` to any of `goals` ([] if already there)."""
    out_edges: dict[str, list[Step]] = {}
    for e in edges(definition):
        out_edges.setdefault(e.src, []).append(e)
    frontier: list[tuple[str, list[Step]]] = [(start, [])]
    seen = {start}
    while frontier:
        nxt = []
        for state, path in frontier:
            if state in goals:
                return path
            for e in out_edges.get(state, []):
                if e.dst not in seen:
                    seen.add(e.dst)
                    nxt.append((e.dst, [*path, e]))
        frontier = nxt
    return None
