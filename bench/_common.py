"""Shared pieces of the benchmarks: a simulator process, worker processes, a Redis database, tables."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import httpx
import redis

from tokenfleet.processes import free_port, redis_pid, start_worker, stop_process, wait_for_workers

BENCH_REDIS_URL = os.environ.get("TOKENFLEET_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


@contextmanager
def sim_process(**flags: Any) -> Iterator[str]:
    """``tokenfleet sim`` in its own process (as a real server would be); yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "tokenfleet.sim", "--port", str(port)]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the simulator did not start")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def sim_stats(url: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(url + "/sim/stats", timeout=10).json()
    return data


#: The simulator's counters without its maps by rid prefix. Those grow by an entry per plain-client request
#: (its rids share no prefix): read whole ten times a second, they slowed the plain client (whose process
#: parsed them) by a third within a set of runs, and not the fleet.
TOTALS: Final = "/sim/stats?totals=1"


def sim_generated_tokens(url: str, client: httpx.Client | None = None) -> int:
    """The simulator's generated-token count, from its counters alone (``TOTALS``); through ``client``
    when given (a reader that asks often keeps its connection)."""
    reply = client.get(url + TOTALS) if client is not None else httpx.get(url + TOTALS, timeout=10)
    return int(reply.json()["generated_tokens"])


class TokenTimeline:
    """The simulator's generated-token count, read every ``every_s`` while a run goes on: the same
    instrument for both sides of a paired run, so their start, steady rate and end compare fairly."""

    def __init__(self, url: str, every_s: float = 0.1) -> None:
        self.url = url
        self.every_s = every_s
        self.points: list[tuple[float, int]] = []  # (monotonic time, tokens generated so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TokenTimeline:
        self.started = time.monotonic()
        self._base = sim_generated_tokens(self.url)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ended = time.monotonic()
        self._stop.set()
        self._thread.join()
        self.points.append((self.ended, sim_generated_tokens(self.url) - self._base))

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.every_s):
                tokens = sim_generated_tokens(self.url, client)
                self.points.append((time.monotonic(), tokens - self._base))

    def _crossing(self, tokens: float) -> float:
        """When the count first reached ``tokens`` (linear between readings)."""
        before = (self.started, 0)
        for t, n in self.points:
            if n >= tokens:
                t0, n0 = before
                return t0 + (t - t0) * ((tokens - n0) / (n - n0) if n > n0 else 1.0)
            before = (t, n)
        return self.ended

    def last_token_at(self) -> float:
        """When the count first reached its last reading: the run's last token."""
        total = self.points[-1][1] if self.points else 0
        return next((t for t, n in self.points if n >= total), self.ended)

    def figures(self, started: float | None = None) -> dict[str, float]:
        """``first_token_s``: from ``started`` (the timeline's start by default) until the server produced;
        ``after_last_s``: from its last token until the run ended; ``steady_tps``: the rate between 10%
        and 90% of the run's tokens."""
        start = self.started if started is None else started
        total = self.points[-1][1] if self.points else 0
        last = self.last_token_at()
        t10, t90 = self._crossing(0.1 * total), self._crossing(0.9 * total)
        return {
            "first_token_s": self._crossing(1) - start,
            "after_last_s": self.ended - last,
            "steady_tps": 0.8 * total / (t90 - t10) if t90 > t10 else float("nan"),
            "ramp_s": t10 - start,
            "tail_s": last - t90,
        }


@contextmanager
def bench_redis() -> Iterator[str]:
    client = redis.Redis.from_url(BENCH_REDIS_URL)
    client.ping()
    client.flushdb()
    try:
        yield BENCH_REDIS_URL
    finally:
        client.flushdb()
        client.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids() -> dict[int, str]:
    """This process's descendants (pid -> command line), from ``/proc``: children and theirs (a default
    ``tokenfleet worker`` starts its other processes itself, and their CPU is the fleet's too)."""
    found: dict[int, str] = {}
    parents = [os.getpid()]
    while parents:
        parent = parents.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                with contextlib.suppress(OSError):
                    for pid in (task / "children").read_text().split():
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                        if int(pid) not in found:
                            found[int(pid)] = cmdline
                            parents.append(int(pid))
    return found


class CpuMeter:
    """CPU time spent by named groups of processes between ``start`` and ``stop``."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self._before: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in self.groups.items()}

    def start(self) -> None:
        self._before = self._now()

    def stop(self) -> dict[str, float]:
        after = self._now()
        return {name: after[name] - self._before[name] for name in self.groups}


def fleet_cpu_meter(redis_url: str) -> CpuMeter:
    """A meter over this process (the anchor, or submit's producer), its worker and simulator children,
    and the Redis server (local: its pid from INFO)."""
    children = child_pids()
    server_pid = redis_pid(redis_url)
    if server_pid is None:
        raise RuntimeError(f"no Redis answers at {redis_url}")
    return CpuMeter(
        {
            "this process (anchor / producer)": [os.getpid()],
            # celery retitles its process: "[celeryd: NAME] ... (worker --concurrency=...)"
            "worker processes": [pid for pid, cmd in children.items() if "worker" in cmd],
            "simulator": [pid for pid, cmd in children.items() if "tokenfleet.sim" in cmd],
            "redis-server": [server_pid],
        }
    )


@contextmanager
def worker_processes(redis_url: str, processes: int, concurrency: int, logs: Path) -> Iterator[None]:
    logs.mkdir(parents=True, exist_ok=True)
    names = [f"bench{i}-{os.getpid()}" for i in range(processes)]
    procs = [
        start_worker(redis_url, concurrency=concurrency, name=n, log_path=logs / f"{n}.log") for n in names
    ]
    try:
        wait_for_workers(redis_url, names)
        yield
    finally:
        for p in procs:
            stop_process(p)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    text = "\n".join(lines)
    print(text)
    return text
