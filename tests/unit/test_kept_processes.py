"""A worker's extra processes are started again when one dies (an OOM kill, kill -9), and not after stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from tokenfleet.processes import KeptProcesses

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)", "--name=w-1"]
QUITTER = [sys.executable, "-c", "raise SystemExit(3)", "--name=w-2"]


def popen(command: Sequence[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(command))


def wait_until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_killed_process_is_started_again_and_none_is_after_stop() -> None:
    said: list[str] = []
    kept = KeptProcesses([SLEEPER, SLEEPER], popen, said.append, poll_s=0.05)
    kept.start()
    try:
        first, second = kept.pids()
        os.kill(first, signal.SIGKILL)

        wait_until(lambda: kept.restarts == [1, 0])
        new, same = kept.pids()
        assert new != first and same == second
        assert said and f"process {first} (--name=w-1) ended with code -9" in said[0]
    finally:
        kept.stop()
    pids = kept.pids()
    time.sleep(0.3)
    assert kept.pids() == pids and kept.restarts == [1, 0]  # stopped: nothing started again


def test_a_process_that_keeps_dying_at_its_start_is_started_again_less_and_less_often() -> None:
    kept = KeptProcesses([QUITTER], popen, lambda _: None, poll_s=0.05)
    kept.start()
    try:
        time.sleep(5)  # waits of 1 s, then 2 s, then 4 s: two restarts by now, not one every poll
        assert kept.restarts == [2]
    finally:
        kept.stop()
