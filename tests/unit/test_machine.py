"""Loading and validating machine definitions: each defect named with its line."""

from __future__ import annotations

import textwrap

import pytest

from miles.runtime import MachineDefinitionError, PhaseContext, builtin_machines, load_machine, parse_machine
from miles.runtime.disposer import Disposer
from miles.runtime.trace import Tracer

GOOD = textwrap.dedent("""\
    name: tiny
    initial: init
    states:
      init:     {phase: "tests.unit.test_machine:phase"}
      draining: {phase: "tests.unit.test_machine:phase"}
      shutdown: {final: true}
    transitions:
      - {trigger: ready,  source: init,     dest: draining, conditions: all_good}
      - {trigger: finish, source: draining, dest: shutdown}
      - {trigger: fail,   source: draining, dest: shutdown}
      - {trigger: fail,   source: "*",      dest: draining}
      - {trigger: stop,   source: "*",      dest: draining}
    """)


async def phase(ctx):
    return "ready"


def problems_of(text):
    with pytest.raises(MachineDefinitionError) as info:
        parse_machine(text, source="test.yaml")
    return info.value.problems


def test_builtin_machines_load():
    assert {"sync", "eval_only"} <= set(builtin_machines())
    sync = load_machine("sync")
    assert sync.initial == "init" and sync.final_states == {"shutdown"}
    assert {"eval_due", "rollouts_left", "save_due"} == sync.guards
    assert len(sync.hash) == 16


def test_wildcard_expands_to_non_final_states_but_not_the_destination():
    m = parse_machine(GOOD)
    fails = {(t.source, t.dest) for t in m.transitions if t.trigger == "fail"}
    assert fails == {("init", "draining"), ("draining", "shutdown")}
    assert {t.source for t in m.transitions if t.trigger == "stop"} == {"init"}


def test_unknown_state_is_named_with_its_line():
    bad = GOOD.replace("  draining: {phase", "  drainng: {phase")
    probs = problems_of(bad)
    assert any("line 5: unknown state 'drainng'" in p for p in probs)


def test_transition_to_undeclared_state():
    bad = GOOD.replace("dest: draining, conditions", "dest: rollout, conditions")
    assert any("line 8" in p and "undeclared state 'rollout'" in p for p in problems_of(bad))


def test_missing_fail_route():
    bad = GOOD.replace('  - {trigger: fail,   source: "*",      dest: draining}\n', "")
    assert any("state 'init' has no 'fail' route" in p for p in problems_of(bad))


def test_state_that_cannot_reach_shutdown():
    bad = GOOD.replace("  shutdown: {final: true}", "  rollout:  {phase: \"tests.unit.test_machine:phase\"}\n  shutdown: {final: true}")
    bad = bad.replace('- {trigger: stop,   source: "*",      dest: draining}',
                      '- {trigger: stop,   source: [init], dest: draining}\n  - {trigger: stop, source: rollout, dest: rollout}\n  - {trigger: fail, source: rollout, dest: rollout}')
    probs = problems_of(bad)
    assert any("state 'rollout' cannot reach shutdown" in p for p in probs)


def test_handler_that_does_not_import_names_state_and_line():
    m = parse_machine(GOOD.replace("tests.unit.test_machine:phase", "no.such.module:phase", 1))
    with pytest.raises(MachineDefinitionError) as info:
        m.resolve_phases()
    assert "line 4: state 'init': phase 'no.such.module:phase'" in str(info.value)


def test_guard_the_context_does_not_define():
    m = parse_machine(GOOD)
    ctx = PhaseContext(tracer=Tracer(None, run_id="x"), disposer=Disposer())
    with pytest.raises(MachineDefinitionError, match="line 8: guard 'all_good'"):
        m.check_guards(ctx)


def test_not_yaml_and_missing_keys():
    assert "not valid YAML" in problems_of("name: [unclosed")[0]
    assert any("missing top-level key 'transitions'" in p for p in problems_of("name: x\ninitial: init\nstates: {}\n"))


def test_unknown_machine_name_lists_the_builtin_ones():
    with pytest.raises(MachineDefinitionError, match="built-in machines are .*sync"):
        load_machine("synk")
