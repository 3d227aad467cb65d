"""The weight-sync read-back: what each engine holds against what it was given, engines named."""

from __future__ import annotations

from miles.phases.weights import engine_problems

NAMES = ["engine-0", "engine-1-r1"]


def test_engines_holding_what_they_were_given_pass():
    assert engine_problems(NAMES, 3, "abc", [(3, "abc"), (3, "abc")]) == []
    assert engine_problems(NAMES, 3, None, [(3, None), (3, "anything")]) == []   # versions only


def test_an_engine_on_another_version_is_named_with_both_versions():
    assert engine_problems(NAMES, 3, None, [(3, None), (2, None)]) == ["engine-1-r1 holds weight version 2, not 3"]


def test_an_engine_with_other_weights_under_the_right_version_is_named():
    bad = engine_problems(NAMES, 3, "a" * 64, [(3, "b" * 64), (3, "a" * 64)])
    assert bad == [f"engine-0 holds weights with checksum {'b' * 12}, the trainer's v3 is {'a' * 12}"]
