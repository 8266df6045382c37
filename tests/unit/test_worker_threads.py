"""specdec.worker.threads: the loading thread and the model thread, named as the OS shows them."""

from __future__ import annotations

import sys
import threading

import pytest

from specdec.worker.threads import LOAD_THREAD, MODEL_THREAD, model_thread, on_a_passing_thread


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
