"""The engine's compute threads run below everything else: parse the knob, lower a thread, inherit."""

from __future__ import annotations

import os
import threading

import pytest

from stages.runtime.cpu_priority import (
    ENV,
    CpuPriority,
    LowPriorityThreads,
    apply_to_current_thread,
)

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")


def test_parse_every_form_and_the_default(monkeypatch):
    assert CpuPriority.parse("idle") == CpuPriority(policy="idle", nice=0)
    assert CpuPriority.parse("batch") == CpuPriority(policy="batch", nice=0)
    assert CpuPriority.parse(" Batch:19 ") == CpuPriority(policy="batch", nice=19)
    assert CpuPriority.parse("nice:7") == CpuPriority(policy="nice", nice=7)
    assert CpuPriority.parse("normal") == CpuPriority(policy="normal", nice=0)
    monkeypatch.delenv(ENV, raising=False)
    assert CpuPriority.from_env() == CpuPriority(policy="batch", nice=19)
    monkeypatch.setenv(ENV, "nice:3")
    assert CpuPriority.from_env() == CpuPriority(policy="nice", nice=3)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fast", "give idle, batch, batch:N, nice:N or normal"),
        ("idle:3", "give idle, batch"),
        ("nice", "nice needs a value, e.g. nice:10"),
        ("nice:x", "'x' is not an integer"),
        ("nice:20", "nice=20: give 0..19"),
        ("batch:-1", "nice=-1: give 0..19"),
    ],
)
def test_bad_values_say_what_is_allowed(text, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(".", r"\.")) as err:
        CpuPriority.parse(text)
    if "nice=" not in says:
        assert ENV in str(err.value)


def _in_thread(fn):
    """Run fn in a fresh thread (which ends, so the priority change dies with it)."""
    out: dict = {}

    def body() -> None:
        out["value"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["value"]


@linux_only
def test_a_lowered_thread_and_the_threads_it_starts_run_batch_at_nice_19():
    def lowered_then_child() -> tuple:
        assert apply_to_current_thread(CpuPriority(policy="batch", nice=19))
        me = threading.get_native_id()
        child = _in_thread(
            lambda: (
                os.sched_getscheduler(threading.get_native_id()),
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
            )
        )
        return (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)), child

    mine, child = _in_thread(lowered_then_child)
    assert mine == (os.SCHED_BATCH, 19)
    assert child == (os.SCHED_BATCH, 19)
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER  # caller untouched


@linux_only
def test_idle_and_nice_policies():
    def idle() -> int:
        apply_to_current_thread(CpuPriority(policy="idle"))
        return os.sched_getscheduler(threading.get_native_id())

    def nice() -> tuple:
        apply_to_current_thread(CpuPriority(policy="nice", nice=12))
        tid = threading.get_native_id()
        return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)

    assert _in_thread(idle) == os.SCHED_IDLE
    assert _in_thread(nice) == (os.SCHED_OTHER, 12)


@linux_only
def test_ensure_lowers_each_calling_thread_once():
    lowered = LowPriorityThreads(CpuPriority(policy="nice", nice=5))

    def twice() -> int:
        lowered.ensure()
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 9)  # a second ensure() must not touch it again
        lowered.ensure()
        return os.getpriority(os.PRIO_PROCESS, tid)

    assert _in_thread(twice) == 9

    def fresh() -> int:
        lowered.ensure()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert _in_thread(fresh) == 5
