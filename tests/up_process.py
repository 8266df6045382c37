"""Stopping a `specdec up` a test started: as a user does, with Ctrl-C, which stops every
process it started (a SIGKILL would leave its workers, coordinator and Redis running)."""

from __future__ import annotations

import signal
import subprocess


def stop(process: subprocess.Popen, timeout_s: float = 120) -> None:
    """Ctrl-C and wait for it (its output drained); SIGKILL only if it does not stop."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
