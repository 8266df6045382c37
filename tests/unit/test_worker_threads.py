"""specdec.worker.threads: the loading thread and the model thread, named as the OS shows them."""

from __future__ import annotations

import sys
import threading

import pytest

from specdec.worker.threads import (
    LOAD_THREAD,
    MODEL_THREAD,
    bind_plan,
    format_cpus,
    model_thread,
    on_a_passing_thread,
    parse_cpu_list,
)


def os_name() -> str:
    """The calling thread's name as the OS has it (what top -H and ps -L show)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names")


@needs_linux
def test_loading_runs_on_a_named_thread_that_is_gone_afterwards():
    seen = on_a_passing_thread(lambda a, b: (os_name(), threading.get_native_id(), a + b), 2, 3)
    name, native_id, total = seen
    assert name == LOAD_THREAD and total == 5
    assert native_id != threading.get_native_id()
    assert native_id not in {t.native_id for t in threading.enumerate()}


def test_a_loading_error_is_raised_to_the_caller():
    def fails():
        raise ValueError("dtype: bfloat16 is not supported here")

    with pytest.raises(ValueError, match="dtype"):
        on_a_passing_thread(fails)
    assert not [t for t in threading.enumerate() if t.name.startswith(LOAD_THREAD)]


@needs_linux
def test_the_model_thread_is_named():
    executor = model_thread()
    try:
        assert executor.submit(os_name).result() == MODEL_THREAD
        assert os_name() != MODEL_THREAD  # the caller's own name is left alone
    finally:
        executor.shutdown()


def test_cpu_lists_parse_as_taskset_writes_them():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("3,1") == [3, 1]  # the order is the pinning order
    for bad, says in [("1-0", "empty range"), ("0,0", "twice"), ("a", "not auto"), ("1,", "not")]:
        with pytest.raises(ValueError, match=f"--cpu-bind: .*{says}"):
            parse_cpu_list(bad)
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_auto_pins_only_where_the_worker_has_exactly_its_threads_cpus():
    assert bind_plan("auto", 2, "cpu", {0, 1}) == [0, 1]
    assert bind_plan("auto", 4, "cpu", {4, 5, 6, 7}) == [4, 5, 6, 7]
    assert bind_plan("auto", 2, "cpu", {0, 1, 2, 3}) == []  # shared: not ours to pin
    assert bind_plan("auto", 1, "cpu", {3}) == []  # one thread: nothing to gain
    assert bind_plan("auto", 2, "cuda:0", {0, 1}) == []
    assert bind_plan("auto", 2, "cpu", None) == []  # the OS does not say
    assert bind_plan("off", 2, "cpu", {0, 1}) == []


def test_a_cpu_list_must_fit_threads_and_the_allowed_cpus():
    assert bind_plan("2,0", 2, "cpu", {0, 1, 2, 3}) == [2, 0]
    assert bind_plan("0-1", 2, "cuda", {0, 1}) == [0, 1]  # named: pinned on any device
    with pytest.raises(ValueError, match="--cpu-bind: '0-2' names 3 CPUs for --threads 2"):
        bind_plan("0-2", 2, "cpu", {0, 1, 2})
    with pytest.raises(ValueError, match=r"--cpu-bind: CPU 9 is not one .* \(0-3\)"):
        bind_plan("0,9", 2, "cpu", {0, 1, 2, 3})
