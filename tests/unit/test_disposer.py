"""The disposer's contract: the seed's semantics, plus nothing lost, timeouts and escalation."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.runtime import Disposer, DisposerClosedError, TeardownTimeout, teardown_errors, with_disposer
from miles.runtime.trace import Tracer, read_trace


class Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def sync(self, name, exc=None):
        def fn():
            self.calls.append(name)
            if exc:
                raise exc
        fn.__qualname__ = name
        return fn

    def async_(self, name, exc=None, sleep=0.0):
        async def fn():
            await asyncio.sleep(sleep)
            self.calls.append(name)
            if exc:
                raise exc
        fn.__qualname__ = name
        return fn


def run(coro):
    return asyncio.run(coro)


def test_objects_with_dispose_and_callables_unwind_in_reverse_order():
    rec = Recorder()

    class Engine:
        async def dispose(self):
            rec.calls.append("engine")

    class Executor:
        def dispose(self):
            rec.calls.append("executor")

    async def main(*, disposer):
        disposer.add(Engine(), Executor())
        disposer.add(rec.sync("tracking"), functools.partial(rec.async_("partial")))
        return "result"

    assert run(with_disposer(main)) == "result"
    assert rec.calls == ["partial", "tracking", "executor", "engine"]


def test_partial_of_async_function_is_awaited():
    done = []

    async def stop(name):
        await asyncio.sleep(0)
        done.append(name)

    async def main(*, disposer):
        disposer.add(functools.partial(stop, "engine"))

    run(with_disposer(main))
    assert done == ["engine"]


def test_non_callable_without_dispose_is_rejected_naming_it_and_nothing_is_registered():
    d = Disposer()
    with pytest.raises(TypeError, match="42 has no dispose"):
        d.add(lambda: None, 42)
    assert d.names == []


def test_primary_failure_propagates_and_teardown_errors_are_attached():
    rec = Recorder()
    boom = ValueError("phase failed")

    async def main(*, disposer):
        disposer.add(rec.sync("a"), rec.sync("b", RuntimeError("b broke")), rec.async_("c", KeyError("c")))
        raise boom

    with pytest.raises(ValueError) as info:
        run(with_disposer(main))
    assert info.value is boom
    assert rec.calls == ["c", "b", "a"]                 # every one ran, in reverse
    errs = teardown_errors(info.value)
    assert [type(e) for e in errs] == [KeyError, RuntimeError]
    assert any("b broke" in n for n in info.value.__notes__)


def test_without_primary_one_teardown_error_propagates_as_itself():
    async def main(*, disposer):
        disposer.add(Recorder().sync("a", RuntimeError("only")))

    with pytest.raises(RuntimeError, match="only"):
        run(with_disposer(main))


def test_without_primary_several_teardown_errors_are_all_kept():
    # AsyncExitStack keeps only the last one (CPython #102201); we keep both
    rec = Recorder()

    async def main(*, disposer):
        disposer.add(rec.sync("a", RuntimeError("first")), rec.sync("b", OSError("second")))

    with pytest.raises(ExceptionGroup) as info:
        run(with_disposer(main))
    assert sorted(str(e) for e in info.value.exceptions) == ["first", "second"]


def test_cancellation_unwinds_and_is_reraised():
    rec = Recorder()
    entered = asyncio.Event()

    async def main(*, disposer):
        disposer.add(rec.async_("engine"), rec.sync("trainer"))
        entered.set()
        await asyncio.sleep(3600)

    async def host():
        task = asyncio.create_task(with_disposer(main))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(host())
    assert rec.calls == ["trainer", "engine"]


def test_keyboard_interrupt_unwinds_and_propagates():
    rec = Recorder()

    async def main(*, disposer):
        disposer.add(rec.sync("a"), rec.async_("b"))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(with_disposer(main))
    assert rec.calls == ["b", "a"]


def test_hanging_async_teardown_times_out_is_forced_and_the_unwind_goes_on():
    rec = Recorder()
    forced = []

    async def hang():
        await asyncio.sleep(3600)

    async def main():
        d = Disposer(default_timeout=5)
        d.add(rec.sync("first"))
        d.add(hang, name="stuck_engine", timeout=0.05, force=lambda: forced.append("kill"))
        d.add(rec.sync("last"))
        await d.close()
        return d

    d = run(main())
    assert rec.calls == ["last", "first"] and forced == ["kill"]
    assert [(o.name, o.outcome) for o in d.outcomes] == [("last", "ok"), ("stuck_engine", "forced"), ("first", "ok")]


def test_hanging_sync_teardown_without_force_is_reported_as_timeout():
    release = threading.Event()

    async def main():
        d = Disposer()
        d.add(lambda: release.wait(30), name="blocking", timeout=0.05)
        try:
            await d.close()
        finally:
            release.set()

    with pytest.raises(TeardownTimeout, match="blocking"):
        run(main())


def test_unwind_deadline_bounds_the_total_time():
    async def hang():
        await asyncio.sleep(3600)

    async def main():
        d = Disposer(default_timeout=10, deadline=0.2)
        for i in range(4):
            d.add(hang, name=f"h{i}")
        t0 = time.monotonic()
        errors = await d.unwind()
        return time.monotonic() - t0, errors

    elapsed, errors = run(main())
    assert len(errors) == 4 and all(isinstance(e, TeardownTimeout) for e in errors)
    # deadline 0.2 s, then a 0.5 s floor per remaining entry, plus cancel graces: far below 4 x 10 s
    assert elapsed < 10


def test_add_during_or_after_unwind_raises():
    async def main():
        d = Disposer()
        late = []

        def registers_late():
            try:
                d.add(lambda: None)
            except DisposerClosedError as exc:
                late.append(exc)

        d.add(registers_late)
        await d.close()
        assert len(late) == 1
        with pytest.raises(DisposerClosedError):
            d.add(lambda: None)

    run(main())


def test_async_context_manager_form():
    rec = Recorder()

    async def main():
        async with Disposer() as d:
            d.add(rec.sync("x"), rec.sync("y"))
        return rec.calls

    assert run(main()) == ["y", "x"]


def test_registrations_and_teardowns_are_trace_events(tmp_path):
    async def main():
        tracer = Tracer(tmp_path / "trace.jsonl", run_id="r1")
        d = Disposer(tracer=tracer)
        d.add(Recorder().sync("engine"), Recorder().sync("trainer", RuntimeError("x")))
        await d.unwind()
        tracer.close()

    run(main())
    trace = read_trace(tmp_path)
    reg = trace.of("registered")
    assert [(e.get("position"), e.get("resource")) for e in reg] == [(0, "engine"), (1, "trainer")]
    disposed = trace.of("disposed")
    assert [(e.get("resource"), e.get("outcome")) for e in disposed] == [("trainer", "error"), ("engine", "ok")]
    assert disposed[0].error["type"] == "RuntimeError" and disposed[1].duration_s >= 0
    assert [e.seq for e in trace] == list(range(1, len(trace.events) + 1))


teardown_kinds = st.lists(
    st.tuples(st.sampled_from(["sync", "async"]), st.sampled_from(["ok", "raise", "hang"])),
    min_size=0, max_size=7)


@settings(max_examples=40, deadline=None)
@given(kinds=teardown_kinds, primary=st.booleans())
def test_any_mix_unwinds_in_exact_reverse_order_and_loses_nothing(kinds, primary):
    calls: list[int] = []

    def make(i, sync, behaviour):
        if sync:
            def fn():
                calls.append(i)
                if behaviour == "raise":
                    raise RuntimeError(f"t{i}")
                if behaviour == "hang":
                    time.sleep(0.2)
            return fn

        async def afn():
            calls.append(i)
            if behaviour == "raise":
                raise RuntimeError(f"t{i}")
            if behaviour == "hang":
                await asyncio.sleep(3600)
        return afn

    async def main(*, disposer):
        for i, (kind, behaviour) in enumerate(kinds):
            disposer.add(make(i, kind == "sync", behaviour), name=f"t{i}", timeout=0.02)
        if primary:
            raise LookupError("primary")

    expected_errors = {f"t{i}" for i, (_, b) in enumerate(kinds) if b != "ok"}
    try:
        run(with_disposer(main, disposer=Disposer(force_timeout=0.02)))
        raised = None
    except BaseException as exc:  # noqa: BLE001
        raised = exc
    assert calls == list(reversed(range(len(kinds))))
    if primary:
        assert isinstance(raised, LookupError)
        got = teardown_errors(raised)
    elif not expected_errors:
        assert raised is None
        got = []
    else:
        got = list(raised.exceptions) if isinstance(raised, BaseExceptionGroup) else [raised]
    # RuntimeError("t3") raised by the teardown; TeardownTimeout("teardown of t3 did not finish ...")
    names = {str(e).split()[2] if isinstance(e, TeardownTimeout) else str(e) for e in got}
    assert names == expected_errors
